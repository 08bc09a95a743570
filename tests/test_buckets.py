"""Size buckets: policy syntax and its errors, per-bucket resolution, the bind dispatcher,
group comparison per bucket, and how explain shows them."""
import importlib
import json
import types

import pytest

import capdispatch as cd
from capdispatch import extend
from capdispatch.backends import Backend, Op, Registry, TritonTarget
from capdispatch.backends.base import SizeArg
from capdispatch.backends.registry import BUILTIN_OP_PACKAGES
from capdispatch.dispatch.explain import plan, render_text
from capdispatch.dispatch.resolver import known_device_names
from capdispatch.policies import PolicyError, parse

DECODE = """\
ops:
  decode_mla:
    - {tokens: "<=16", prefer: [triton_fp8, flashmla]}
    - {tokens: "<=64", prefer: [triton, flashmla]}
    - {prefer: [flashmla, flashinfer_sparse_mla, triton_fp8]}
"""


def _parse(text, registry=None):
    return parse(text, "p.yaml", registry or cd.dispatch.resolver.builtin(),
                 known_devices=known_device_names())


def _policy(tmp_path, text, name="p.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# --------------------------------------------------------------------------- #
# Syntax
# --------------------------------------------------------------------------- #
def test_buckets_parse_in_ops_and_devices_and_the_plain_form_still_works():
    pf = _parse(DECODE + "  kv_quant: [torch]\ndevices:\n  - match: {cc: '9.0'}\n    ops:\n"
                "      kv_dequant:\n        - {rows: '<=4096', prefer: [triton_u8]}\n"
                "        - {prefer: [triton_fp8]}\n")
    d = pf.ops["decode_mla"]
    assert d.value == ("flashmla", "flashinfer_sparse_mla", "triton_fp8") and d.line == 5
    assert [(b.upper, b.backends, b.line) for b in d.buckets] == [
        (16, ("triton_fp8", "flashmla"), 3), (64, ("triton", "flashmla"), 4),
        (None, ("flashmla", "flashinfer_sparse_mla", "triton_fp8"), 5)]
    assert pf.ops["kv_quant"].value == ("torch",) and pf.ops["kv_quant"].buckets == ()
    kd = pf.devices[0].ops["kv_dequant"]
    assert [(b.upper, b.backends) for b in kd.buckets] == [(4096, ("triton_u8",)), (None, ("triton_fp8",))]


def test_a_lone_catch_all_is_the_plain_form():
    pf = _parse("ops:\n  kv_quant:\n    - {prefer: [torch, triton_u8]}\n")
    assert pf.ops["kv_quant"].value == ("torch", "triton_u8") and pf.ops["kv_quant"].buckets == ()


@pytest.mark.parametrize("body,line,needles", [
    # bad bounds
    ('    - {tokens: "<16", prefer: [torch]}\n    - {prefer: [torch]}\n', 3,
     ["'<16' is not a bucket bound", '"<=N"']),
    ('    - {tokens: "<=0", prefer: [torch]}\n    - {prefer: [torch]}\n', 3, ["'<=0' is not a bucket bound"]),
    ('    - {tokens: 16, prefer: [torch]}\n    - {prefer: [torch]}\n', 3, ["16 is not a bucket bound"]),
    ('    - {tokens: "<=sixteen", prefer: [torch]}\n    - {prefer: [torch]}\n', 3, ["not a bucket bound"]),
    # unsorted / overlapping
    ('    - {tokens: "<=64", prefer: [torch]}\n    - {tokens: "<=16", prefer: [triton]}\n'
     '    - {prefer: [torch]}\n', 4, ['"<=16" is below the bound of the bucket before it', 'line 3']),
    ('    - {tokens: "<=16", prefer: [torch]}\n    - {tokens: "<=16", prefer: [triton]}\n'
     '    - {prefer: [torch]}\n', 4, ['"<=16" repeats the bound', 'increasing order']),
    # the catch-all
    ('    - {tokens: "<=16", prefer: [torch]}\n    - {tokens: "<=64", prefer: [triton]}\n', 3,
     ["no catch-all bucket for tokens above 64", "{prefer: [...]}"]),
    ('    - {prefer: [torch]}\n    - {tokens: "<=64", prefer: [triton]}\n', 4,
     ["after the catch-all bucket (line 3)", "never apply"]),
    # names
    ('    - {tokens: "<=16", prefer: [triton_fp9]}\n    - {prefer: [torch]}\n', 3,
     ["unknown backend 'triton_fp9' for op decode_mla", "did you mean 'triton_fp8'"]),
    ('    - {tokens: "<=16", prefer: []}\n    - {prefer: [torch]}\n', 3, ["the list is empty"]),
    ('    - {tokens: "<=16", prefer: [torch, torch]}\n    - {prefer: [torch]}\n', 3, ["listed twice"]),
    ('    - {tokens: "<=16"}\n    - {prefer: [torch]}\n', 3, ["needs 'prefer'"]),
    ('    - {tokns: "<=16", prefer: [torch]}\n    - {prefer: [torch]}\n', 3,
     ["unknown key 'tokns'", "did you mean 'tokens'", "valid: tokens, prefer"]),
    ('    - {rows: "<=16", prefer: [torch]}\n    - {prefer: [torch]}\n', 3,
     ["unknown key 'rows'", "decode_mla buckets on tokens", "'q'"]),
    ('    - {tokens: "<=16", prefer: [torch]}\n    - torch\n', 4, ["'torch' is a backend name in a list of buckets"]),
])
def test_bucket_errors_name_file_line_value_and_what_is_valid(body, line, needles):
    with pytest.raises(PolicyError) as ei:
        _parse("ops:\n  decode_mla:\n" + body)
    msg = str(ei.value)
    assert ei.value.line == line, msg
    assert msg.startswith(f"p.yaml:{line}: ")
    for n in needles:
        assert n in msg, msg


def test_kv_ops_bucket_on_rows_and_errors_inside_devices_carry_their_line():
    with pytest.raises(PolicyError) as ei:
        _parse("devices:\n  - match: {cc: '9.0'}\n    ops:\n      kv_dequant:\n"
               "        - {tokens: '<=4', prefer: [torch]}\n        - {prefer: [torch]}\n")
    assert ei.value.line == 5 and "kv_dequant buckets on rows" in str(ei.value)
    assert "'token_ids'" in str(ei.value)


def test_an_op_without_a_size_takes_no_buckets():
    reg = _toy_registry(size=None)
    with pytest.raises(PolicyError, match="op toy takes no size buckets"):
        _parse("ops:\n  toy:\n    - {tokens: '<=4', prefer: [small]}\n    - {prefer: [large]}\n", reg)


# --------------------------------------------------------------------------- #
# Resolution
# --------------------------------------------------------------------------- #
def test_each_bucket_is_resolved_and_backend_stays_the_catch_all(clean_env, tmp_path):
    r = cd.resolve("decode_mla", "sim:h200", policy=_policy(tmp_path, DECODE), assume_libs=["triton"])
    assert r.backend == "flashmla" and r.size_key == "tokens"
    assert [(b.lower, b.upper, b.backend, b.fallback) for b in r.buckets] == [
        (None, 16, "triton_fp8", False), (16, 64, "triton", False), (64, None, "flashmla", False)]
    assert r.buckets[0].source.endswith("p.yaml:3") and r.buckets[2].source == r.source
    # every check of every candidate, in every bucket
    assert all(len(b.candidates) == len(r.candidates) for b in r.buckets)
    assert [c.preferred for c in r.buckets[1].candidates][:2] == [True, True]
    assert r.backend_for(1) == "triton_fp8" and r.backend_for(16) == "triton_fp8"
    assert r.backend_for(17) == "triton" and r.backend_for(65) == "flashmla"
    d = r.to_dict()["buckets"]
    assert [(b["tokens"], b["backend"]) for b in d] == [("<=16", "triton_fp8"), ("<=64", "triton"),
                                                        (">64", "flashmla")]


def test_no_buckets_means_an_empty_list(clean_env):
    r = cd.resolve("kv_dequant", "sim:h200", assume_libs=["triton"])
    assert r.buckets == () and r.to_dict()["buckets"] == []


def test_a_bucket_that_cannot_run_downgrades_loudly_or_refuses_under_strict(clean_env, tmp_path, caplog):
    pol = _policy(tmp_path, DECODE)
    r = cd.resolve("decode_mla", "sim:rtx-3080", policy=pol, assume_libs=["triton"])
    b0 = r.buckets[0]
    assert b0.backend == "triton" and b0.downgraded_from == "triton_fp8"
    assert any("decode_mla[tokens <= 16]=triton_fp8 was asked for" in w and "p.yaml:3" in w
               for w in r.warnings)
    only_small = _policy(tmp_path, "ops:\n  decode_mla:\n    - {tokens: '<=16', prefer: [triton_fp8]}\n"
                                   "    - {prefer: [triton]}\n", "s.yaml")
    with pytest.raises(cd.Unsatisfiable, match=r"decode_mla\[tokens <= 16\]=triton_fp8.*s.yaml:3"):
        cd.resolve("decode_mla", "sim:rtx-3080", policy=only_small, assume_libs=["triton"], strict=True)


def test_a_higher_layer_speaks_for_every_size(clean_env, tmp_path):
    r = cd.resolve("decode_mla", "sim:h200", policy=_policy(tmp_path, DECODE),
                   selections={"decode_mla": "triton"}, assume_libs=["triton"])
    assert r.backend == "triton" and r.buckets == ()
    dev = ("devices:\n  - match: {name: h200}\n    ops:\n      decode_mla:\n"
           "        - {tokens: '<=8', prefer: [triton]}\n        - {prefer: [triton_fp8]}\n")
    r = cd.resolve("decode_mla", "sim:h200", policy=[_policy(tmp_path, DECODE), _policy(tmp_path, dev, "d.yaml")],
                   assume_libs=["triton"])
    assert [(b.upper, b.backend) for b in r.buckets] == [(8, "triton"), (None, "triton_fp8")]
    assert "d.yaml:5 (device name h200)" in r.buckets[0].source


# --------------------------------------------------------------------------- #
# bind
# --------------------------------------------------------------------------- #
def _toy_registry(size=SizeArg("tokens", 0, "x")):
    reg = Registry()
    for pkg in BUILTIN_OP_PACKAGES:
        importlib.import_module(pkg).register(reg)
    reg.add_op(Op("toy", "a toy op", "toy(x, scale=1.0, *, out=None)", reference="large", size=size))
    for name in ("small", "medium", "large"):
        reg.add_backend(Backend("toy", name, f"bucket_toy:{name}", requires=()))
    reg.add_backend(Backend("toy", "nowhere", "bucket_toy:large", requires=(TritonTarget("8.0"),)))
    return reg


def _x(n):
    return types.SimpleNamespace(shape=(n, 3))


def test_bind_dispatches_on_the_leading_dimension(clean_env, tmp_path):
    reg = _toy_registry()
    pol = _policy(tmp_path, "ops:\n  toy:\n    - {tokens: '<=4', prefer: [small]}\n"
                            "    - {tokens: '<=8', prefer: [small]}\n    - {tokens: '<=64', prefer: [medium]}\n"
                            "    - {prefer: [large]}\n")
    fn = cd.bind("toy", "cpu", policy=pol, registry=reg)
    # adjacent buckets with one winner merge
    assert fn.buckets == ((8, "small"), (64, "medium"), (None, "large"))
    assert fn.__name__ == "toy_by_tokens"
    for n, want in [(1, "small"), (8, "small"), (9, "medium"), (64, "medium"), (65, "large"), (4096, "large")]:
        assert fn(_x(n)) == (want, n)
        assert fn(x=_x(n), scale=2.0) == (want, n)          # the size argument by keyword
    one = cd.bind("toy", "cpu", registry=reg, policy=_policy(
        tmp_path, "ops:\n  toy:\n    - {tokens: '<=16', prefer: [small]}\n    - {prefer: [large]}\n", "one.yaml"))
    assert one.buckets == ((16, "small"), (None, "large"))
    assert [one(_x(n))[0] for n in (1, 16, 17)] == ["small", "small", "large"]


def test_bind_returns_the_kernel_itself_when_no_bucket_changes_the_choice(clean_env, tmp_path):
    reg = _toy_registry()
    # every bucket's first choice cannot run on cpu: all fall back to one kernel
    pol = _policy(tmp_path, "ops:\n  toy:\n    - {tokens: '<=4', prefer: [nowhere, large]}\n"
                            "    - {prefer: [large]}\n")
    fn = cd.bind("toy", "cpu", policy=pol, registry=reg)
    import bucket_toy
    assert fn is bucket_toy.large and not hasattr(fn, "buckets")
    # buckets that end in the catch-all's winner fold into it
    pol = _policy(tmp_path, "ops:\n  toy:\n    - {tokens: '<=4', prefer: [small]}\n"
                            "    - {tokens: '<=8', prefer: [large]}\n    - {prefer: [large]}\n", "q.yaml")
    assert cd.bind("toy", "cpu", policy=pol, registry=reg).buckets == ((4, "small"), (None, "large"))


def test_bind_with_buckets_on_a_real_op_matches_the_reference(clean_env, tmp_path):
    import torch
    from capdispatch.backends import v4_layout as layout
    clean_env.setenv("TRITON_INTERPRET", "1")
    pol = _policy(tmp_path, "ops:\n  kv_dequant:\n    - {rows: '<=2', prefer: [torch]}\n"
                            "    - {prefer: [triton_u8]}\n")
    fn = cd.bind("kv_dequant", "cpu", policy=pol)
    assert fn.buckets == ((2, "torch"), (None, "triton_u8"))
    ref = cd.bind("kv_dequant", "cpu", backend="torch")
    gen = torch.Generator().manual_seed(7)
    pool = torch.zeros(3, layout.bytes_per_page(4), dtype=torch.uint8)
    cd.bind("kv_quant", "cpu", backend="torch")(torch.randn(12, 512, generator=gen).bfloat16(), pool,
                                                 torch.arange(12), 4)
    for ids in (torch.tensor([0, 5]), torch.tensor([1, 2, 3, 9, 11])):
        got, want = fn(pool, ids, 4), ref(pool, ids, 4)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# --------------------------------------------------------------------------- #
# Groups and explain
# --------------------------------------------------------------------------- #
SMALL_ONLY = ("devices:\n  - match: {name: h200}\n    ops:\n      kv_quant:\n"
              "        - {rows: '<=16', prefer: [triton_u8]}\n        - {prefer: [triton_fp8]}\n"
              "mixed_group: {mode}\n")


def test_groups_compare_per_bucket(clean_env, tmp_path):
    # Both cards run triton_fp8 for the catch-all; only the small bucket differs.
    devs = ["sim:h200", "sim:rtx-4090"]
    g = cd.resolve_group("kv_quant", devs, assume_libs=["triton"],
                         policy=_policy(tmp_path, SMALL_ONLY.replace("{mode}", "warn")))
    assert {r.backend for r in g.per_device.values()} == {"triton_fp8"}
    assert not g.uniform and len(g.warnings) == 1
    assert "[rows <= 16]" in g.warnings[0] and "triton_u8" in g.warnings[0]
    with pytest.raises(cd.Unsatisfiable, match=r"\[rows <= 16\].*mixed_group is error"):
        cd.resolve_group("kv_quant", devs, assume_libs=["triton"],
                         policy=_policy(tmp_path, SMALL_ONLY.replace("{mode}", "error"), "e.yaml"))
    g = cd.resolve_group("kv_quant", devs, assume_libs=["triton"],
                         policy=_policy(tmp_path, SMALL_ONLY.replace("{mode}", "uniform"), "u.yaml"))
    assert g.uniform
    for r in g.per_device.values():
        assert [(b.upper, b.backend) for b in r.buckets] == [(16, "triton_u8"), (None, "triton_fp8")]
    assert "alone it would run triton_fp8" in g.per_device["sim:rtx-4090"].buckets[0].source
    # same buckets everywhere: no divergence
    g = cd.resolve_group("kv_quant", ["sim:h200", "sim:h200"], assume_libs=["triton"],
                         policy=_policy(tmp_path, SMALL_ONLY.replace("{mode}", "error"), "s.yaml"))
    assert g.uniform


def test_explain_shows_buckets_with_their_file_and_line(clean_env, tmp_path):
    pol = _policy(tmp_path, DECODE)
    p = plan(["sim:h200"], ["decode_mla", "kv_quant"], policy=pol, assume_libs=["triton"])
    text = render_text(p)
    assert "buckets:" in text
    assert "tokens <=16 -> triton_fp8" in text and f"# {pol}:3" in text
    assert "tokens >64  -> flashmla" in text
    obj = json.loads(json.dumps(p.to_dict()))
    per = obj["ops"]["decode_mla"]["per_device"]["sim:h200"]
    assert [(b["tokens"], b["backend"], b["source"]) for b in per["buckets"]] == [
        ("<=16", "triton_fp8", f"{pol}:3"), ("<=64", "triton", f"{pol}:4"), (">64", "flashmla", f"{pol}:5")]
    assert obj["ops"]["kv_quant"]["per_device"]["sim:h200"]["buckets"] == []


def test_cli_explain_and_policy_show_print_buckets(run_cli, tmp_path):
    pol = _policy(tmp_path, DECODE)
    rc, out, err = run_cli("explain", "--device", "sim:h200", "--op", "decode_mla", "--policy", pol,
                           "--assume-lib", "triton", "--format", "json")
    assert rc == 0, err
    b = json.loads(out)["ops"]["decode_mla"]["per_device"]["sim:h200"]["buckets"]
    assert [x["backend"] for x in b] == ["triton_fp8", "triton", "flashmla"]
    rc, out, err = run_cli("policy", "show", "--policy", pol)
    assert rc == 0, err
    assert f'- {{tokens: "<=16", prefer: [triton_fp8, flashmla]}}    # {pol}:3' in out
    rc, out, err = run_cli("policy", "validate", _policy(tmp_path, "ops:\n  decode_mla:\n"
                                                         "    - {tokens: '<=8', prefer: [torch]}\n", "bad.yaml"))
    assert rc == 2 and "bad.yaml:3" in err and "no catch-all bucket" in err


def test_moe_buckets_keep_the_catch_alls_weight_layout(clean_env, tmp_path):
    # flashinfer_cutlass_w4a16 needs its own weight layout; triton_w4a16 the checkpoint's.
    pol = _policy(tmp_path, "ops:\n  moe:\n    - {tokens: '<=16', prefer: [flashinfer_cutlass_w4a16, triton_w4a16]}\n"
                            "    - {prefer: [triton_w4a16]}\n")
    r = cd.resolve("moe", "sim:h200", policy=pol, assume_libs=["triton", "flashinfer-python"])
    b0 = r.buckets[0]
    assert b0.backend == "triton_w4a16" and b0.downgraded_from == "flashinfer_cutlass_w4a16"
    bad = next(c for c in b0.candidates if c.backend == "flashinfer_cutlass_w4a16")
    lay = next(ch for ch in bad.checks if ch.code == "layout")
    assert not lay.ok and lay.found == "flashinfer_cutlass_sm90" and lay.need.startswith("checkpoint")
    assert any("one call site holds one layout" in w for w in r.warnings)


def test_the_agreement_digest_covers_buckets(clean_env, tmp_path):
    from capdispatch.dispatch.agreement import digest
    small = _policy(tmp_path, "ops:\n  decode_mla:\n    - {tokens: '<=16', prefer: [triton_fp8]}\n"
                              "    - {prefer: [flashmla]}\n", "a.yaml")
    other = _policy(tmp_path, "ops:\n  decode_mla:\n    - {tokens: '<=32', prefer: [triton_fp8]}\n"
                              "    - {prefer: [flashmla]}\n", "b.yaml")
    plain = plan(["sim:h200"], ["decode_mla"], assume_libs=["triton"])
    a = plan(["sim:h200"], ["decode_mla"], policy=small, assume_libs=["triton"])
    b = plan(["sim:h200"], ["decode_mla"], policy=other, assume_libs=["triton"])
    assert a.ops["decode_mla"].per_device["sim:h200"].backend == plain.ops["decode_mla"].per_device["sim:h200"].backend
    assert len({digest(plain), digest(a), digest(b)}) == 3
    assert digest(a) == digest(plan(["sim:h200"], ["decode_mla"], policy=small, assume_libs=["triton"]))


def test_the_dispatcher_names_a_missing_size_argument(clean_env, tmp_path):
    reg = _toy_registry()
    pol = _policy(tmp_path, "ops:\n  toy:\n    - {tokens: '<=4', prefer: [small]}\n    - {prefer: [large]}\n")
    fn = cd.bind("toy", "cpu", policy=pol, registry=reg)
    with pytest.raises(TypeError, match="toy: missing its size argument 'x' \\(position 0\\)"):
        fn(scale=2.0)


def test_bind_resolution_binds_the_decision_made_and_leaves_native_buckets_to_the_caller(clean_env, tmp_path):
    """bind_resolution binds a Resolution without resolving again; the NATIVE backend's
    buckets are None entries: pick(n) says None (the caller runs its own kernel), and
    calling the dispatcher there is refused with the table; a decision won by NATIVE
    at every size binds to None."""
    reg = _toy_registry()
    pol = _policy(tmp_path, "ops:\n  toy:\n    - {tokens: '<=4', prefer: [small]}\n"
                            "    - {tokens: '<=64', prefer: [medium]}\n    - {prefer: [large]}\n")
    ctx = cd.context(policy=pol, registry=reg)
    res = cd.dispatch.resolver.resolve_in(ctx, "toy", cd.dispatch.resolver.as_spec("cpu"))
    fn = cd.bind_resolution(res, registry=reg)
    assert fn.buckets == ((4, "small"), (64, "medium"), (None, "large")) and not fn.keeps
    assert [fn(_x(n)) for n in (3, 30, 300)] == [("small", 3), ("medium", 30), ("large", 300)]
    kept = cd.bind_resolution(res, registry=reg, native="medium", checks=False)
    assert kept.keeps and kept.pick(30) is None and kept.pick(3)(_x(3)) == ("small", 3)
    assert kept(_x(300)) == ("large", 300)
    with pytest.raises(extend.ArgumentTypeError, match=r"toy: size 30 is in a bucket the caller's own kernel runs "
                                                   r"\(<= 4: small, <= 64: medium \(the caller's own\), else large\)"):
        kept(_x(30))
    assert "medium (the caller's own)" in kept.__doc__
    one = cd.dispatch.resolver.resolve_in(cd.context(registry=reg, selections=["toy=large"]), "toy",
                                          cd.dispatch.resolver.as_spec("cpu"))
    assert cd.bind_resolution(one, registry=reg, native="large") is None
    import bucket_toy
    assert cd.bind_resolution(one, registry=reg) is bucket_toy.large
