"""What SGLang's own kernel at a site needs, per release (knobs.yaml `needs`): the decision
judges SGLang 0.5.17's own FlashMLA (sglang-kernel 0.4.5's sgl_kernel.flash_mla) and DeepGEMM
indexer (sgl-deep-gemm 0.1.5.post1) by that statement, not by capdispatch's flashmla /
flashmla_sparse / deepgemm adapters' libraries (sgl-flash-mla >= 1.0, sgl-deep-gemm >= 0.2.3);
such a candidate is never bound by capdispatch, and its canary is not capdispatch's. No SGLang
needed: the decision reads the knob map only (the scenario tests through 0.5.17's real hooks
are in test_sglang_0517.py)."""
from __future__ import annotations

import attrs
import pytest

import capdispatch as cd
from capdispatch import extend
from capdispatch.adapters.sglang import decide, knobs, moe_plan, proof, rank, report
from capdispatch.adapters.sglang.records import SglangSetting
from capdispatch.dispatch.binding import HostedKernelError

pytestmark = pytest.mark.filterwarnings("ignore")

H100 = "sim:h100"
LIBS_0517 = ("sglang-kernel==0.4.5", "sgl-deep-gemm==0.1.5.post1")
# What SGLang 0.5.17's own Marlin MoE needs (its own JIT module, built through tvm_ffi).
LIBS_MARLIN = ("sglang==0.5.17", "apache-tvm-ffi==0.1.11", "sglang-kernel==0.4.5")
MARLIN = {"moe_runner_backend": "marlin"}
MARLIN_HOST = ("SGLang's own kernel (sglang 0.5.17 sglang.kernels.ops.moe.moe_wna16_marlin, apache-tvm-ffi 0.1.11 "
               "tvm_ffi, sglang-kernel 0.4.5 sgl_kernel.scalar_type)")
ATTENTION = ("indexer", "sparse_prefill", "decode_mla")
ID = H100            # a simulated card's id


@pytest.fixture(scope="module")
def r0517():
    return knobs.load().release("0.5.17")


@pytest.fixture(scope="module")
def r0523():
    return knobs.load().release("0.5.23")


def _decide(release, assume=(), policy=(), devices=(H100,), ops=ATTENTION, env=None, **kw):
    specs = [cd.probe(d) for d in devices]
    return decide.decide(specs, ops, release, assume_libs=assume, policy=policy, env=env or {}, **kw)


def _edited(tmp_path, old, new, last=False):
    """The packaged knob map with OLD's first (LAST: last, i.e. 0.5.17's) occurrence replaced by NEW."""
    text = open(knobs.DEFAULT_PATH).read()
    assert old in text, old
    path = tmp_path / "knobs.yaml"
    head, _, tail = text.rpartition(old) if last else text.partition(old)
    path.write_text(head + new + tail)
    return str(path)


# --------------------------------------------------------------------------- the knob map

def test_0517_states_what_its_own_kernels_need_and_0523_states_nothing(r0517, r0523):
    assert r0523.hosted() == {}        # 0.5.23's native kernels are capdispatch's adapters' libraries
    h = r0517.hosted()
    assert set(h) == {("decode_mla", "flashmla"), ("sparse_prefill", "flashmla_sparse"), ("indexer", "deepgemm"),
                      ("moe", "marlin_w4a16")}
    flash = extend.Library("sglang-kernel", ">=0.4.5,<0.4.6", module="sgl_kernel.flash_mla")
    sm90_100 = extend.AnyFeature(("wgmma", "tcgen05"))
    assert h["decode_mla", "flashmla"].requires == (flash, extend.Platform("cuda"), sm90_100)
    assert h["sparse_prefill", "flashmla_sparse"].requires == h["decode_mla", "flashmla"].requires
    assert h["indexer", "deepgemm"].requires == (
        extend.Library("sgl-deep-gemm", ">=0.1.5.post1,<0.1.6", module="deep_gemm"), extend.Platform("cuda"),
        sm90_100)
    # The indexer's site switches SGLang off DeepGEMM for every size once any size is routed;
    # SGLang's MoE method runs for every size or none (the runner is launch-wide).
    assert [h[k].split for k in (("decode_mla", "flashmla"), ("sparse_prefill", "flashmla_sparse"),
                                 ("indexer", "deepgemm"), ("moe", "marlin_w4a16"))] == [True, True, False, False]
    # SGLang's own Marlin MoE: led by the launch's value (unknown here: believed to run nowhere).
    nb = moe_plan.route_of(r0517).native_by
    assert h["moe", "marlin_w4a16"].requires == (
        moe_plan.Builds(nb, "marlin_w4a16", None),
        extend.Library("sglang", ">=0.5.17,<0.5.18", module="sglang.kernels.ops.moe.moe_wna16_marlin"),
        extend.Library("apache-tvm-ffi", ">=0.1.11,<0.1.12", module="tvm_ffi"),
        extend.Library("sglang-kernel", ">=0.4.5,<0.4.6", module="sgl_kernel.scalar_type"),
        extend.Platform("cuda"), extend.ComputeCapability(">=9.0,<13.0,!=10.*,!=11.*"))
    marlin = SglangSetting("field", "moe_runner_backend", "marlin")
    assert r0517.launch_hosted(marlin)["moe", "marlin_w4a16"].requires[0] == moe_plan.Builds(nb, "marlin_w4a16", "marlin")
    assert set(r0517.launch_hosted(marlin)) == {("moe", "marlin_w4a16")} and r0523.launch_hosted(marlin) == {}


