"""The SGLang adapter's own logic on simulated rigs: the knob map, the version
range, GPU enumeration, decisions, architecture facts, and `dispatch sglang plan`
without SGLang arguments. None of this needs SGLang installed."""
from __future__ import annotations

import json
import logging
import os

import attrs
import pytest

import capdispatch as cd
from capdispatch.models import model_calls
from capdispatch.adapters.sglang import sglang_facts, decide, knobs, launch, render, gpus, versions

HERE = os.path.dirname(os.path.abspath(__file__))
POL = os.path.join(HERE, "policies")
RIG = "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080"
VERSION = "0.5.23"


@pytest.fixture
def env(monkeypatch):
    """A clean decision environment: no capdispatch variables, no SGLang KV layout."""
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", gpus.SIM_ENV,
              "SGLANG_DSV4_KV_LAYOUT"):
        monkeypatch.delenv(k, raising=False)
    e = {k: v for k, v in os.environ.items()}
    e[gpus.SIM_ENV] = RIG
    return e


@pytest.fixture
def release():
    return knobs.load().release(VERSION)


def _decide(env, release, ids=(0, 1, 2), **kw):
    specs = gpus.devices(list(ids), env=env)
    return decide.decide(specs, ("kv_quant", "kv_dequant"), release, env=env, **kw)


# --------------------------------------------------------------------------- knob map

def test_knob_map_loads_with_kv_rows(release):
    assert release is not None
    # A route for exactly the model ops whose backends the map routes (`route:` entries).
    routed = {e.op for e in release.entries.values() if e.kind == "route"}
    assert {r.op for r in release.routes} == routed and routed <= set(model_calls().ops)
    assert release.route("kv_dequant").native == "triton_fp8"
    assert release.route("kv_quant").native is None
    assert release.models["DeepseekV4ForCausalLM"].ops == model_calls().ops
    # Which ops run whatever the KV-cache dtype is the declaration's (its ops not `kv_pool`):
    # the experts do, the KV, indexer and attention ops work on the fp8 pool.
    anyd = release.models["DeepseekV4ForCausalLM"].any_kv_cache_dtype
    assert anyd == tuple(c.op for c in model_calls().calls if not c.kv_pool)
    assert "moe" in anyd and "kv_quant" not in anyd and "decode_mla" not in anyd
    assert {(s.kind, s.name) for s in release.settings} == {("field", "kv_cache_dtype"),
                                                            ("env", "SGLANG_DSV4_KV_LAYOUT")}
    # The site SGLang calls depends on the card: SM120 has its own decode and indexer entries.
    sm86, sm90, sm120 = (cd.probe(f"sim:{n}") for n in ("sm_86", "sm_90", "sm_120"))
    site = lambda op, d: release.route(op, d).target.rsplit(".", 1)[-1]  # noqa: E731
    assert site("decode_mla", sm86) == site("decode_mla", sm90) == "flash_mla_with_kvcache"
    assert site("decode_mla", sm120) == "flash_mla_with_kvcache_sm120"
    assert site("indexer", sm90) == "fp8_paged_mqa_logits_torch"
    assert site("indexer", sm120) == "fp8_paged_mqa_logits_torch_sm120"
    assert site("sparse_prefill", sm86) == "flash_mla_sparse_fwd" and release.route("sparse_prefill", sm120) is None
    assert dict(release.route("indexer", sm86).env) == {
        "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "true", "SGLANG_OPT_USE_TILELANG_INDEXER": "false",
        "SGLANG_OPT_USE_AITER_INDEXER": "false"}
    assert release.route_env_names() == ("SGLANG_FP8_PAGED_MQA_LOGITS_TORCH", "SGLANG_OPT_USE_TILELANG_INDEXER",
                                         "SGLANG_OPT_USE_AITER_INDEXER")
    k = knobs.load()
    assert k.release("0.5.22") is None and k.release("0.6.0") is None and k.release("junk") is None