def test_0517s_statements_match_its_pins():
    """The ranges hold the versions SGLang 0.5.17's metadata pins."""
    import os
    import re

    from packaging.specifiers import SpecifierSet
    import sglang_releases
    meta = os.path.join(sglang_releases.FOLDERS["0.5.17"], "sglang-0.5.17.dist-info", "METADATA")
    if not os.path.exists(meta):
        pytest.skip("needs SGLang 0.5.17 in tests/.releases (the README's test command)")
    pins = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)==([^\s;]+)", open(meta).read(), re.M))
    pins["sglang"] = "0.5.17"             # the release's own distribution pins no version of itself
    libs = [x for hosted in knobs.load().release("0.5.17").hosted().values() for x in hosted.requires
            if isinstance(x, extend.Library)]
    assert {lib.dist for lib in libs} == {"sglang", "apache-tvm-ffi", "sglang-kernel", "sgl-deep-gemm"}
    for lib in libs:
        assert pins[lib.dist] in SpecifierSet(lib.spec, prereleases=True), (lib, pins[lib.dist])


@pytest.mark.parametrize("old,new,message", [
    ('version: ">=0.4.5,<0.4.6"', 'version: "0.4.5+"',
     "needs[0].version: '0.4.5+' is not a version range (e.g. '>=0.4.5,<0.4.6')"),
    ("- {any_feature: [wgmma, tcgen05]}\n        triton: {route: [mla_sparse_prefill]}",
     "- {any_feature: [wgmma, tcgen06]}\n        triton: {route: [mla_sparse_prefill]}",
     "needs[2].any_feature: unknown device feature 'tcgen06'; did you mean 'tcgen05'?"),
    (", module: sgl_kernel.flash_mla}", "}", "needs[0]: missing 'module' (the module SGLang imports"),
    ("- {platform: cuda}\n            - {any_feature: [wgmma, tcgen05]}\n        triton: {route: [mla_sparse",
     "- {gpu: h100}\n            - {any_feature: [wgmma, tcgen05]}\n        triton: {route: [mla_sparse",
     "needs[1]: give one of library, feature, any_feature, cc, platform"),
    ("- {platform: cuda}\n            - {any_feature: [wgmma, tcgen05]}\n        triton: {route: [mla_sparse",
     "- {platform: gpu}\n            - {any_feature: [wgmma, tcgen05]}\n        triton: {route: [mla_sparse",
     "needs[1].platform: 'gpu' is not valid; did you mean 'cpu'? (valid: cuda, cpu)"),
    ("- {library: sgl-deep-gemm,", "- {library: sgl_deep_gemm,",
     "needs[0].library: 'sgl_deep_gemm' is not a distribution's canonical name (valid: 'sgl-deep-gemm')"),
    ("- {library: sgl-deep-gemm, version: \">=0.1.5.post1,<0.1.6\", module: deep_gemm}\n",
     "- {cc: \">=9.0\"}\n", "needs: names no library"),
    ("- {platform: cuda}\n            - {any_feature: [wgmma, tcgen05]}\n        triton: {route: [mla_sparse",
     "- {cc: nine}\n            - {any_feature: [wgmma, tcgen05]}\n        triton: {route: [mla_sparse",
     "needs[1].cc: 'nine' is not a compute-capability range (e.g. '>=9.0,<11.0')"),
])
def test_needs_errors_are_one_line_with_file_line_value_and_what_is_valid(tmp_path, old, new, message):
    path = _edited(tmp_path, old, new)
    with pytest.raises(knobs.KnobsError) as e:
        knobs.load(path)
    text = str(e.value)
    assert message in text and "\n" not in text, text
    assert text.startswith(f"{path}:") and text.split(":")[1].isdigit(), text
    # The line named holds the value (or the entry) refused.
    line = open(path).read().splitlines()[int(text.split(":")[1]) - 1]
    assert any(w in line for w in ("0.4.5+", "tcgen06", "sgl_kernel", "gpu", "sgl_deep_gemm", "nine",
                                   "cc:", "library:", "needs")), (line, text)