def _edited(tmp_path, old, new):
    text = open(knobs.DEFAULT_PATH).read()
    assert old in text
    path = tmp_path / "knobs.yaml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize("old,new,message", [
    ('        cc: ">=12.0,<13.0"\n        why: SGLang\'s SM120 decode', '        cc: "sm120"\n        why: x',
     ".cc: 'sm120' is not a version range"),
    ('SGLANG_OPT_USE_AITER_INDEXER: "false"}', "SGLANG_OPT_USE_AITER_INDEXER: false}",
     ".env: expected a mapping of environment names to string values"),
    ("flash_mla_interface.flash_mla_sparse_fwd", "flash_mla_interface.flash_mla_with_kvcache",
     "flash_mla_with_kvcache is routed twice"),
    ("        op: kv_dequant\n        target", "        op: kv_dequnt\n        target", "unknown op 'kv_dequnt'"),
    ("native: triton_fp8", "native: triton_fp9", "unknown backend 'triton_fp9' for kv_dequant"),
    ("value: v4", "value: v41\n      - ops: [kv_dequant]\n        env: SGLANG_DSV4_KV_LAYOUT\n        value: v4",
     "SGLANG_DSV4_KV_LAYOUT is set to 'v4' here and 'v41' in another row"),
    ('tested: ">=0.5.17,<0.5.24"', 'tested: "at least 0.5"', "'at least 0.5' is not a version range"),
    ('api: "0.5.17"', 'api: "0.5.71"', "unknown SGLang API '0.5.71'"),
    ("call: store_v4\n", "call: store_v5\n", "unknown call wrapper 'store_v5'"),
    ("field: kv_cache_dtype\n", "field: kv_cache_dtype\n        env: X\n", "exactly one of 'field' or 'env'"),
])
def test_knob_map_errors_name_the_problem(tmp_path, old, new, message):
    with pytest.raises(knobs.KnobsError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        knobs.load(_edited(tmp_path, old, new))
    # file:line, as the policy loader says it
    assert str(e.value).startswith(f"{tmp_path / 'knobs.yaml'}:")


def test_knob_map_errors_point_at_the_line(tmp_path):
    path = _edited(tmp_path, "native: triton_fp8", "native: triton_fp9")
    line = next(i for i, x in enumerate(open(path).read().splitlines(), 1) if "triton_fp9" in x)
    with pytest.raises(knobs.KnobsError) as e:
        knobs.load(path)
    assert str(e.value).startswith(f"{path}:{line}: releases[0].routes[0]: unknown backend 'triton_fp9' "
                                   f"for kv_dequant; did you mean 'triton_fp8'?")
    path = _edited(tmp_path, "    hooks:\n", "    hooks:\n      rank: x\n")
    with pytest.raises(knobs.KnobsError, match=r"knobs.yaml:\d+: .*key 'rank' given twice"):
        knobs.load(path)


# --------------------------------------------------------------------------- versions

@pytest.mark.parametrize("version,ok", [("0.5.23", True), ("0.5.23.post1", True), ("0.5.24", False),
                                        ("0.5.17", True), ("0.5.17.post1", True), ("0.5.16", False),
                                        ("0.5.18", False), ("0.5.20", False), ("0.5.22", False),
                                        ("0.4.0", False), ("1.0.0", False)])
def test_version_range(version, ok):
    v = versions.check(version, knobs.load())
    assert v.ok is ok
    if not ok:
        # 0.5.18 to 0.5.22 lie inside `tested` but have no release entry: outside all the same.
        assert "outside the tested range >=0.5.17,<0.5.24" in v.message
        assert "changes nothing" in v.message


def test_release_entries_pick_their_sglang_api():
    from capdispatch.adapters.sglang import compat
    k = knobs.load()
    assert [(str(r.spec), r.api) for r in k.releases] == [("<0.5.24,>=0.5.23", "0.5.23"),
                                                         ("<0.5.18,>=0.5.17", "0.5.17")]
    assert compat.of(k.release("0.5.17")).name == "0.5.17" and compat.of(k.release("0.5.23")).name == "0.5.23"
    r17 = k.release("0.5.17")
    assert {(s.kind, s.name) for s in r17.settings} == {("field", "kv_cache_dtype")}
    assert {s.field for s in r17.selects} == {"moe_runner_backend"}
    assert r17.arch["platform"] == {}
    assert {r.name: (r.target, r.call) for r in r17.routes if r.target.startswith("sgl_kernel.")} == {
        "mla_decode": ("sgl_kernel.flash_mla.flash_mla_with_kvcache", "mla_decode_sgl_kernel"),
        "mla_sparse_prefill": ("sgl_kernel.flash_mla.flash_mla_sparse_fwd", "mla_sparse_prefill_sgl_kernel")}
    assert dict(r17.route("kv_quant").env) == {"SGLANG_OPT_USE_FUSED_STORE_CACHE": "true"}
    sm90, sm120 = cd.probe("sim:sm_90"), cd.probe("sim:sm_120")
    nb = r17.route("moe").native_by
    assert (nb.default_for(sm90), nb.default_for(sm120)) == ("auto", "flashinfer_mxfp4")


def test_version_unreadable():
    v = versions.check("not-a-version", knobs.load())
    assert not v.ok and "cannot read the SGLang version 'not-a-version'" in v.message


def test_register_outside_range_warns_once_and_registers_nothing(monkeypatch, caplog):
    import sys

    import capdispatch.adapters.sglang as plugin
    monkeypatch.setattr(plugin, "_done", {})
    before = set(sys.modules)
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert plugin.register(sglang_version="0.5.22") is False
        assert plugin.register() is False          # idempotent: no second warning
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "SGLang 0.5.22 is outside the tested range" in warnings[0].getMessage()
    # Nothing of SGLang was even imported to register hooks.
    assert not any(m.startswith("sglang.srt.plugins") for m in set(sys.modules) - before)


# --------------------------------------------------------------------------- the launch's GPUs

@pytest.mark.parametrize("kw,ids", [
    (dict(tp_size=3), [0, 1, 2]),
    (dict(tp_size=2, base_gpu_id=2, gpu_id_step=2), [2, 4]),
    (dict(tp_size=2, pp_size=2), [0, 1, 2, 3]),
    (dict(tp_size=2, dp_size=2), [0, 1, 2, 3]),
    (dict(tp_size=2, dp_size=2, dp_attention=True), [0, 1]),
    (dict(tp_size=4, nnodes=2, node_rank=1), [0, 1]),
])
def test_gpu_ids_follow_sglangs_launcher(kw, ids):
    assert gpus.gpu_ids(**kw) == ids


@pytest.mark.parametrize("kw,message", [(dict(tp_size=0), "tp_size=0"),
                                        (dict(tp_size=2, gpu_id_step=0), "gpu_id_step=0"),
                                        (dict(tp_size="2"), "tp_size='2'")])
def test_gpu_ids_bad_input(kw, message):
    with pytest.raises(cd.BadInput, match=message):
        gpus.gpu_ids(**kw)


def test_simulated_gpus_are_read_at_call_time(monkeypatch):
    monkeypatch.setenv(gpus.SIM_ENV, "sim:h200,sim:rtx-3080")
    d = gpus.device(1)
    assert (d.id, d.name, d.cc, d.simulated) == ("cuda:1", "NVIDIA GeForce RTX 3080", (8, 6), True)
    monkeypatch.setenv(gpus.SIM_ENV, "sim:rtx-5090")
    assert gpus.device(0).cc == (12, 0)


@pytest.mark.parametrize("value,index,message", [
    (RIG, 3, "lists 3 device\\(s\\) \\(cuda:0..cuda:2\\) but the launch uses cuda:3"),
    ("sim:rtx-5090,,sim:rtx-3080", 0, "an empty entry"),
    ("sim:rtx-9999", 0, "entry 0: .*rtx-9999"),
])
def test_simulated_gpus_bad_input(value, index, message):
    with pytest.raises(cd.BadInput, match=message):
        gpus.device(index, env={gpus.SIM_ENV: value})


# --------------------------------------------------------------------------- decisions

def test_applicable_ops(release):
    dsv4 = model_calls().ops
    assert decide.applicable_ops(release, "DeepseekV4ForCausalLM", "auto")[0] == dsv4
    assert decide.applicable_ops(release, "DeepseekV4ForCausalLM", "fp8_e4m3")[0] == dsv4
    ops, why = decide.applicable_ops(release, "DeepseekV4ForCausalLM", "bfloat16")
    # The experts run whatever the KV-cache dtype; the KV and attention ops need the fp8 pool:
    # what the model declaration says (`kv_pool`), read from there.
    assert ops == tuple(c.op for c in model_calls().calls if not c.kv_pool)
    assert "moe" in ops and "kv_quant" not in ops and "decode_mla" not in ops
    assert "kv_cache_dtype=bfloat16" in why and f"{', '.join(ops)} run{'s' if len(ops) == 1 else ''} with any" in why
    assert decide.applicable_ops(release, "LlamaForCausalLM", "auto")[0] == ()
    assert decide.applicable_ops(release, None, "auto")[0] == ()


def test_which_ops_run_under_any_kv_dtype_is_read_from_the_model_declaration(tmp_path, monkeypatch):
    """The knob map says under which KV-cache dtypes the pool is kept; which ops need it is the
    declaration's `kv_pool`: a declaration that puts the experts on the pool and takes
    kv_dequant off it moves them across."""
    from capdispatch.models import calls
    text = open(calls._path(), encoding="utf-8").read()
    moe = next(ln for ln in text.splitlines() if ln.strip().startswith("moe:"))
    deq = next(ln for ln in text.splitlines() if ln.strip().startswith("kv_dequant:"))
    assert moe.endswith("}") and ", kv_pool: true}" in deq
    edited = tmp_path / "calls.yaml"
    edited.write_text(text.replace(moe, moe[:-1] + ", kv_pool: true}").replace(deq, deq.replace(", kv_pool: true", "")))
    monkeypatch.setattr(calls, "_path", lambda: str(edited))
    rel = knobs.load.__wrapped__(knobs.DEFAULT_PATH).release(VERSION)     # read now, not the cached map
    ops, why = decide.applicable_ops(rel, "DeepseekV4ForCausalLM", "bfloat16")
    assert "kv_dequant" in ops and "moe" not in ops and "kv_dequant" in why
    assert decide.applicable_ops(rel, "DeepseekV4ForCausalLM", "auto")[0] == model_calls().ops


def test_route_wrappers_pass_what_they_do_not_cover_to_sglang():
    """A wrapper runs the bound kernel only for the call it covers; anything else (no
    kernel for this device, another cache format, another head dim) is SGLang's call,
    with the same arguments."""
    import torch

    from capdispatch.adapters.sglang import routes
    seen = []

    def original(*args, **kwargs):
        seen.append((args, kwargs))
        return "sglang"

    q = torch.zeros(2, 1, 4, 512, dtype=torch.bfloat16)
    v4 = torch.zeros(3, 16, 1, 584, dtype=torch.uint8)
    v41 = torch.zeros(3, 16, 1, 528, dtype=torch.uint8)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    key = ("cpu", None)
    calls = []
    kernel = lambda *a, **k: calls.append((a, k)) or ("out", "lse")  # noqa: E731
    try:
        assert routes.mla_decode(original, q, v4, None, None, 512, None, is_fp8_kvcache=True,
                                 indices=idx) == "sglang"                               # nothing bound
        routes._KERNELS.setdefault("decode_mla", {})[key] = kernel
        assert routes.mla_decode(original, q, v41, None, None, 512, None, is_fp8_kvcache=True,
                                 indices=idx) == "sglang"                               # V4.1 format
        assert routes.mla_decode(original, q, v4, None, None, 512, None) == "sglang"    # dense call
        assert routes.mla_decode_sm120(original, q=q, k_cache=v41, head_dim_v=512, indices=idx) == "sglang"
        assert not calls and len(seen) == 4
        assert seen[1][1] == {"use_legacy": True} and seen[1][0][1] is v41
        got = routes.mla_decode(original, q, v4, None, None, 512, None, softmax_scale=0.25,
                                is_fp8_kvcache=True, indices=idx)
        assert got == ("out", "lse")
        args = calls[0][0]
        assert args[1] is v4 and args[2] is idx and args[3] == 16 and args[4] == 0.25
        routes._KERNELS.setdefault("sparse_prefill", {})[key] = kernel
        q3 = torch.zeros(5, 4, 512, dtype=torch.bfloat16)
        assert routes.mla_sparse_prefill(original, q3, q3, idx, 0.1, d_v=256) == "sglang"
        assert routes.mla_sparse_prefill(original, q3, q3, idx, 0.1, use_legacy=False) == ("out", "lse")
        assert calls[-1][1] == {"use_legacy": False}
    finally:
        routes._KERNELS.pop("decode_mla", None)
        routes._KERNELS.pop("sparse_prefill", None)


def test_0517_route_wrappers_call_sglang_kernel_with_its_own_parameters():
    """SGLang 0.5.17's targets (sglang-kernel 0.4.5's FlashMLA, the layout-free KV
    functions) take no kv_format / use_legacy / layout / freqs_cis: what a wrapper does
    not cover goes to them with exactly their parameters."""
    import torch

    from capdispatch.adapters.sglang import routes
    seen, calls = [], []

    def original(*args, **kwargs):
        seen.append((args, kwargs))
        return "sglang"
    kernel = lambda *a, **k: calls.append((a, k)) or ("out", "lse")  # noqa: E731
    q = torch.zeros(2, 1, 4, 512, dtype=torch.bfloat16)
    v4 = torch.zeros(3, 16, 1, 584, dtype=torch.uint8)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    key = ("cpu", None)
    try:
        assert routes.mla_decode_sgl_kernel(original, q, v4, None, None, 512, "sched", is_fp8_kvcache=True,
                                            indices=idx) == "sglang"
        assert len(seen[-1][0]) == 18 and seen[-1][1] == {} and seen[-1][0][5] == "sched"
        routes._KERNELS.setdefault("decode_mla", {})[key] = kernel
        assert routes.mla_decode_sgl_kernel(original, q, v4, None, None, 512, "sched", softmax_scale=0.25,
                                            is_fp8_kvcache=True, indices=idx) == ("out", "lse")
        args = calls[-1][0]
        assert args[1] is v4 and args[2] is idx and args[3] == 16 and args[4] == 0.25
        q3 = torch.zeros(5, 4, 512, dtype=torch.bfloat16)
        assert routes.mla_sparse_prefill_sgl_kernel(original, q3, q3, idx, 0.1) == "sglang"
        assert seen[-1] == ((q3, q3, idx, 0.1, 512, None, None), {})
        routes._KERNELS.setdefault("sparse_prefill", {})[key] = kernel
        assert routes.mla_sparse_prefill_sgl_kernel(original, q3, q3, idx, 0.1) == ("out", "lse")
        assert calls[-1][1] == {"use_legacy": True}          # 0.4.5's lse is base-2
        pool, ids = torch.zeros(2, 37440, dtype=torch.uint8), torch.zeros(3, dtype=torch.int32)
        assert routes.dequant_v4_nolayout(original, pool, ids, 64) == "sglang"
        assert seen[-1] == ((pool, ids, 64), {"out": None})
        k = torch.zeros(3, 512, dtype=torch.bfloat16)
        routes._KERNELS.setdefault("kv_quant", {})[key] = kernel
        assert routes.store_v4_nolayout(original, k, pool, ids, page_size=64, type="indexer") == "sglang"
        assert seen[-1] == ((k, pool, ids), {"page_size": 64, "type": "indexer"})
        assert routes.store_v4_nolayout(original, k, pool, ids, page_size=64, type="flashmla") is None
        assert calls[-1][0] == (k, pool, ids, 64)
    finally:
        for op in ("decode_mla", "sparse_prefill", "kv_quant"):
            routes._KERNELS.pop(op, None)


def test_route_switches_are_set_and_restored_in_the_ranks_environment(release):
    from capdispatch.adapters.sglang import routes
    route = release.route("indexer", cd.probe("sim:rtx-3080"))
    environ = {"SGLANG_OPT_USE_TILELANG_INDEXER": "true", "OTHER": "x"}
    assert routes.switch_env(route, environ) == ["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=true",
                                                 "SGLANG_OPT_USE_TILELANG_INDEXER=false",
                                                 "SGLANG_OPT_USE_AITER_INDEXER=false"]
    assert routes.switch_env(route, environ) == []                 # already switched: nothing to say
    assert routes.restore_env(route, environ) == ["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH",
                                                  "SGLANG_OPT_USE_TILELANG_INDEXER",
                                                  "SGLANG_OPT_USE_AITER_INDEXER"]
    assert environ == {"SGLANG_OPT_USE_TILELANG_INDEXER": "true", "OTHER": "x"}
    assert routes.restore_env(route, environ) == []


def test_a_rank_that_keeps_sglangs_indexer_undoes_the_launchers_device0_switches(release, monkeypatch):
    """An H200 rank of a rig whose device 0 is an RTX 5090: SGLang's launcher turned its
    TileLang/torch indexer switches on for every rank; DeepGEMM runs on the H200, so the
    rank unsets what the user did not set (the user's own values stay)."""
    from capdispatch.adapters.sglang import decide as D
    from capdispatch.adapters.sglang import rank, routes
    spec = cd.probe("sim:h200")
    res = cd.resolve("indexer", spec, assume_libs=["sgl-deep-gemm", "tilelang", "triton"])
    assert res.backend == "deepgemm"
    choice = D.OpChoice("indexer", spec.id, res, "kept", "kept")
    environ = {"SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1", "SGLANG_OPT_USE_TILELANG_INDEXER": "1"}
    key = ("cpu", None)
    rank.apply_routes(release, {"indexer": choice}, spec, key, environ,
                      user_env={"SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1"})
    assert environ == {"SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1"}
    assert routes.kernel("indexer", key) is None


def _without_module(monkeypatch, *names):
    """NAMES fail to import in this process, as on a machine without them (None in
    sys.modules: ModuleNotFoundError), and SGLang's interface module is imported anew."""
    import sys
    for n in names:
        monkeypatch.setitem(sys.modules, n, None)
    iface = "sglang.kernels.ops.attention.flash_mla_interface"
    monkeypatch.delitem(sys.modules, iface, raising=False)
    pkg = sys.modules.get("sglang.kernels.ops.attention")
    if pkg is not None:
        monkeypatch.delattr(pkg, "flash_mla_interface", raising=False)


def _routed_choice(op, spec, backend):
    from capdispatch.adapters.sglang import decide as D
    res = cd.resolve(op, spec, selections=[f"{op}={backend}"], assume_libs=["triton"])
    assert res.backend == backend
    return D.OpChoice(op, spec.id, res, "routed", "explicit choice")


def test_a_route_whose_sglang_module_cannot_import_says_so_once_and_is_not_claimed(
        release, monkeypatch, caplog):
    """Without sgl-flash-mla SGLang's flash_mla_interface does not import, so the decode
    route's target does not exist: one capdispatch WARNING names the op, backend, target,
    the import error and what to install; SGLang's registry never tries the target (no
    traceback of its own); the rank's choice says NOT routed, and no kernel is bound."""
    pytest.importorskip("sglang")
    from sglang.srt.plugins.hook_registry import HookRegistry

    from capdispatch.adapters.sglang import rank, routes
    _without_module(monkeypatch, "flash_mla")
    monkeypatch.setattr(routes, "_SAID", set())
    spec = cd.probe("sim:rtx-3080")
    route = release.route("decode_mla", spec)
    assert route.target == "sglang.kernels.ops.attention.flash_mla_interface.flash_mla_with_kvcache"
    assert route.target not in routes._INSTALLED
    key = ("cpu", None)
    caplog.set_level(logging.DEBUG)
    for _ in range(2):      # the agreement step re-applies: still one line
        out = rank.apply_routes(release, {"decode_mla": _routed_choice("decode_mla", spec, "triton")},
                                spec, key, environ={})
    c = out["decode_mla"]
    assert c.action == "reported" and not c.routed
    assert c.why.startswith("NOT routed: capdispatch triton was decided") and "install sgl-flash-mla" in c.why
    assert routes.kernel("decode_mla", key) is None
    assert route.target not in HookRegistry._hooks or not HookRegistry._hooks[route.target]
    lines = [r for r in caplog.records if route.target in r.getMessage()]
    assert len(lines) == 1 and lines[0].name == "capdispatch.sglang" and lines[0].levelno == logging.WARNING
    msg = lines[0].getMessage()
    for part in ("decode_mla (capdispatch triton) is NOT routed on cpu", "cannot be imported here",
                 "ModuleNotFoundError", "flash_mla", "install sgl-flash-mla (SGLang's module imports flash_mla)"):
        assert part in msg, (part, msg)
    assert not [r for r in caplog.records if r.name.startswith("sglang")]


def test_a_route_at_a_name_this_sglang_lacks_is_not_routed(release, monkeypatch, caplog):
    pytest.importorskip("sglang")
    import attrs

    from capdispatch.adapters.sglang import routes
    monkeypatch.setattr(routes, "_SAID", set())
    spec = cd.probe("sim:rtx-3080")
    route = attrs.evolve(release.route("kv_dequant", spec),
                         target="sglang.kernels.ops.attention.dsv4.dequant_k_cache.no_such_function")
    why = routes.install(route, lambda *a: None, ("cpu", None), backend="triton_u8")
    assert why is not None and "AttributeError" in why and "'no_such_function'" in why
    assert "this SGLang has no such function" in why
    assert routes.kernel("kv_dequant", ("cpu", None)) is None
    [line] = [r.getMessage() for r in caplog.records if route.target in r.getMessage()]
    assert line.startswith("capdispatch: kv_dequant (capdispatch triton_u8) is NOT routed on cpu: ")


def test_route_targets_report_the_import_error_of_the_library_under_them(tmp_path, monkeypatch):
    """A site module importing a library that is not installed, or one that is installed
    but fails to load: the reason names the real error, not "has no attribute"."""
    from capdispatch.adapters.sglang import routes
    (tmp_path / "capd_site_a.py").write_text("import capd_missing_lib_zz\ndef fn():\n    pass\n")
    (tmp_path / "capd_broken_lib").mkdir()
    (tmp_path / "capd_broken_lib" / "__init__.py").write_text("raise OSError('Could not load this library')\n")
    (tmp_path / "capd_site_b.py").write_text("import capd_broken_lib\ndef fn():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(routes.Unresolved) as a:
        routes.resolve("capd_site_a.fn")
    assert "ModuleNotFoundError: No module named 'capd_missing_lib_zz'" in a.value.reason
    assert "install the package that provides the module capd_missing_lib_zz" in a.value.reason
    with pytest.raises(routes.Unresolved) as b:
        routes.resolve("capd_site_b.fn")
    assert "OSError: Could not load this library" in b.value.reason
    routes.resolve("capdispatch.adapters.sglang.routes.install")      # exists: no error


def test_mixed_rig_routes_only_where_sglangs_kernel_cannot_run(env, release):
    d = _decide(env, release)
    dq = d.choices["kv_dequant"]
    assert {k: (c.backend, c.routed) for k, c in dq.items()} == {
        "cuda:0": ("triton_fp8", False), "cuda:1": ("triton_u8", True), "cuda:2": ("triton_u8", True)}
    assert "feature:fp8_e4m3: need fp8_e4m3 (cc >=8.9), found cc 8.6" in dq["cuda:1"].why
    # SGLang's JIT store runs everywhere; nobody asked for a capdispatch store.
    assert d.resolved == ("kv_dequant",)
    assert all(c.backend is None and not c.routed for c in d.choices["kv_quant"].values())
    settings = {s.name: (s.action, s.value, s.devices) for s in d.settings}
    assert settings == {"kv_cache_dtype": ("set", "fp8_e4m3", ("cuda:0", "cuda:1", "cuda:2")),
                        "SGLANG_DSV4_KV_LAYOUT": ("set", "v4", ("cuda:1", "cuda:2"))}
    assert len(d.warnings) == 1 and "kv_dequant: the group's devices choose different backends" in d.warnings[0]


def test_same_generation_rig_changes_nothing_at_the_call_sites(env, release):
    env[gpus.SIM_ENV] = "sim:rtx-5090,sim:h200"
    d = _decide(env, release, ids=(0, 1))
    assert not any(c.routed for row in d.choices.values() for c in row.values())
    assert [s.name for s in d.settings] == ["kv_cache_dtype"]
    assert d.warnings == ()


def test_explicit_choice_that_cannot_run_is_downgraded_loudly_per_device(env, release):
    env["CAPDISPATCH_SET"] = "kv_dequant=triton_fp8"
    d = _decide(env, release)
    dq = d.choices["kv_dequant"]
    # An explicit choice is honoured: where it is SGLang's own kernel (the 5090) SGLang's call stays.
    assert [c.routed for c in dq.values()] == [False, True, True]
    assert dq["cuda:0"].runs == "triton_fp8" and dq["cuda:0"].why == (
        "SGLang's own dequantize_k_cache_paged_dsv4 kept (triton_fp8 is chosen (CAPDISPATCH_SET), "
        "the kernel SGLang runs there)")
    assert dq["cuda:1"].resolution.downgraded_from == "triton_fp8" and dq["cuda:1"].backend == "triton_u8"
    downgrades = [w for w in d.warnings if "was asked for (CAPDISPATCH_SET) but cannot run" in w]
    assert [w.split(" ")[0] for w in downgrades] == ["cuda:1", "cuda:2"]


def test_explicit_choice_that_cannot_run_is_refused_under_strict(env, release):
    env.update(CAPDISPATCH_SET="kv_dequant=triton_fp8", CAPDISPATCH_STRICT="1")
    with pytest.raises(cd.Unsatisfiable, match=r"strict: cuda:1 \(NVIDIA GeForce RTX 3080\): kv_dequant=triton_fp8"):
        _decide(env, release)


def test_explicit_store_choice_routes_the_store(env, release):
    env["CAPDISPATCH_SET"] = "kv_quant=torch"
    d = _decide(env, release)
    assert d.resolved == ("kv_quant", "kv_dequant")
    assert {(c.backend, c.routed) for c in d.choices["kv_quant"].values()} == {("torch", True)}


def test_user_settings_are_kept_and_conflicts_said(env, release):
    env["SGLANG_DSV4_KV_LAYOUT"] = "v41"
    d = _decide(env, release, explicit_fields={"kv_cache_dtype"},
                field_values={"kv_cache_dtype": "fp8_e4m3"})
    settings = {s.name: (s.action, s.value) for s in d.settings}
    assert settings == {"kv_cache_dtype": ("kept", "fp8_e4m3"), "SGLANG_DSV4_KV_LAYOUT": ("kept", "v41")}
    conflict = [w for w in d.warnings if w.startswith("SGLANG_DSV4_KV_LAYOUT=v41 was set by the user")]
    assert len(conflict) == 1 and "cuda:1, cuda:2 need SGLANG_DSV4_KV_LAYOUT=v4" in conflict[0]


def test_mixed_group_uniform_routes_the_fast_card_too(env, release):
    d = _decide(env, release, policy=os.path.join(POL, "uniform.yaml"))
    dq = d.choices["kv_dequant"]
    assert {(c.backend, c.routed) for c in dq.values()} == {("triton_u8", True)}
    assert "mixed_group: uniform" in dq["cuda:0"].why


def test_mixed_group_error_refuses(env, release):
    with pytest.raises(cd.Unsatisfiable, match="kv_dequant: the group's devices choose different backends"):
        _decide(env, release, policy=os.path.join(POL, "error.yaml"))


def test_sglang_flag_naming_a_backend_is_an_explicit_selection(tmp_path, env):
    # No SGLang flag names a KV backend; a test row shows the mechanism later ops use.
    path = _edited(tmp_path, "    selects:\n",
                   "    selects:\n      - {field: kv_cache_dtype, value: fp8_e4m3, op: kv_dequant, backend: triton_fp8}\n")
    rel = knobs.load(path).release(VERSION)
    sels, origin = decide.flag_selections(rel, {"kv_cache_dtype": "fp8_e4m3"})
    assert (sels, origin) == (["kv_dequant=triton_fp8"], "sglang --kv-cache-dtype fp8_e4m3")
    assert decide.flag_selections(rel, {"kv_cache_dtype": "bfloat16"})[0] == []
    d = _decide(env, rel, selections=sels, selection_origin=origin)
    assert any("was asked for (sglang --kv-cache-dtype fp8_e4m3) but cannot run" in w for w in d.warnings)
    env["CAPDISPATCH_STRICT"] = "1"
    with pytest.raises(cd.Unsatisfiable, match=r"sglang --kv-cache-dtype fp8_e4m3"):
        _decide(env, rel, selections=sels, selection_origin=origin)


def test_summary_names_devices_and_reasons(env, release):
    text = render.summary(_decide(env, release))
    assert "kv_dequant: SGLang's own kernel on cuda:0; capdispatch triton_u8 on cuda:1, cuda:2" in text
    assert "set env SGLANG_DSV4_KV_LAYOUT=v4 for cuda:1, cuda:2" in text


# --------------------------------------------------------------------------- facts, launch command

def test_architecture_facts_are_the_cards_own(release):
    arch = release.arch
    f86 = sglang_facts.facts(cd.probe("sim:rtx-3080"), arch)
    assert (f86["sm"], f86["cc"], f86["get_device_sm"]) == (86, (8, 6), 86)
    assert f86["is_sm80_supported"] and not f86["is_sm90_supported"] and not f86["is_sm120_supported"]
    f120 = sglang_facts.facts(cd.probe("sim:rtx-5090"), arch)
    assert f120["is_sm120_supported"] and f120["is_blackwell_supported"] and f120["is_sm120"]
    assert not f120["is_sm100_supported"]
    assert sglang_facts.facts(cd.probe("sim:h200"), arch)["is_sm90_supported"]
    fcpu = sglang_facts.facts(cd.probe("cpu"), arch)
    assert fcpu["sm"] == 0 and not any(v for k, v in fcpu.items() if k.startswith("is_"))
    # A known CUDA toolkit counts, as SGLang's probes check it.
    old_toolkit = cd.probe("sim:rtx-5090", assume_cuda="12.4")
    assert not sglang_facts.facts(old_toolkit, arch)["is_sm120_supported"]


def test_explicit_fields_of_an_engine_call():
    assert launch.explicit_fields("Engine(model_path='/m', tp_size=2, kv_cache_dtype='fp8_e4m3')") == {
        "model_path", "tp_size", "kv_cache_dtype"}
    assert launch.explicit_fields("Engine(model_path=<object at 0x1>, tp_size=2)") == {"model_path", "tp_size"}
    assert launch.explicit_fields(None) == set()


# --------------------------------------------------------------------------- dispatch sglang plan

def _plan(capsys, *argv):
    from capdispatch.adapters.sglang import cli
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_text_for_the_mixed_rig(env, capsys, monkeypatch):
    monkeypatch.delenv(gpus.SIM_ENV, raising=False)
    rc, out, err = _plan(capsys, "--device", RIG)
    assert rc == 0, err
    assert "GPUs: cuda:0, cuda:1, cuda:2" in out
    assert "set   env SGLANG_DSV4_KV_LAYOUT=v4" in out
    assert "rank 1: cuda:1 NVIDIA GeForce RTX 3080, cc 8.6 (simulated)" in out
    flat = "\n".join(" ".join(line.split()) for line in out.splitlines())
    assert "kv_dequant triton_u8 routed SGLang's own dequantize_k_cache_paged_dsv4 cannot run there" in flat
    assert "decode_mla triton routed SGLang's own flash_mla_with_kvcache cannot run there" in flat
    assert "architecture facts set for this rank: is_sm90=False is_sm100=False is_sm120=False" in out


def test_plan_json(env, capsys, monkeypatch):
    monkeypatch.setenv(gpus.SIM_ENV, RIG)
    rc, out, err = _plan(capsys, "--tp", "2", "--format", "json")
    assert rc == 0, err
    p = json.loads(out)
    assert p["schema"] == 2 and p["gpu_ids"] == [0, 1] and p["sglang"]["in_range"]
    assert [r["device"]["name"] for r in p["ranks"]] == ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 3080"]
    dq = p["ranks"][1]["ops"]["kv_dequant"]
    assert dq.pop("source").startswith("default.yaml:")
    assert dq == {
        "backend": "triton_u8", "runs": "triton_u8", "action": "routed", "routed": True,
        "downgraded_from": None, "setting": None, "kind": "fallback", "size_key": None, "buckets": [],
        "host": None, "why": "SGLang's own dequantize_k_cache_paged_dsv4 cannot run there: "
               "feature:fp8_e4m3: need fp8_e4m3 (cc >=8.9), found cc 8.6"}
    assert p["ranks"][1]["arch"]["device_sm"] == 86
    assert {x["name"]: x["action"] for x in p["launch"]} == {"kv_cache_dtype": "set", "SGLANG_DSV4_KV_LAYOUT": "set"}


@pytest.mark.parametrize("argv,rc,message", [
    (["--device", "sim:rtx-9999"], 2, "rtx-9999"),
    (["--device", RIG, "--tp", "4"], 2, "lists 3 device(s) (cuda:0..cuda:2) but the launch uses cuda:3"),
    (["--device", RIG, "--tp", "0"], 2, "--tp 0: expected an integer from 1 to 4096"),
    (["--device", RIG, "--set", "kv_dequant=triton_fp9"], 2, "unknown backend 'triton_fp9'"),
    (["--device", RIG, "--set", "kv_dequant=triton_fp8", "--strict"], 3, "strict: cuda:1"),
    (["--device", RIG, "--policy", os.path.join(POL, "error.yaml")], 3, "mixed_group is error"),
])
def test_plan_bad_input_and_unsatisfiable(env, capsys, argv, rc, message):
    got, out, err = _plan(capsys, *argv)
    assert got == rc and message in err and "Traceback" not in err


def test_plan_through_the_dispatch_command(run_cli):
    rc, out, err = run_cli("sglang", "plan", "--device", "sim:rtx-3080", "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["ranks"][0]["ops"]["kv_dequant"]["routed"] is True
    rc, out, err = run_cli("sglang", "plan", "--frobnicate")
    assert rc == 2 and "unrecognized arguments: --frobnicate" in err


# --------------------------------------------------------------------------- attention and MoE knobs

KNOB_RIG = "sim:rtx-5090,sim:h200,sim:rtx-3080"
KNOB_OPS = ("indexer", "sparse_prefill", "decode_mla", "moe")
LIBS = ("sgl-flash-mla", "flashinfer-python", "sgl-deep-gemm", "sglang", "sglang-kernel")


def _knobs(env, release, rig_=KNOB_RIG, libs=LIBS, values=None, **kw):
    """The one decision over every op of DeepSeek-V4 (routed and setting ops alike)."""
    env[gpus.SIM_ENV] = rig_
    specs = gpus.devices(list(range(len(rig_.split(",")))), env=env)
    values = values or {}
    ops, _ = decide.applicable_ops(release, "DeepseekV4ForCausalLM", "auto")
    return decide.decide(specs, ops, release, env=env, explicit_fields=set(values), field_values=values,
                         assume_libs=list(libs), **kw)


def _per_device(kd, op):
    return {dev: (c.backend, [s.label for s in c.setting] or None) for dev, c in kd.choices[op].items()}


def test_knob_map_rows_for_attention_and_moe(release):
    import capdispatch.backends.moe as moe
    from capdispatch.backends import builtin
    assert release.models["DeepseekV4ForCausalLM"].ops == model_calls().ops
    # One entry per backend of every model op.
    reg = builtin()
    # moe's one route is SGLang's per-layer method choice, whose kernel depends on the launch value.
    (mr,) = release.routes_for("moe")
    assert mr.name == "moe_layer" and mr.target.endswith("Fp8Config.get_quant_method")
    assert mr.native is None and mr.native_by is not None and mr.native_by.field == "moe_runner_backend"
    assert {b: release.entry("moe", b).routes for b in ("triton_w4a16", "torch")} == {
        "triton_w4a16": ("moe_layer",), "torch": ("moe_layer",)}
    for op in release.models["DeepseekV4ForCausalLM"].ops:
        for b in reg.backends(op):
            e = release.entry(op, b.name)
            assert e is not None and e.kind in ("sglang", "route", "none"), (op, b.name)
            # A route entry names sites of its own op; the others name none.
            assert all(r in {x.name for x in release.routes_for(op)} for r in e.routes)
            assert bool(e.routes) == (e.kind == "route") and (not e.settings or e.kind == "sglang")
    # The MoE entries agree with the op's own declaration of SGLang's runner values.
    for backend, value in moe.SGLANG_RUNNER_BACKEND.items():
        e = release.entry("moe", backend)
        got = None if e.kind != "sglang" else [s.value for s in e.settings if s.name == "moe_runner_backend"][0]
        assert got == value, backend
    labels = {k: (None if e.kind != "sglang" else [s.label for s in e.settings]) for k, e in release.entries.items()}
    assert labels[("sparse_prefill", "flashmla_sparse")] == [
        "dsv4_prefill_backend=flashmla_sparse", "env SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=true"]
    assert labels[("decode_mla", "flashmla")] == ["dsv4_attn_backend=flashmla"]
    assert labels[("decode_mla", "flashinfer_sparse_mla")] == [
        "dsv4_attn_backend=flashmla", "env SGLANG_SM120_FLASHMLA_BACKEND=flashinfer"]
    assert labels[("indexer", "deepgemm")] == [
        "env SGLANG_OPT_USE_TILELANG_INDEXER=false", "env SGLANG_OPT_USE_AITER_INDEXER=false",
        "env SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=false"]
    assert labels[("kv_dequant", "triton_fp8")] == []          # SGLang's default is this kernel
    # capdispatch's own kernels: SGLang has no setting that runs them; routed or reported.
    for op, b in [("decode_mla", "triton"), ("decode_mla", "triton_fp8"), ("sparse_prefill", "triton"),
                  ("indexer", "tilelang"), ("indexer", "triton"), ("kv_quant", "torch"),
                  ("moe", "triton_w4a16"), ("moe", "torch")]:
        assert labels[(op, b)] is None and release.entry(op, b).kind == "route", (op, b)
    assert release.entry("decode_mla", "triton").routes == ("mla_decode", "mla_decode_sm120")
    sel = {(s.field, s.value): s for s in release.selects}
    assert sel[("moe_runner_backend", "marlin")].backend == "marlin_w4a16"
    assert sel[("dsv4_attn_backend", "flashmla")].backend == "flashmla"
    assert sel[("dsv4_prefill_backend", "flashmla_sparse")].backend == "flashmla_sparse"
    mx = sel[("moe_runner_backend", "flashinfer_mxfp4")]
    assert mx.backend is None
    assert {d: mx.backend_for(cd.probe(f"sim:{d}")) for d in ("rtx-5090", "b200", "h200", "rtx-3080")} == {
        "rtx-5090": "flashinfer_cutlass_w4a8", "b200": "flashinfer_trtllm_w4a8",
        "h200": "flashinfer_cutlass_w4a16", "rtx-3080": "flashinfer_cutlass_w4a8"}


def test_a_device_family_is_of_a_cuda_device_probed_or_simulated(release):
    """One family rule for the knob map's selects and the moe route's native_by: a CUDA
    device (a simulated one too) by its cc major; the CPU, or any device not on CUDA even
    with a cc, has none and takes the entries' first listed or `other`."""
    from capdispatch.adapters.sglang import moe_plan
    from capdispatch.adapters.sglang.records import family
    assert knobs.family is family
    cuda = cd.DeviceSpec(id="cuda:0", name="NVIDIA H200", platform="cuda", cc=(9, 0), probe="torch")
    assert [family(d) for d in (cd.probe("sim:h200"), cd.probe("sim:rtx-5090"), cuda)] == ["sm90", "sm120", "sm90"]
    cpu = cd.probe("cpu")
    odd = attrs.evolve(cpu, cc=(9, 0))           # a cc on a device that is not CUDA
    assert family(cpu) is None and family(odd) is None
    nb = moe_plan.route_of(release).native_by
    assert nb.default_for(odd) == nb.default_for(cpu)
    mx = {(s.field, s.value): s for s in release.selects}[("moe_runner_backend", "flashinfer_mxfp4")]
    assert mx.backend_for(odd) == mx.backend_for(cpu) == mx.backends[0][1]


@pytest.mark.parametrize("old,new,message", [
    ("        torch: {route: [moe_layer]}\n", "", "no entry for moe backend(s) torch"),
    ("        backend: marlin_w4a16                      # Mxfp4MarlinMoEMethod\n",
     "        backend: marlin_w4a16\n        backends: {sm90: marlin_w4a16}\n",
     "selects[2]: give exactly one of 'backend' or 'backends'"),
    ("          sm100: flashinfer_trtllm_w4a8", "          blackwell: flashinfer_trtllm_w4a8",
     "expected a mapping of device families"),
    ("          sm90: flashinfer_cutlass_w4a16", "          sm90: flashinfer_cutlass_w4a61",
     "unknown backend 'flashinfer_cutlass_w4a61' for moe"),
    ("        triton_u8: {route: [dequant_v4]}", "        triton_u8: {route: [dequant_v4], none: true}",
     "give exactly one of 'sglang', 'route', 'none'"),
    ("        triton_u8: {route: [dequant_v4]}", "        triton_u8: {route: [dequant_v5]}",
     "unknown route 'dequant_v5'; did you mean 'dequant_v4'?"),
    ("        triton_u8: {route: [dequant_v4]}", "        triton_u8: {route: [store_v4]}",
     "route 'store_v4' is a kv_quant site, not a kv_dequant one"),
    ("        triton_u8: {route: [dequant_v4]}", "        triton_u9: {route: [dequant_v4]}",
     "unknown backend 'triton_u9' for kv_dequant"),
    ("            - {env: SGLANG_OPT_USE_AITER_INDEXER, value: \"false\"}\n",
     "            - {value: \"false\"}\n", "give exactly one of 'field' or 'env'"),
    ("        triton_w4a16: {route: [moe_layer]}", "        triton_w4a16: {nope: true}",
     "unknown key 'nope'; did you mean 'none'?"),
    ("            marlin: {sm90: marlin_w4a16,", "            marlin: {sm90: marlin_w4a61,",
     "native_by.values.marlin.sm90: unknown backend 'marlin_w4a61' for moe"),
    ("        native_by:\n          field: moe_runner_backend\n", "        native_by:\n",
     "native_by: missing 'field'"),
])
def test_knob_rows_errors_name_the_problem(tmp_path, old, new, message):
    with pytest.raises(knobs.KnobsError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        knobs.load(_edited(tmp_path, old, new))


def test_knob_ops_per_rank_on_the_simulated_rig(env, release):
    kd = _knobs(env, release)
    assert set(KNOB_OPS) <= set(kd.resolved)
    assert _per_device(kd, "decode_mla") == {
        "cuda:0": ("flashinfer_sparse_mla", ["dsv4_attn_backend=flashmla",
                                             "env SGLANG_SM120_FLASHMLA_BACKEND=flashinfer"]),
        "cuda:1": ("flashmla", ["dsv4_attn_backend=flashmla"]),
        "cuda:2": ("triton", None)}
    assert _per_device(kd, "sparse_prefill") == {
        "cuda:0": ("triton", None),
        "cuda:1": ("flashmla_sparse", ["dsv4_prefill_backend=flashmla_sparse",
                                       "env SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=true"]),
        "cuda:2": ("triton", None)}
    ix = _per_device(kd, "indexer")
    assert ix["cuda:1"][0] == "deepgemm" and ix["cuda:1"][1][0] == "env SGLANG_OPT_USE_TILELANG_INDEXER=false"
    assert ix["cuda:0"][1] is None and ix["cuda:2"] == ("triton", None)
    assert _per_device(kd, "moe") == {
        "cuda:0": ("flashinfer_cutlass_w4a8", ["moe_runner_backend=flashinfer_mxfp4"]),
        "cuda:1": ("flashinfer_cutlass_w4a16", ["moe_runner_backend=flashinfer_mxfp4"]),
        "cuda:2": ("triton_w4a16", None)}
    # Where SGLang has no setting, the rank routes the call site it calls on the card,
    # and the choice says which; where neither exists the choice is reported, with why.
    c = kd.choices["decode_mla"]["cuda:2"]
    assert c.action == "routed" and c.why.startswith("SGLang's own flash_mla_with_kvcache cannot run there")
    assert {d: c.action for d, c in kd.choices["decode_mla"].items()} == {
        "cuda:0": "kept", "cuda:1": "kept", "cuda:2": "routed"}
    assert kd.choices["sparse_prefill"]["cuda:0"].why == "SGLang calls no routable sparse_prefill site on this card"
    # MoE: SGLang's DeepSeek-V4 default (flashinfer_mxfp4, from device 0) builds a method
    # per card; the 3080 has no kernel for its method, so its MoE layers are routed.
    moe2 = kd.choices["moe"]["cuda:2"]
    assert moe2.action == "routed" and moe2.why.startswith(
        "SGLang's Mxfp4FlashinferTrtllmMoEMethod under moe_runner_backend=flashinfer_mxfp4 (SGLang's "
        "DeepSeek-V4 default from device 0 (cuda:0, NVIDIA GeForce RTX 5090)) cannot run on this card")
    assert "capdispatch triton_w4a16 runs at Fp8Config.get_quant_method instead" in moe2.why
    assert {d: c.action for d, c in kd.choices["moe"].items()} == {
        "cuda:0": "kept", "cuda:1": "kept", "cuda:2": "routed"}
    assert kd.choices["moe"]["cuda:0"].why.startswith(
        "SGLang's own Mxfp4FlashinferCutlassMoEMethod kept under moe_runner_backend=flashinfer_mxfp4")
    # The launch: one value per SGLang name, reported, never set. The routed 3080 needs
    # none (its rank routes the call site), so the cards that need one agree.
    s = {x.name: x for x in kd.sglang}
    assert s["moe_runner_backend"].action == "agree"
    assert s["moe_runner_backend"].wants == {"flashinfer_mxfp4": ("cuda:0", "cuda:1")}
    assert s["moe_runner_backend"].routed == {"cuda:2": "triton_w4a16"}
    assert s["moe_runner_backend"].without == ()
    assert s["moe_runner_backend"].why == ("cuda:0, cuda:1 need flashinfer_mxfp4; "
                                           "cuda:2 is routed to capdispatch triton_w4a16")
    assert s["dsv4_attn_backend"].wants == {"flashmla": ("cuda:0", "cuda:1")}
    assert s["SGLANG_SM120_FLASHMLA_BACKEND"].wants == {"flashinfer": ("cuda:0",)}
    assert "cuda:2 is routed to capdispatch triton" in s["dsv4_attn_backend"].why
    assert not any("no SGLang setting runs" in x.why for x in kd.sglang)


def test_knob_ops_same_generation_rig_agrees(env, release):
    kd = _knobs(env, release, rig_="sim:h200,sim:h200")
    s = {x.name: (x.action, x.wants) for x in kd.sglang}
    assert s["moe_runner_backend"] == ("agree", {"flashinfer_mxfp4": ("cuda:0", "cuda:1")})
    assert s["dsv4_attn_backend"] == ("agree", {"flashmla": ("cuda:0", "cuda:1")})
    assert s["dsv4_prefill_backend"] == ("agree", {"flashmla_sparse": ("cuda:0", "cuda:1")})
    assert s["SGLANG_SM120_FLASHMLA_BACKEND"] == ("none", {})
    assert not kd.warnings
    # Only the RTX 3080: no SGLang setting runs any of its choices.
    kd = _knobs(env, release, rig_="sim:rtx-3080")
    assert all(c.setting == () for row in kd.choices.values() for c in row.values())
    assert {x.action for x in kd.sglang} == {"none"}


def test_knob_flashinfer_mxfp4_is_an_explicit_selection_per_device_family(env, release):
    kd = _knobs(env, release, rig_="sim:rtx-5090,sim:b200,sim:h200,sim:rtx-3080",
                values={"moe_runner_backend": "flashinfer_mxfp4"})
    assert {d: c.backend for d, c in kd.choices["moe"].items()} == {
        "cuda:0": "flashinfer_cutlass_w4a8", "cuda:1": "flashinfer_trtllm_w4a8",
        "cuda:2": "flashinfer_cutlass_w4a16", "cuda:3": "triton_w4a16"}
    for dev in ("cuda:0", "cuda:1", "cuda:2"):
        c = kd.choices["moe"][dev]
        assert c.resolution.source.startswith("sglang --moe-runner-backend flashinfer_mxfp4")
        assert c.resolution.downgraded_from is None and c.why.startswith("explicit choice (sglang --moe-runner-backend")
    c3 = kd.choices["moe"]["cuda:3"]
    assert c3.resolution.downgraded_from == "flashinfer_cutlass_w4a8"
    assert c3.why.startswith("the explicit choice flashinfer_cutlass_w4a8 cannot run there")
    warned = [w for w in kd.warnings if "was asked for (sglang --moe-runner-backend flashinfer_mxfp4" in w]
    assert len(warned) == 1 and warned[0].startswith("cuda:3 (NVIDIA GeForce RTX 3080): moe=flashinfer_cutlass_w4a8")
    s = {x.name: x for x in kd.sglang}["moe_runner_backend"]
    assert (s.action, s.user) == ("kept", "flashinfer_mxfp4")
    # Under strict, the card where it cannot run stops the decision, naming the flag.
    with pytest.raises(cd.Unsatisfiable, match=r"cuda:1 .*sglang --moe-runner-backend flashinfer_mxfp4"):
        _knobs(env, release, rig_="sim:h200,sim:rtx-3080", values={"moe_runner_backend": "flashinfer_mxfp4"},
               strict=True)


def test_knob_explicit_sglang_values_honoured_downgraded_or_refused(env, release):
    kd = _knobs(env, release, values={"moe_runner_backend": "marlin", "dsv4_attn_backend": "flashmla",
                                      "dsv4_prefill_backend": "flashmla_sparse"})
    # Marlin runs on every card from cc 8.0: honoured everywhere, SGLang runs it.
    assert {d: (c.backend, c.resolution.downgraded_from) for d, c in kd.choices["moe"].items()} == {
        d: ("marlin_w4a16", None) for d in ("cuda:0", "cuda:1", "cuda:2")}
    assert {x.name: (x.action, x.user) for x in kd.sglang}["moe_runner_backend"] == ("kept", "marlin")
    # FlashMLA needs wgmma/tcgen05: honoured on the H200, downgraded loudly on the others.
    assert {d: (c.backend, c.resolution.downgraded_from) for d, c in kd.choices["decode_mla"].items()} == {
        "cuda:0": ("flashinfer_sparse_mla", "flashmla"), "cuda:1": ("flashmla", None),
        "cuda:2": ("triton", "flashmla")}
    assert {d: c.resolution.downgraded_from for d, c in kd.choices["sparse_prefill"].items()} == {
        "cuda:0": "flashmla_sparse", "cuda:1": None, "cuda:2": "flashmla_sparse"}
    for dev, op in [("cuda:0", "decode_mla"), ("cuda:2", "decode_mla"), ("cuda:0", "sparse_prefill"),
                    ("cuda:2", "sparse_prefill")]:
        assert any(w.startswith(f"{dev} (") and f"{op}=flashmla" in w and "cannot run" in w
                   and "sglang --" in w for w in kd.warnings), (dev, op)
    # Marlin without sgl-kernel cannot run: downgraded per device, or refused under strict.
    kd = _knobs(env, release, libs=("flashinfer-python",), values={"moe_runner_backend": "marlin"})
    assert all(c.resolution.downgraded_from == "marlin_w4a16" for c in kd.choices["moe"].values())
    with pytest.raises(cd.Unsatisfiable, match=r"sglang --moe-runner-backend marlin"):
        _knobs(env, release, libs=("flashinfer-python",), values={"moe_runner_backend": "marlin"}, strict=True)
    # A value that names no backend (e.g. trtllm) is the user's, kept, and selects nothing.
    kd = _knobs(env, release, values={"dsv4_attn_backend": "trtllm"})
    assert all(c.resolution.downgraded_from is None for c in kd.choices["decode_mla"].values())
    s = {x.name: x for x in kd.sglang}["dsv4_attn_backend"]
    assert (s.action, s.user) == ("kept", "trtllm")
    assert any(w.startswith("dsv4_attn_backend=trtllm was set by the user and is kept, but cuda:0, cuda:1 need")
               for w in kd.warnings)


def test_knob_user_environment_is_kept_and_conflicts_said(env, release):
    env["SGLANG_SM120_FLASHMLA_BACKEND"] = "triton"
    kd = _knobs(env, release)
    s = {x.name: x for x in kd.sglang}["SGLANG_SM120_FLASHMLA_BACKEND"]
    assert (s.action, s.user) == ("kept", "triton")
    assert any("SGLANG_SM120_FLASHMLA_BACKEND=triton was set by the user and is kept, but cuda:0 needs "
               "SGLANG_SM120_FLASHMLA_BACKEND=flashinfer" in w for w in kd.warnings)


def test_knob_flags_leave_the_kv_selections_alone(release):
    sels, origin = decide.flag_selections(release, {"moe_runner_backend": "flashinfer_mxfp4"})
    assert (sels, origin) == ([], "sglang command line")
    [pf] = decide.flag_policy(release, {"moe_runner_backend": "flashinfer_mxfp4"})
    assert pf.path == "sglang --moe-runner-backend flashinfer_mxfp4" and not pf.builtin
    assert {e.describe(): e.ops["moe"].value for e in pf.devices} == {
        "cc >=12.0,<13.0": ("flashinfer_cutlass_w4a8",), "cc >=10.0,<11.0": ("flashinfer_trtllm_w4a8",),
        "cc >=9.0,<10.0": ("flashinfer_cutlass_w4a16",)}
    assert decide.flag_policy(release, {"moe_runner_backend": "marlin"}) == []
    sels, origin = decide.flag_selections(release, {"moe_runner_backend": "marlin",
                                                    "dsv4_attn_backend": "flashmla"})
    assert sels == ["decode_mla=flashmla", "moe=marlin_w4a16"]
    assert origin == "sglang --dsv4-attn-backend flashmla, --moe-runner-backend marlin"


def test_plan_shows_every_op_and_the_sglang_settings_per_rank(env, capsys, monkeypatch):
    monkeypatch.delenv(gpus.SIM_ENV, raising=False)
    libs = [a for lib in LIBS for a in ("--assume-lib", lib)]
    rc, out, err = _plan(capsys, "--device", KNOB_RIG, *libs)
    assert rc == 0, err
    assert "rank 2: cuda:2 NVIDIA GeForce RTX 3080, cc 8.6 (simulated)" in out
    flat = " ".join(out.split())        # lines wrap at the width: read as one text
    rank2 = flat.split("rank 2:")[1]
    # One line per op per rank: routed, kept or reported, with why.
    assert "decode_mla triton routed SGLang's own flash_mla_with_kvcache cannot run there" in rank2
    assert "moe triton_w4a16 routed SGLang's Mxfp4FlashinferTrtllmMoEMethod under moe_runner_backend=" \
           "flashinfer_mxfp4" in rank2
    assert "decode_mla flashmla kept SGLang's own flash_mla_with_kvcache kept" in flat
    assert "moe flashinfer_cutlass_w4a16 kept SGLang's own Mxfp4FlashinferCutlassMoEMethod kept under " \
           "moe_runner_backend=flashinfer_mxfp4" in flat
    assert "SGLang settings each rank's choice needs (reported, not set" in out
    assert "agree moe_runner_backend=flashinfer_mxfp4 (cuda:0, cuda:1 need flashinfer_mxfp4; " \
           "cuda:2 is routed to capdispatch triton_w4a16)" in flat
    rc, out, err = _plan(capsys, "--device", KNOB_RIG, *libs, "--format", "json")
    p = json.loads(out)
    assert "knob_ops" not in p and p["ops"] == list(model_calls().ops)
    for r in p["ranks"]:
        assert list(r["ops"]) == p["ops"]
        for c in r["ops"].values():
            assert set(c) == {"backend", "runs", "action", "routed", "why", "setting", "source",
                              "downgraded_from", "kind", "size_key", "buckets", "host"}
            assert c["kind"] in ("first", "fallback", "downgraded", "uniform")
            assert c["routed"] == (c["action"] == "routed") and c["why"]
    r2 = p["ranks"][2]["ops"]
    assert r2["decode_mla"]["backend"] == "triton" and r2["decode_mla"]["setting"] is None
    assert r2["moe"] == {"backend": "triton_w4a16", "action": "routed", "routed": True,
                         "why": r2["moe"]["why"], "setting": None, "source": r2["moe"]["source"],
                         "downgraded_from": None, "kind": "fallback", "runs": "triton_w4a16",
                         "size_key": None, "buckets": [], "host": None}
    assert p["ranks"][1]["ops"]["moe"]["setting"] == ["moe_runner_backend=flashinfer_mxfp4"]
    assert p["ranks"][1]["ops"]["moe"]["action"] == "kept"
    mrb = next(x for x in p["sglang_settings"] if x["name"] == "moe_runner_backend")
    assert mrb == {"kind": "field", "name": "moe_runner_backend", "ops": ["moe"], "action": "agree", "user": None,
                   "wants": {"flashinfer_mxfp4": ["cuda:0", "cuda:1"]}, "without": [],
                   "routed": {"cuda:2": "triton_w4a16"}, "why": mrb["why"]}
    # mixed_group: error stops a launch: the ops diverge on an RTX 5090 + H200 (e.g. the
    # indexer: TileLang vs DeepGEMM).
    rc, out, err = _plan(capsys, "--device", "sim:rtx-5090,sim:h200", "--policy",
                         os.path.join(POL, "error.yaml"), *libs, "--format", "json")
    assert rc == 3 and "the group's devices choose different backends" in err and "mixed_group is error" in err
    # Two SM120 cards agree on every op: the same policy plans.
    rc, out, err = _plan(capsys, "--device", "sim:rtx-5090,sim:rtx-pro-6000", "--policy",
                         os.path.join(POL, "error.yaml"), *libs, "--format", "json")
    assert rc == 0, err


def test_knob_names_exist_in_the_installed_sglang():
    import importlib.util
    import subprocess
    import sys
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed here")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sglang_scenarios.py"), "knobs"],
                          capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    assert json.loads(line[len("RESULT "):])["knob_name_problems"] == []


# --------------------------------------------------------------------------- served form

SERVED_POL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "policies", "served_buckets.yaml")


def test_plan_carries_the_buckets_and_kept_or_routed_per_bucket(env, capsys):
    """A bucketed decode policy on an H200 and an RTX 3080: on the H200 the sizes FlashMLA
    wins keep SGLang's call (kept) and the others are routed; on the 3080 both buckets are
    routed. JSON carries every bucket; text shows them in the matrix and per rank."""
    args = ("--device", "sim:h200,sim:rtx-3080", "--tp", "2", "--libs", "sglang-0.5.23", "--policy", SERVED_POL)
    rc, out, err = _plan(capsys, *args, "--format", "json")
    assert rc == 0, err
    p = json.loads(out)
    h200, sm86 = (r["ops"]["decode_mla"] for r in p["ranks"])
    assert h200["size_key"] == "tokens" and h200["action"] == "routed" and h200["backend"] == "flashmla"
    assert [(b["tokens"], b["lower"], b["upper"], b["backend"], b["action"], b["runs"]) for b in h200["buckets"]] == [
        ("<=2", None, 2, "torch", "routed", "torch"), (">2", 2, None, "flashmla", "kept", "flashmla")]
    assert [(b["tokens"], b["backend"], b["action"]) for b in sm86["buckets"]] == [
        ("<=2", "torch", "routed"), (">2", "triton", "routed")]
    assert h200["why"] == ("explicit choice (" + SERVED_POL + ":7): capdispatch torch for tokens <=2 runs at "
                           "flash_mla_with_kvcache; for tokens >2 the decision is flashmla, SGLang's own, so "
                           "SGLang's call stays there")
    # Ops without buckets carry an empty list.
    assert p["ranks"][0]["ops"]["kv_dequant"]["buckets"] == [] and p["ranks"][0]["ops"]["kv_dequant"]["size_key"] is None
    rc, out, err = _plan(capsys, *args)
    assert rc == 0, err
    flat = " ".join(out.split())
    assert "<=2 torch (routed), >2 flashmla (kept)" in flat and "<=2 torch, >2 triton (routed)" in flat
    assert "decode_mla by tokens routed explicit choice" in flat
    assert "tokens <=2: torch routed tokens >2: flashmla kept" in flat


def test_an_explicit_choice_a_rank_cannot_carry_out_warns_or_is_refused_under_strict(env, capsys):
    """--set sparse_prefill=torch: SGLang calls no sparse-prefill site on the RTX 5090 that
    capdispatch can route. The cell names what runs (SGLang's own), a WARNING says the
    choice is not carried out, and --strict refuses (exit 3)."""
    args = ("--device", RIG, "--tp", "3", "--libs", "sglang-0.5.23", "--set", "sparse_prefill=torch")
    rc, out, err = _plan(capsys, *args, "--format", "json")
    assert rc == 0, err
    p = json.loads(out)
    c = p["ranks"][0]["ops"]["sparse_prefill"]
    assert (c["backend"], c["runs"], c["action"]) == ("torch", "sglang", "kept")
    assert ("sparse_prefill on cuda:0: the explicit choice torch (--set) cannot be carried out: SGLang calls no "
            "sparse_prefill site on this card (NVIDIA GeForce RTX 5090) that capdispatch can route, so SGLang's "
            "own kernel runs") in p["warnings"]
    assert [r["ops"]["sparse_prefill"]["action"] for r in p["ranks"][1:]] == ["routed", "routed"]
    rc, out, err = _plan(capsys, *args)
    assert "sparse_prefill   sglang (kept)" in out and "torch (kept)" not in out
    rc, out, err = _plan(capsys, *args, "--strict")
    assert rc == 3 and out == ""
    assert err.startswith("dispatch sglang: unsatisfiable: strict: sparse_prefill on cuda:0: the explicit choice "
                          "torch (--set) cannot be carried out")


def test_naming_sglangs_own_kernel_is_no_reason_to_route(env, release):
    spec = cd.probe("sim:h200")
    res = cd.resolve("decode_mla", spec, selections=["decode_mla=flashmla"], assume_libs=["sgl-flash-mla"])
    assert res.user
    c = decide.choose(release, "decode_mla", res, spec)
    assert (c.action, c.runs, c.buckets) == ("kept", "flashmla", ())
    assert c.why == "SGLang's own flash_mla_with_kvcache kept (flashmla is chosen (selections=), the kernel SGLang runs there)"


def test_a_switched_route_runs_capdispatchs_adapter_for_the_native_buckets(env, release, tmp_path, monkeypatch):
    """The indexer's site is SGLang's torch function, taken only under the switches the
    rank sets: its `original` is not DeepGEMM, so a bucket DeepGEMM wins is routed to
    capdispatch's deepgemm adapter (SGLang's metadata goes with it), never kept."""
    pol = tmp_path / "ix.yaml"
    pol.write_text("ops:\n  indexer:\n    - {tokens: '<=4', prefer: [triton]}\n    - {prefer: [deepgemm]}\n")
    spec = cd.probe("sim:h200")
    res = cd.resolve("indexer", spec, policy=str(pol), assume_libs=["sgl-deep-gemm", "triton"])
    c = decide.choose(release, "indexer", res, spec)
    assert c.action == "routed"
    assert [(b.label(), b.backend, b.action, b.runs) for b in c.buckets] == [
        ("<=4", "triton", "routed", "triton"), (">4", "deepgemm", "routed", "deepgemm")]
    assert "for tokens >4 capdispatch's deepgemm adapter runs" in c.why
    from capdispatch.adapters.sglang import rank
    asked = []
    monkeypatch.setattr(cd, "bind_resolution", lambda r, **kw: asked.append((r, kw)) or "bound")
    assert rank.kernel_for(release.route("indexer", spec), c) == "bound"
    # No None entry (native=None): every size runs a capdispatch kernel; served form: no checks.
    assert asked == [(res, {"checks": False, "native": None})]
    dec = cd.resolve("decode_mla", spec, policy=SERVED_POL, assume_libs=["sgl-flash-mla"])
    rank.kernel_for(release.route("decode_mla", spec), decide.choose(release, "decode_mla", dec, spec))
    assert asked[-1][1] == {"checks": False, "native": "flashmla"}     # FlashMLA's sizes: SGLang's call


def test_routes_hand_sglangs_schedules_to_the_kernel():
    """The decode wrappers put SGLang's tile_scheduler_metadata in capdispatch.given for the
    call; the indexer wrapper passes deep_gemm_metadata as the op's schedule_metadata; a
    size dispatcher's None entry sends the call to SGLang's own function unchanged."""
    import torch

    from capdispatch.adapters.sglang import routes
    from capdispatch.backends import batch_scope
    key = ("cpu", None)
    seen = []

    def kernel(q, *args):
        seen.append(batch_scope.shared(lambda: (("k",), ()), lambda: "made", "flashmla_decode"))
        return "capdispatch"
    q = torch.zeros(3, 1, 8, 512)
    view = torch.zeros(2, 16, 1, 584, dtype=torch.uint8)
    sched = object()
    routes._KERNELS.setdefault("decode_mla", {})[key] = kernel
    try:
        got = routes.mla_decode(lambda *a, **k: "sglang", q, view, None, None, 512, sched, is_fp8_kvcache=True,
                                indices=torch.zeros(3, 1, 64, dtype=torch.int32))
        assert got == "capdispatch" and seen == [sched]
        got = routes.mla_decode_sm120(lambda **k: "sglang", q=q, k_cache=view, head_dim_v=512,
                                      tile_scheduler_metadata=sched, indices=torch.zeros(3, 1, 64, dtype=torch.int32))
        assert got == "capdispatch" and seen == [sched, sched]
        routes.mla_decode_sm120(lambda **k: "sglang", q=q, k_cache=view, head_dim_v=512,
                                indices=torch.zeros(3, 1, 64, dtype=torch.int32))
        assert seen[-1] == "made"            # no schedule from SGLang: the kernel's own
        # A dispatcher keeping SGLang's call for more than 2 tokens.
        from capdispatch.backends.base import SizeArg
        from capdispatch.dispatch import sized
        disp = sized.dispatcher("decode_mla", SizeArg("tokens", 0, "q"), ((2, kernel),), None,
                                ((2, "torch"), (None, "flashmla")))
        routes._KERNELS["decode_mla"][key] = disp
        calls = []

        def own(*a, **k):
            calls.append(a[5])
            return "sglang"
        assert routes.mla_decode(own, q, view, None, None, 512, sched, is_fp8_kvcache=True,
                                 indices=torch.zeros(3, 1, 64, dtype=torch.int32)) == "sglang"
        assert calls == [sched]
        assert routes.mla_decode(own, q[:2], view, None, None, 512, sched, is_fp8_kvcache=True,
                                 indices=torch.zeros(2, 1, 64, dtype=torch.int32)) == "capdispatch"
    finally:
        routes.remove("decode_mla", key)
    meta = torch.zeros(9, 2, dtype=torch.int32)
    got = []
    routes._KERNELS.setdefault("indexer", {})[key] = lambda *a: got.append(a[5]) or "capdispatch"
    try:
        qi = torch.zeros(2, 1, 64, 128)
        assert routes.indexer_logits(None, qi, None, None, None, None, meta, 128, False) == "capdispatch"
        assert got == [meta] and got[0] is meta
    finally:
        routes.remove("indexer", key)


def test_install_outcomes_enter_the_agreement(release):
    """A rank that did not install a route the group decided is named, and the digest with
    the install outcomes differs from the one where every rank installed it."""
    from capdispatch.adapters.sglang import rank
    specs = [cd.probe("sim:rtx-3080").with_id("rank0:cuda:0"), cd.probe("sim:rtx-3080").with_id("rank1:cuda:1")]
    plan = cd.plan(specs, ["kv_dequant"], assume_libs=["triton"])
    choices = decide.choices_for(plan, release, ["kv_dequant"], specs)
    assert all(c.routed for c in choices["kv_dequant"].values())
    ok = [{"kv_dequant": "installed"}, {"kv_dequant": "installed"}]
    bad = [{"kv_dequant": "installed"}, {"kv_dequant": "failed: SGLang could not hook it"}]
    assert rank.carried_out(plan, choices, ok) == []
    assert rank.carried_out(plan, choices, bad) == [
        "kv_dequant on rank1:cuda:1: capdispatch triton_u8 was decided (routed), but its route was not installed "
        "(failed: SGLang could not hook it)"]
    d = cd.agreement.digest(plan)
    assert rank.install_digest(d, ok) != rank.install_digest(d, bad) and rank.install_digest(d, ok) != d
    c = attrs.evolve(choices["kv_dequant"]["rank0:cuda:0"], install="installed at x")
    assert rank.outcome(c) == "installed"
    assert rank.outcome(attrs.evolve(c, install="failed: why", action="reported")) == "failed: why"