def test_needs_only_where_sglang_runs_its_own_kernel_at_a_route_it_names_native(tmp_path):
    # A route entry: capdispatch's kernel runs there, SGLang's own does not.
    path = _edited(tmp_path, "        triton: {route: [mla_sparse_prefill]}\n        torch: {route: [mla_sparse_prefill]}\n"
                             "      # decode_mla: the DSv4 backend decodes with sgl_kernel",
                   "        triton: {route: [mla_sparse_prefill], needs: [{platform: cuda}]}\n"
                   "        torch: {route: [mla_sparse_prefill]}\n      # decode_mla: the DSv4 backend decodes with sgl_kernel")
    with pytest.raises(knobs.KnobsError, match=r"sparse_prefill\.triton\.needs: only an entry SGLang runs itself "
                                               r"\(sglang: \[\.\.\.\]\) says what SGLang's own kernel needs; this "
                                               r"one is a route entry"):
        knobs.load(path)
    # The MoE site's SGLang kernel is a method per launch value (native_by): a backend no launch
    # value's method runs on any family is no kernel of SGLang's to state.
    path = _edited(tmp_path, "marlin: {sm90: marlin_w4a16, sm120: marlin_w4a16, other: null}",
                   "marlin: {other: null}", last=True)
    with pytest.raises(knobs.KnobsError) as e:
        knobs.load(path)
    text = str(e.value)
    assert "moe.marlin_w4a16.needs: no moe route names marlin_w4a16 as its native kernel, so no SGLang call " \
           "site runs it (valid: an entry of a route's native backend, or of one its native_by names; moe " \
           "routes' natives: moe_layer: flashinfer_cutlass_w4a16 (native_by)" in text and "\n" not in text, text
    line = open(path).read().splitlines()[int(text.split(":")[1]) - 1]      # the statement refused
    assert text.startswith(f"{path}:") and "module: sglang.kernels.ops.moe.moe_wna16_marlin" in line, line
    # A route entry of the MoE site: capdispatch's kernel runs there, SGLang's own does not.
    # (0.5.17's entry: the file's last; anchored on the entry alone, whatever op follows it)
    path = _edited(tmp_path, "        triton_w4a16: {route: [moe_layer]}\n",
                   "        triton_w4a16: {route: [moe_layer], needs: [{platform: cuda}]}\n", last=True)
    with pytest.raises(knobs.KnobsError, match=r"^[^\n]*knobs\.yaml:\d+: .*moe\.triton_w4a16\.needs: only an entry "
                                               r"SGLang runs itself \(sglang: \[\.\.\.\]\)[^\n]*route entry$"):
        knobs.load(path)


# --------------------------------------------------------------------------- the core

def _ctx(release, assume=LIBS_0517, policy=None, env=None, hosted=True):
    return cd.context(assume_libs=list(assume) or None, policy=policy, env=env or {},
                      hosted=release.hosted() if hosted else None)


def test_a_hosted_candidate_is_judged_by_the_statement_and_recorded(r0517):
    spec = cd.probe(H100)
    res = cd.dispatch.resolver.resolve_in(_ctx(r0517), "decode_mla", spec)
    assert res.backend == "flashmla"
    (c,) = [c for c in res.candidates if c.backend == "flashmla"]
    assert c.ok and c.host == "SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla)"
    assert [ch.code for ch in c.checks] == ["library:sglang-kernel", "platform", "feature:wgmma|tcgen05"]
    assert c.to_dict()["host"] == c.host and res.host_of("flashmla") == c.host and res.host_of("triton") is None
    # The same card with the adapter's requirements: sgl-flash-mla, which 0.5.17 does not install.
    plain = cd.dispatch.resolver.resolve_in(_ctx(r0517, hosted=False, assume=("sgl-flash-mla==1.0.0",)),
                                            "decode_mla", spec)
    assert plain.backend == "flashmla" and plain.host_of("flashmla") is None
    # Without sglang-kernel: not ok, and the next candidate wins.
    res = cd.dispatch.resolver.resolve_in(_ctx(r0517, assume=("sgl-deep-gemm==0.1.5.post1",)), "decode_mla", spec)
    (c,) = [c for c in res.candidates if c.backend == "flashmla"]
    assert not c.ok and res.backend == "triton_fp8"
    assert c.why_not(exact=True).startswith("library:sglang-kernel: need sglang-kernel>=0.4.5,<0.4.6, found ")
    # Not on cards without wgmma/tcgen05, whatever is installed.
    assert cd.dispatch.resolver.resolve_in(_ctx(r0517), "decode_mla", cd.probe("sim:rtx-3080")).backend != "flashmla"


def test_capdispatch_never_binds_a_hosted_candidate(r0517):
    res = cd.dispatch.resolver.resolve_in(_ctx(r0517), "decode_mla", cd.probe(H100))
    with pytest.raises(HostedKernelError, match=r"decode_mla=flashmla on sim:h100 is SGLang's own kernel "
                                                r"\(sglang-kernel 0.4.5 sgl_kernel.flash_mla\).*capdispatch cannot "
                                                r"run it"):
        cd.bind_resolution(res)
    assert isinstance(HostedKernelError("x"), cd.Unsatisfiable)
    assert cd.bind_resolution(res, native="flashmla") is None        # SGLang's own call stays


def _bucket_policy(tmp_path, op, small, large):
    p = tmp_path / f"{op}.yaml"
    p.write_text(f"schema: 1\nops:\n  {op}:\n    - {{tokens: \"<=64\", prefer: [{small}]}}\n"
                 f"    - {{prefer: [{large}]}}\n")
    return str(p)


def test_a_host_kernel_that_runs_for_every_size_or_none_is_never_split(tmp_path, r0517):
    spec = cd.probe(H100)
    pol = _bucket_policy(tmp_path, "indexer", "deepgemm", "triton")
    res = cd.dispatch.resolver.resolve_in(_ctx(r0517, policy=[pol]), "indexer", spec)
    # deepgemm would win <=64 only; SGLang's switch takes it off DeepGEMM for all sizes: refused.
    assert [b.backend for b in res.buckets] == ["tilelang", "triton"] and res.host_of("deepgemm")
    (c,) = [c for c in res.buckets[0].candidates if c.backend == "deepgemm"]
    (host,) = [ch for ch in c.checks if ch.code == "host"]
    assert not host.ok and host.found == "the decision for tokens <=64 only"
    assert "runs only where it wins every tokens" in c.why_not()
    # Winning every size is fine: kept whole.
    pol = _bucket_policy(tmp_path, "indexer", "deepgemm", "deepgemm")
    res = cd.dispatch.resolver.resolve_in(_ctx(r0517, policy=[pol]), "indexer", spec)
    assert [b.backend for b in res.buckets] == ["deepgemm", "deepgemm"]
    # Decode's site can keep SGLang's call per size (no switch): split stays.
    pol = _bucket_policy(tmp_path, "decode_mla", "flashmla", "triton_fp8")
    res = cd.dispatch.resolver.resolve_in(_ctx(r0517, policy=[pol]), "decode_mla", spec)
    assert [b.backend for b in res.buckets] == ["flashmla", "triton_fp8"]


def test_verify_required_refuses_a_host_kernel_capdispatch_cannot_verify(r0517, monkeypatch):
    """On a real card the verdicts are read: SGLang's own kernel has none of capdispatch's."""
    spec = attrs.evolve(cd.probe(H100), probe="nvml", id="cuda:0")

    class Card:          # triton_fp8 passed its canary here; nothing else has a verdict
        def get(self, backend):
            return type("Verdict", (), {"passed": True, "at": None})() if backend.name == "triton_fp8" else None

        def suspect(self, backend):
            return None
    ctx = _ctx(r0517, env={"CAPDISPATCH_VERIFY": "warn"})
    monkeypatch.setattr(type(ctx), "card", lambda self, device: Card())
    monkeypatch.setattr(extend.Library, "evaluate", _no_import(extend.Library.evaluate))
    res = cd.dispatch.resolver.resolve_in(ctx, "decode_mla", spec)
    (c,) = [c for c in res.candidates if c.backend == "flashmla"]
    assert c.ok and c.verification == "not verified by capdispatch"
    assert [ch.found for ch in c.checks if ch.code == "canary"][0].startswith("not verified by capdispatch")
    ctx = _ctx(r0517, env={"CAPDISPATCH_VERIFY": "required"})
    res = cd.dispatch.resolver.resolve_in(ctx, "decode_mla", spec)
    (c,) = [c for c in res.candidates if c.backend == "flashmla"]
    assert not c.ok and res.backend == "triton_fp8"
    assert "which capdispatch cannot verify (verify: required)" in c.why_not()


def _no_import(evaluate):
    def go(self, facts):
        return evaluate(self, attrs.evolve(facts, check_imports=False))
    return go


# --------------------------------------------------------------------------- the decision

def test_on_an_h100_with_0517s_libraries_sglangs_own_kernels_are_kept(r0517):
    d = _decide(r0517, LIBS_0517)
    c = {op: d.choices[op][ID] for op in ATTENTION}
    assert {op: (x.action, x.backend, x.runs) for op, x in c.items()} == {
        "indexer": ("kept", "deepgemm", "deepgemm"), "sparse_prefill": ("kept", "flashmla_sparse", "flashmla_sparse"),
        "decode_mla": ("kept", "flashmla", "flashmla")}
    assert c["decode_mla"].why == (
        "SGLang's own flash_mla_with_kvcache kept (the decision is flashmla: SGLang's own kernel (sglang-kernel "
        "0.4.5 sgl_kernel.flash_mla), judged by the knob map's statement of what it needs; not verified by "
        "capdispatch)")
    assert "SGLang's own kernel (sgl-deep-gemm 0.1.5.post1 deep_gemm)" in c["indexer"].why
    assert "SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla)" in c["sparse_prefill"].why
    assert c["decode_mla"].to_dict()["host"] == "SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla)"
    assert c["indexer"].host == "SGLang's own kernel (sgl-deep-gemm 0.1.5.post1 deep_gemm)"


def test_without_them_the_ops_are_routed_and_the_reason_names_sglangs_kernel(r0517):
    d = _decide(r0517, ("triton",))        # this machine's libraries would hold sgl-flash-mla: say nothing of them
    c = {op: d.choices[op][ID] for op in ATTENTION}
    assert {op: x.action for op, x in c.items()} == {op: "routed" for op in ATTENTION}
    assert all(x.host is None for x in c.values())
    assert c["decode_mla"].why.startswith(
        "SGLang's own flash_mla_with_kvcache (sglang-kernel>=0.4.5,<0.4.6 sgl_kernel.flash_mla) cannot run there: "
        "library:sglang-kernel: need sglang-kernel>=0.4.5,<0.4.6, found ")
    assert "library:sgl-deep-gemm: need sgl-deep-gemm>=0.1.5.post1,<0.1.6" in c["indexer"].why
    # 0.5.23's own DeepGEMM on the same card is not 0.5.17's: outside the statement's range.
    d = _decide(r0517, ("sglang-kernel==0.4.5", "sgl-deep-gemm==0.2.3.post2"))
    assert d.choices["indexer"][ID].routed and not d.choices["decode_mla"][ID].routed


def _marlin(release, devices=(H100,), assume=LIBS_MARLIN, values=MARLIN, **kw):
    return _decide(release, assume, devices=devices, ops=("moe",), field_values=values,
                   explicit_fields=tuple(values), **kw)


def _marlin_candidate(c):
    (m,) = [x for x in c.resolution.candidates if x.backend == "marlin_w4a16"]
    return m


def test_on_an_h100_under_the_marlin_runner_sglangs_own_marlin_moe_is_kept(r0517):
    d = _marlin(r0517)
    c = d.choices["moe"][ID]
    assert (c.action, c.backend, c.runs, c.host) == ("kept", "marlin_w4a16", "marlin_w4a16", MARLIN_HOST)
    assert c.why == ("explicit choice (sglang --moe-runner-backend marlin); SGLang's own Mxfp4MarlinMoEMethod kept "
                     "under moe_runner_backend=marlin (set by the user (--moe-runner-backend)): it runs "
                     f"{MARLIN_HOST}, judged by the knob map's statement of what it needs; not verified by capdispatch")
    assert not [w for w in d.warnings if "moe" in w], d.warnings       # no downgrade: SGLang's Marlin runs
    assert [ch.code for ch in _marlin_candidate(c).checks] == [
        "sglang:moe_runner_backend", "library:sglang", "library:apache-tvm-ffi", "library:sglang-kernel", "platform",
        "cc"]
    spec = cd.probe(H100)
    assert proof.hosted(d, spec) == {"moe": MARLIN_HOST} and "moe" not in proof._decided(d, spec)
    entry = report.op_entry(c, r0517.route("moe", spec))
    assert entry["canary"] == {"marlin_w4a16": f"not verified by capdispatch ({MARLIN_HOST})"}
    # A rank judges it under SGLang's resolved value (its record), as the launcher did.
    resolved = SglangSetting("field", "moe_runner_backend", "marlin", origin="as SGLang resolved it")
    d = _marlin(r0517, moe_launch=resolved)
    assert (d.choices["moe"][ID].action, d.choices["moe"][ID].host) == ("kept", MARLIN_HOST)
    # SM120 too (native_by: marlin -> marlin_w4a16 there).
    d = _marlin(r0517, devices=("sim:rtx-5090",))
    assert (d.choices["moe"]["sim:rtx-5090"].action, d.choices["moe"]["sim:rtx-5090"].host) == ("kept", MARLIN_HOST)


def test_under_the_default_runner_the_statement_keeps_nothing(r0517, tmp_path):
    """auto builds Fp8MoEMethod (native null): SGLang runs no Marlin, so capdispatch never
    believes it does, whatever asks for marlin_w4a16."""
    d = _marlin(r0517, values={})
    c = d.choices["moe"][ID]
    assert c.routed and c.backend != "marlin_w4a16" and c.host is None
    m = _marlin_candidate(c)
    assert not m.ok and m.host is not None
    assert ("sglang:moe_runner_backend: need moe_runner_backend=marlin on sm90, sm120 (SGLang's method that runs "
            "marlin_w4a16), found moe_runner_backend=auto on sm90 (Fp8MoEMethod)") in m.why_not(exact=True)
    # Asked for by capdispatch's own selection or policy under auto: downgraded, never routed to it.
    for kw in (dict(selections=["moe=marlin_w4a16"]), dict(policy=[_bucket_policy(tmp_path, "moe", "marlin_w4a16",
                                                                                  "marlin_w4a16")])):
        d = _marlin(r0517, values={}, **kw)
        c = d.choices["moe"][ID]
        assert c.routed and c.backend != "marlin_w4a16" and "marlin_w4a16" not in c.routed_backends, c.why
    # Other launch values: the same.
    for value in ("triton", "flashinfer_mxfp4"):
        c = _marlin(r0517, values={"moe_runner_backend": value}).choices["moe"][ID]
        assert c.backend != "marlin_w4a16" and c.host is None and not _marlin_candidate(c).ok, value
    # Without a launch value (a bare context): believed to run nowhere.
    res = cd.dispatch.resolver.resolve_in(decide.context_for(r0517, assume_libs=LIBS_MARLIN), "moe", cd.probe(H100))
    (m,) = [x for x in res.candidates if x.backend == "marlin_w4a16"]
    assert not m.ok and "found the launch's moe_runner_backend unknown" in m.why_not(exact=True)


@pytest.mark.parametrize("device,family", [("sim:rtx-3080", "sm80"), ("sim:b200", "sm100")])
def test_where_native_by_gives_no_marlin_the_statement_keeps_nothing(r0517, device, family):
    d = _marlin(r0517, devices=(device,))
    c = d.choices["moe"][device]
    assert c.routed and c.backend != "marlin_w4a16" and c.host is None
    assert 'raises "MXFP4 Marlin requires SM90 or SM120"' in c.why
    m = _marlin_candidate(c)
    (builds,) = [ch for ch in m.checks if ch.code == "sglang:moe_runner_backend"]
    assert not builds.ok and builds.found == f"moe_runner_backend=marlin on {family} (Mxfp4MarlinMoEMethod)"
    # The user's explicit --moe-runner-backend marlin is downgraded loudly there.
    assert any("moe=marlin_w4a16 was asked for (sglang --moe-runner-backend marlin) but cannot run" in w
               for w in d.warnings), d.warnings


def test_a_mixed_group_under_the_marlin_runner_keeps_sglangs_marlin_where_it_runs(r0517):
    d = _marlin(r0517, devices=(H100, "sim:rtx-3080"))
    row = d.choices["moe"]
    assert (row[H100].action, row[H100].host) == ("kept", MARLIN_HOST)
    assert row["sim:rtx-3080"].routed and row["sim:rtx-3080"].backend == "triton_w4a16"


def test_without_0517s_marlin_libraries_moe_is_routed_and_the_reason_names_sglangs_kernel(r0517):
    d = _marlin(r0517, assume=("sglang==0.5.23", "apache-tvm-ffi==0.1.11", "sglang-kernel==0.4.10"))
    c = d.choices["moe"][ID]
    assert c.routed and c.backend != "marlin_w4a16" and c.host is None
    assert ("SGLang's Mxfp4MarlinMoEMethod under moe_runner_backend=marlin (set by the user (--moe-runner-backend)) "
            "cannot run on this card (SGLang's own kernel (sglang>=0.5.17,<0.5.18 "
            "sglang.kernels.ops.moe.moe_wna16_marlin, apache-tvm-ffi 0.1.11 tvm_ffi, sglang-kernel>=0.4.5,<0.4.6 "
            "sgl_kernel.scalar_type): library:sglang: need sglang>=0.5.17,<0.5.18, found 0.5.23 (assumed); "
            "library:sglang-kernel: need sglang-kernel>=0.4.5,<0.4.6, found 0.4.10 (assumed))") in c.why, c.why
    assert any("moe=marlin_w4a16 was asked for (sglang --moe-runner-backend marlin) but cannot run" in w
               for w in d.warnings), d.warnings


def test_0523_is_judged_by_capdispatchs_adapters_as_before(r0523):
    d = _decide(r0523, ("sgl-flash-mla==1.0.0", "sgl-deep-gemm==0.2.3.post2"))
    assert {op: d.choices[op][ID].action for op in ATTENTION} == {op: "kept" for op in ATTENTION}
    assert d.choices["decode_mla"][ID].why == ("SGLang's own flash_mla_with_kvcache kept (the decision is "
                                                     "flashmla, the kernel SGLang runs there)")
    assert all(d.choices[op][ID].resolution.host_of(d.choices[op][ID].backend) is None
               for op in ATTENTION)
    d = _decide(r0523, ("sglang-kernel==0.4.5", "sgl-deep-gemm==0.1.5.post1"))
    assert d.choices["indexer"][ID].routed          # 0.5.23's DeepGEMM site is the adapter's library's
    assert "library:sgl-deep-gemm: need sgl-deep-gemm>=0.2.3, found 0.1.5.post1" in d.choices["indexer"][ID].why


def test_a_routed_decode_keeps_sglangs_call_for_the_sizes_its_own_kernel_wins(tmp_path, r0517):
    pol = _bucket_policy(tmp_path, "decode_mla", "flashmla", "triton_fp8")
    d = _decide(r0517, LIBS_0517, policy=[pol], ops=("decode_mla",))
    c = d.choices["decode_mla"][ID]
    assert c.routed and [(b.action, b.runs) for b in c.buckets] == [("kept", "flashmla"), ("routed", "triton_fp8")]
    assert c.host == "SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla)"
    assert ("for tokens <=64 the decision is flashmla, SGLang's own (sglang-kernel 0.4.5 sgl_kernel.flash_mla), "
            "so SGLang's call stays there") in c.why
    route = r0517.route("decode_mla", cd.probe(H100))
    fn = rank.kernel_for(route, c)              # SGLang's kernel is a None entry, never bound
    assert fn.pick(8) is None and fn.pick(128) is not None


def test_an_indexer_whose_own_kernel_wins_some_sizes_takes_the_next_candidate(tmp_path, r0517):
    pol = _bucket_policy(tmp_path, "indexer", "deepgemm", "triton")
    d = _decide(r0517, LIBS_0517, policy=[pol], ops=("indexer",))
    c = d.choices["indexer"][ID]
    assert c.routed and [(b.action, b.runs) for b in c.buckets] == [("routed", "tilelang"), ("routed", "triton")]
    route = r0517.route("indexer", cd.probe(H100))
    assert rank.kernel_for(route, c) is not None          # binds: nothing of SGLang's in it


def test_a_decision_that_would_bind_sglangs_kernel_is_refused_at_install_not_at_first_forward(r0517):
    """A choice that routes SGLang's own kernel through capdispatch (e.g. a group's uniform pick
    run under the indexer's switch) is reported NOT routed, SGLang's call left alone."""
    d = _decide(r0517, LIBS_0517, ops=("indexer",))
    c = attrs.evolve(d.choices["indexer"][ID], action="routed")
    spec = cd.probe(H100)
    env = {}
    out = rank.apply_routes(r0517, {"indexer": c}, spec, ("cpu", None), env)
    o = out["indexer"]
    assert o.action == "reported" and o.install.startswith("failed: indexer=deepgemm on sim:h100 is SGLang's own kernel")
    assert "capdispatch cannot run it in the host's place" in o.install and env == {}
    assert o.why.startswith("NOT routed: capdispatch deepgemm was decided")


def test_the_canary_report_says_sglangs_kernel_is_not_verified_by_capdispatch(r0517):
    d = _decide(r0517, LIBS_0517)
    spec = cd.probe(H100)
    for op, backend, label in (("decode_mla", "flashmla", "sglang-kernel 0.4.5 sgl_kernel.flash_mla"),
                               ("sparse_prefill", "flashmla_sparse", "sglang-kernel 0.4.5 sgl_kernel.flash_mla"),
                               ("indexer", "deepgemm", "sgl-deep-gemm 0.1.5.post1 deep_gemm")):
        entry = report.op_entry(d.choices[op][ID], r0517.route(op, spec))
        assert entry["canary"] == {backend: f"not verified by capdispatch (SGLang's own kernel ({label}))"}
        assert "verified" not in entry["canary"][backend].replace("not verified by capdispatch", "")
    _, text = proof.verified(spec, lambda env: d, env={})
    assert text == ("SGLang's own kernel, not verified by capdispatch: indexer (SGLang's own kernel (sgl-deep-gemm "
                    "0.1.5.post1 deep_gemm)), sparse_prefill (SGLang's own kernel (sglang-kernel 0.4.5 "
                    "sgl_kernel.flash_mla)), decode_mla (SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla))")
    assert proof._decided(d, spec) == {}                 # no capdispatch canary is run for them


def test_a_real_rank_verifies_only_capdispatchs_kernels(r0517, monkeypatch):
    d = _decide(r0517, LIBS_0517, ops=("kv_dequant",) + ATTENTION)
    spec = attrs.evolve(cd.probe(H100), probe="nvml", id="cuda:0")
    d = attrs.evolve(d, choices={op: {spec.id: c for c in row.values()} for op, row in d.choices.items()})
    assert proof.hosted(d, spec)
    asked = []

    def verify_decisions(spec, chosen, **kw):
        asked.append(dict(chosen))
        return type("V", (), {"mode": "warn", "results": [], "failed": []})()
    monkeypatch.setattr(cd, "verify_decisions", verify_decisions)
    monkeypatch.setattr(cd.proof, "lookup", lambda *a, **k: None)
    _, text = proof.verified(spec, lambda env: d, env={})
    assert asked == [{"kv_dequant": "triton_fp8"}]
    assert text.startswith("not verified within the time budget: kv_dequant=triton_fp8; SGLang's own kernel, "
                           "not verified by capdispatch: indexer (")


def test_uniform_groups_never_split_a_host_kernel(tmp_path, r0517):
    pol = _bucket_policy(tmp_path, "indexer", "deepgemm", "triton")
    ctx = cd.context(assume_libs=list(LIBS_0517), policy=[pol], env={}, settings={"mixed_group": "uniform"},
                     hosted=r0517.hosted())
    for group in ([H100, "sim:h200"], [H100, "sim:rtx-3080"]):
        g = cd.dispatch.group.resolve_group_in(ctx, "indexer", [cd.probe(d) for d in group])
        assert all(b.backend != "deepgemm" for r in g.per_device.values() for b in r.buckets), g


def test_the_rehearsal_key_of_a_host_kernel_is_never_capdispatchs(r0517):
    from capdispatch.proof.rehearsals import decisions_of
    p = cd.plan_in(_ctx(r0517), [H100], ["decode_mla"], log_warnings=False)
    (row,) = decisions_of(p)["decode_mla"]
    assert row[0] == "decode_mla/flashmla run by the host: SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla)"


def test_hosted_entries_are_checked(r0517):
    with pytest.raises(cd.BadInput, match=r"hosted: \('decode_mla', 'flashmlb'\) is not an \(op, backend\)"):
        cd.context(hosted={("decode_mla", "flashmlb"): extend.Hosted("SGLang", ())})
    with pytest.raises(cd.BadInput, match="expected a Hosted record"):
        cd.context(hosted={("decode_mla", "flashmla"): ()})


def test_under_verify_required_a_rank_verifies_the_next_kernel_of_an_op_sglang_kept(r0517, monkeypatch):
    """verify: required: only kernels that passed capdispatch's canary on this card run, so
    SGLang's own (hosted) cannot; the rank verifies the op's next candidates in order."""
    d = _decide(r0517, LIBS_0517, ops=("decode_mla",))
    spec = attrs.evolve(cd.probe(H100), probe="nvml", id="cuda:0")
    d = attrs.evolve(d, choices={op: {spec.id: c for c in row.values()} for op, row in d.choices.items()})
    asked = []

    def result(op, b, passed):
        job = type("Job", (), {"op": op, "backend": b})()
        return type("R", (), {"job": job, "verdict": type("V", (), {"passed": passed, "fault": False,
                                                                       "describe": lambda self: "x"})()})()

    def verify_decisions(spec, chosen, **kw):
        asked.append(dict(chosen))
        rs = [result(op, b, b == "triton") for op, b in chosen.items()]
        return type("Ver", (), {"mode": "required", "results": rs, "failed": [r for r in rs if not r.verdict.passed],
                                "unverified": []})()
    monkeypatch.setattr(cd, "verify_decisions", verify_decisions)
    monkeypatch.setattr(cd.proof, "lookup", lambda *a, **k: None)
    proof.verified(spec, lambda env: d, env={"CAPDISPATCH_VERIFY": "required"})
    # flashmla is SGLang's own: never asked; triton_fp8 failed, triton passed: stop there.
    assert asked == [{"decode_mla": "triton_fp8"}, {"decode_mla": "triton"}]


def test_0517s_statements_name_the_modules_its_call_sites_import():
    """Each statement's module is what SGLang 0.5.17's DeepSeek-V4 code imports for that
    kernel (read from its source, never run)."""
    import os
    import re

    import sglang_releases
    base = os.path.join(sglang_releases.FOLDERS["0.5.17"], "sglang")
    if not os.path.isdir(base):
        pytest.skip("needs SGLang 0.5.17 in tests/.releases (the README's test command)")
    sites = {("decode_mla", "flashmla"): ("srt/layers/attention/deepseek_v4_backend.py", "flash_mla_with_kvcache"),
             ("sparse_prefill", "flashmla_sparse"): ("srt/layers/attention/deepseek_v4_backend.py",
                                                     "flash_mla_sparse_fwd"),
             ("indexer", "deepgemm"): ("srt/layers/attention/dsv4/indexer.py", "fp8_paged_mqa_logits"),
             ("moe", "marlin_w4a16"): ("srt/layers/moe/fused_moe_triton/fused_marlin_moe.py", "moe_wna16_marlin_gemm")}
    hosted = knobs.load().release("0.5.17").hosted()
    assert set(hosted) == set(sites)
    for key, (path, name) in sites.items():
        lib = [x for x in hosted[key].requires if isinstance(x, extend.Library)][0]     # the kernel's own
        text = open(os.path.join(base, path)).read()
        assert re.search(rf"^\s*from {re.escape(lib.module)} import {name}\b", text, re.M), (key, lib.module, path)
    # SGLang's Marlin MoE: the kernel module builds through tvm_ffi (load_jit), with sgl_kernel's scalar
    # types in fused_marlin_moe; Mxfp4MarlinMoEMethod refuses every card but SM90/SM120.
    marlin = {x.dist: x.module for x in hosted["moe", "marlin_w4a16"].requires if isinstance(x, extend.Library)}
    jit = open(os.path.join(base, "kernels/ops/moe/moe_wna16_marlin.py")).read()
    assert "load_jit(" in jit and "from sglang.kernels.jit.utils import cache_once, load_jit" in jit
    compile_ = open(os.path.join(base, "kernels/jit/utils/compile.py")).read()
    assert f"from {marlin['apache-tvm-ffi']}.cpp import load" in compile_
    fused = open(os.path.join(base, "srt/layers/moe/fused_moe_triton/fused_marlin_moe.py")).read()
    assert f"from {marlin['sglang-kernel']} import scalar_types" in fused
    method = open(os.path.join(base, "srt/layers/quantization/mxfp4_marlin_moe.py")).read()
    assert "if not is_sm90_supported() and not is_sm120_supported():" in method
    assert 'raise RuntimeError("MXFP4 Marlin requires SM90 or SM120.")' in method


def test_a_uniform_pick_that_would_split_a_host_kernel_takes_the_next_common_backend(tmp_path, r0517):
    """The group's uniform pass picks per size bucket; where its picks would give SGLang's
    indexer some sizes only, those take the next backend every device runs."""
    from capdispatch.dispatch import group
    pol = _bucket_policy(tmp_path, "indexer", "deepgemm", "deepgemm")
    ctx = _ctx(r0517, policy=[pol])
    per = {s.id: cd.dispatch.resolver.resolve_in(ctx, "indexer", s) for s in (cd.probe(H100), cd.probe("sim:h200"))}
    first = next(iter(per.values()))
    assert [b.backend for b in first.buckets] == ["deepgemm", "deepgemm"]
    common = group._unsplit_hosts(ctx, "indexer", per, first, (64, None), {64: "deepgemm", None: "triton"})
    assert common[None] == "triton" and common[64] not in ("deepgemm", None)
    # Whole, it stays.
    assert group._unsplit_hosts(ctx, "indexer", per, first, (64, None), {64: "deepgemm", None: "deepgemm"}) == \
        {64: "deepgemm", None: "deepgemm"}


def test_the_trace_names_sglangs_own_kernel(r0517):
    from capdispatch.dispatch.explain import render_text
    p = cd.plan_in(_ctx(r0517), [H100], ["decode_mla"], log_warnings=False)
    text = render_text(p, color=False)
    assert "flashmla  (SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla))" in text, text
