"""The served form (calibrate/served.py) and what calibration does with it: per-batch work
timed apart over the layers of one forward, graphs where SGLang captures, backends that
could not run kept at their default place, neighbours within the noise band merged,
libraries recorded, and the regret check."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import capdispatch as cd
from capdispatch.backends import builtin
from capdispatch.calibrate import choose as C
from capdispatch.calibrate import ladder, measure, served
from capdispatch.capabilities import DeviceSpec
from capdispatch.dispatch import bench_cmd, cli


# --------------------------------------------------------------------------- #
# The form
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("gib, tp, bs", [(10, 1, 8), (10, 4, 8), (32, 1, 48), (32, 4, 160), (48, 2, 32),
                                         (80, 1, 256), (80, 8, 512), (141, 1, 256), (141, 4, 512),
                                         (180, 1, 512)])
def test_the_capture_bound_is_sglangs_default_for_the_cards_memory(gib, tp, bs):
    # 0.5.23 arg_groups/memory_hook.py: 10 GB (3080) 8, 32 GB (5090) 48 below tp 4, H200 256.
    assert served.capture_max_bs(int(gib * (1 << 30)) - 1, tp) == bs


def _spec(platform="cuda", memory=141 << 30):
    return DeviceSpec(id="cuda:0" if platform == "cuda" else "cpu", name="x", platform=platform,
                      memory=memory)


def test_decode_ops_replay_a_graph_up_to_the_captured_rows_and_prefill_ops_never():
    form = served.form_for(_spec(), layers=43, next_n=2, tp=1)
    assert (form.capture_tokens, form.layers, form.timed_layers) == (512, 43, served.TIMED_LAYERS)
    ops = builtin().ops
    assert form.in_graph(ops["decode_mla"], 512) and not form.in_graph(ops["decode_mla"], 513)
    assert form.in_graph(ops["moe"], 1) and form.in_graph(ops["kv_quant"], 64)
    assert not form.in_graph(ops["sparse_prefill"], 256) and not form.in_graph(ops["kv_dequant"], 64)
    cpu = served.form_for(_spec("cpu"), layers=43)
    assert cpu.timed_layers == 1 and not cpu.in_graph(ops["moe"], 1)
    assert served.form_for(_spec(), layers=43, capture_max_bs_=0).capture_tokens == 0
    assert "eager above" in form.describe() and "43 layers" in form.describe()


@settings(max_examples=200, deadline=None)
@given(st.floats(0.001, 10.0), st.floats(0.0, 10.0), st.integers(2, 8), st.integers(1, 100))
def test_split_recovers_per_layer_and_per_batch_work(layer, batch, k, layers):
    t1, tk = batch + layer, batch + k * layer
    s = served.split(t1, tk, k, layers)
    assert s.layer_ms == pytest.approx(layer, rel=1e-6, abs=1e-9)
    assert s.batch_ms == pytest.approx(batch, rel=1e-6, abs=1e-9)
    assert s.ms == pytest.approx(layer + batch / layers, rel=1e-6, abs=1e-9)


def test_split_without_a_forward_of_several_layers_is_the_one_layer_time():
    assert served.split(2.0, None, 1, 43) == served.ServedTime(2.0, 2.0, None)
    # noise: a longer forward no slower than one layer is not a negative layer time
    s = served.split(2.0, 1.9, 4, 43)
    assert s.layer_ms > 0 and s.batch_ms >= 0


# --------------------------------------------------------------------------- #
# Measuring layers of one forward (CPU, torch backends, a fake timer)
# --------------------------------------------------------------------------- #
class LayerTimer:
    """t = BATCH + layers * LAYER (ms): what a forward with shared per-batch work costs."""
    describe = "a layer timer"

    def __init__(self, batch=3.0, layer=1.0):
        self.batch, self.layer, self.seen = batch, layer, []

    def __call__(self, fn, graph):
        self.seen.append((fn.backend, fn.size, fn.layers, graph))
        fn()                                   # the forward runs (the spy below sees it)
        return self.batch + fn.layers * self.layer


def test_a_forward_of_several_layers_shares_the_batchs_tensors_and_times_them_apart():
    import torch
    from capdispatch.backends.decode_mla import reference as R
    seen = []

    def spy(*args, **kw):
        seen.append((id(args[0]), id(args[1]), id(args[5]), id(args[10])))   # q, pool, lengths, extra lengths
        return R.decode_mla(*args, **kw)
    form = served.ServedForm("cpu", 0, 43, 3)
    timer = LayerTimer()
    rows = measure.measure("decode_mla", (2,), {"torch": spy}, device="cpu", platform="cpu",
                           profile=ladder.PROFILES["small"], gen=torch.Generator().manual_seed(0),
                           timer=timer, form=form)
    (row,) = rows
    assert row.ok and (row.layer_ms, row.batch_ms) == pytest.approx((1.0, 3.0))
    assert row.ms == pytest.approx(1.0 + 3.0 / 43)
    assert [s[2] for s in timer.seen] == [1, 1, 3, 3]      # eager: the lower of two medians
    forward = seen[-3:]                           # the three layers of the timed forward
    assert len({s[0] for s in forward}) == 3 and len({s[1] for s in forward}) == 3   # own q, own pool
    assert len({s[2] for s in forward}) == 1 and len({s[3] for s in forward}) == 1   # the batch's lengths


def test_layers_of_the_indexer_share_lengths_and_block_table_with_pools_that_fit_them():
    import torch
    from capdispatch.backends.indexer import reference as R
    from capdispatch.calibrate import inputs
    prof = dict(ladder.PROFILES["small"], indexer_heads=8, next_n=2)
    gen = torch.Generator().manual_seed(3)
    first = inputs.case("indexer", 3, gen, "cpu", prof)
    other = inputs.case("indexer", 3, gen, "cpu", prof, batch=inputs.batch_of(first))
    assert other.args[3] is first.args[3] and other.args[4] is first.args[4]
    assert other.args[0].shape == (3, 2, 8, 128) and other.args[1] is not first.args[1]
    R.fp8_paged_mqa_logits(*other.args)           # the shared block table addresses this layer's pages


def test_moe_routes_skewed_and_masked_to_the_experts_a_rank_holds():
    import torch
    from capdispatch.calibrate import inputs
    prof = dict(ladder.PROFILES["small"], moe_experts=4, moe_experts_total=16, route_skew=0.5, moe_topk=4)
    c = inputs.case("moe", 64, torch.Generator().manual_seed(0), "cpu", prof)
    ids = c.ids
    assert ids.shape == (64, 4) and int(ids.max()) < 4 and bool((ids == -1).any()) and bool((ids >= 0).any())
    ok, detail = c.verify_backend("torch", builtin().backend("moe", "torch").load())
    assert ok, detail


def test_profile_of_a_rank_takes_its_shapes():
    import attrs

    @attrs.frozen
    class Rank:   # the fields of capdispatch's RankShape that the builders read
        model: str = "m"
        tp: int = 2
        ep: int = 1
        heads: int = 32
        window: int = 128
        index_topk: int = 1024
        indexer_heads: int = 32
        next_n: int = 2
        topk: int = 8
        experts: int = 128
        experts_total: int = 256
        hidden: int = 7168
        moe_intermediate: int = 1024
        layers: int = 61
        swiglu_limit: float = 7.0
    p = ladder.profile_of(Rank())
    assert (p["heads"], p["c4_topk"], p["prefill_topk"], p["next_n"], p["moe_topk"], p["moe_experts"],
            p["moe_experts_total"], p["layers"], p["swiglu_limit"]) == (32, 1024, 1024, 2, 8, 128, 256, 61, 7.0)
    assert p["route_skew"] == ladder.SERVED_ROUTE_SKEW and p["kv_page"] == ladder.PROFILES["full"]["kv_page"]


# --------------------------------------------------------------------------- #
# Buckets: neighbours within the band
# --------------------------------------------------------------------------- #
def test_alternating_winners_within_the_band_become_one_bucket():
    times = {1: {"a": 1.00, "b": 1.02}, 2: {"a": 1.03, "b": 1.00}, 4: {"a": 1.00, "b": 1.01},
             8: {"a": 1.04, "b": 1.00}, 16: {"a": 2.0, "b": 1.0}}
    assert len(C.merge(C.choose(times, 0.05))) == 4     # a, b, a, b
    runs = C.merge(C.smooth(C.choose(times, 0.05), 0.05))
    assert [(r.upper, r.winner) for r in runs] == [(None, "b")]     # b is within 2% everywhere
    times[1] = {"a": 1.00, "b": 1.10}                               # ...but not at 1 any more
    runs = C.merge(C.smooth(C.choose(times, 0.05), 0.05))
    assert [(r.upper, r.winner) for r in runs] == [(1, "a"), (None, "b")]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from((1, 2, 4, 8, 16, 32, 64)),
                       st.fixed_dictionaries({b: st.floats(0.01, 100.0) for b in "abc"}), min_size=1),
       st.floats(0.0, 0.3))
def test_smoothing_never_picks_beyond_the_band_and_never_adds_buckets(times, noise):
    raw = C.choose(times, noise)
    smoothed = C.smooth(raw, noise)
    for c in smoothed:
        assert c.times[c.winner] <= min(c.times.values()) * (1 + noise) * (1 + 1e-12)
    assert len(C.merge(smoothed)) <= len(C.merge(raw))
    # at a bucket boundary, neither side's winner is within the band on the other side's...
    for lo, hi in zip(smoothed, smoothed[1:]):
        if lo.winner != hi.winner:
            assert lo.times[hi.winner] > min(lo.times.values()) * (1 + noise)


# --------------------------------------------------------------------------- #
# Unmeasured backends keep their default place; libraries recorded
# --------------------------------------------------------------------------- #
POLICY = """schema: 1
devices:
  - match: {{cc: ">=9.0"}}
    measured_with: {{{libs}}}
    ops:
      indexer:
        - {{tokens: "<=8", prefer: [tilelang, triton, torch], unmeasured: [deepgemm]}}
        - {{prefer: [triton, tilelang, torch], unmeasured: [deepgemm]}}
"""
LIBS = ["torch==2.11.0", "triton==3.6.0", "tilelang==0.1.12"]


def _write(tmp_path, libs='torch: "2.11.0"'):
    p = tmp_path / "cal.yaml"
    p.write_text(POLICY.format(libs=libs))
    return str(p)


def test_an_unmeasured_backend_keeps_its_default_place_without_a_fallback_warning(tmp_path):
    # A card where DeepGEMM cannot run (SM120: no wgmma, no tcgen05): the measured order runs,
    # with no warning about deepgemm, which the calibration never measured.
    path = _write(tmp_path)
    r = cd.resolve("indexer", "sim:rtx-pro-6000", policy=path, assume_libs=LIBS)
    assert [c.backend for c in r.candidates][:4] == ["deepgemm", "triton", "tilelang", "torch"]
    assert r.backend == "triton" and not r.fallback and r.downgraded_from is None
    assert [(b.upper, b.backend) for b in r.buckets] == [(8, "tilelang"), (None, "triton")]
    assert not [w for w in r.warnings if "deepgemm" in w]
    # Where DeepGEMM runs, it runs at its default place (first), not behind torch.
    r = cd.resolve("indexer", "sim:h200", policy=path, assume_libs=LIBS + ["sgl-deep-gemm==0.2.3.post2"])
    assert r.backend == "deepgemm" and not r.fallback and "unmeasured" in r.source
    assert all(b.backend == "deepgemm" for b in r.buckets)


def test_serving_with_other_libraries_than_the_calibration_warns(tmp_path):
    inv = cd.context(assume_libs=LIBS).inventory
    same = ", ".join(f'{n}: "{inv.get(n).version or "absent"}"' for n in ("torch", "triton", "tilelang"))
    r = cd.resolve("indexer", "sim:h200", policy=_write(tmp_path, same), assume_libs=LIBS)
    assert not [w for w in r.warnings if "other libraries" in w]
    path = _write(tmp_path, 'torch: "2.11.0", flashinfer-python: "absent", triton: "3.6.0"')
    r = cd.resolve("indexer", "sim:h200", policy=path, assume_libs=LIBS[1:] + ["torch==2.12.0", "flashinfer-python==0.7.2"])
    (w,) = [w for w in r.warnings if "other libraries" in w]
    assert "torch 2.11.0 there, 2.12.0 here" in w and "flashinfer-python absent there, 0.7.2 here" in w
    assert f"{path}:3" in w and "triton" not in w


def test_unmeasured_and_prefer_cannot_name_one_backend(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("schema: 1\nops:\n  indexer:\n    - {prefer: [triton, torch], unmeasured: [triton]}\n")
    with pytest.raises(cd.PolicyError, match=r"bad.yaml:4.*'triton' is also in 'prefer'"):
        cd.resolve("indexer", "sim:h200", policy=str(p))


# --------------------------------------------------------------------------- #
# The regret check
# --------------------------------------------------------------------------- #
class FakeTimer:
    describe = "a fake timer"

    def __init__(self, table):
        self.table = table

    def __call__(self, fn, graph):
        return self.table[fn.backend](fn.size)


TABLE = {"triton_u8": lambda n: 1.0 + n, "torch": lambda n: 3.5}


def _args(*argv):
    return cli._parser().parse_args(["bench", *argv])


def test_the_regret_check_names_what_a_policy_picks_against_the_fastest(clean_env, tmp_path, capsys):
    clean_env.setenv("TRITON_INTERPRET", "1")
    slow = tmp_path / "slow.yaml"
    slow.write_text("schema: 1\nops:\n  kv_dequant: [torch, triton_u8]\n")
    rc = bench_cmd.run(_args("--device", "cpu", "--op", "kv_dequant", "--sizes", "1,2,4",
                             "--check", "default", "--check", str(slow)), timer=FakeTimer(TABLE))
    out, err = capsys.readouterr()
    # torch at 1 row: 3.5 ms against triton_u8's 2 ms
    assert rc == cd.ExitCode.CHECK_FAILED == 4     # a check failed: not 1, an internal error
    assert f"regret of {slow} (picked / fastest, served form; threshold 1.05): worst 1.75" in out
    assert "regret of default" in out and "regret above 1.05" in err and "1.75x triton_u8" in err
    rc = bench_cmd.run(_args("--device", "cpu", "--op", "kv_dequant", "--sizes", "1,2,4", "--format", "json",
                             "--check", str(slow), "--threshold", "2"), timer=FakeTimer(TABLE))
    obj = json.loads(capsys.readouterr().out)
    assert rc == 0 and obj["check"]["threshold"] == 2
    ratios = {r["size"]: (r["picked"], r["fastest"], r["ratio"]) for r in obj["check"]["rows"]}
    assert ratios == {1: ("torch", "triton_u8", 1.75), 2: ("torch", "triton_u8", pytest.approx(3.5 / 3)),
                      4: ("torch", "torch", 1.0)}


@pytest.mark.parametrize("argv, needle", [
    (["--threshold", "0.9"], "--threshold 0.9: expected a ratio >= 1, e.g. 1.05"),
    (["--warmup", "nan"], "--warmup nan: expected a time in ms from 0 to 60000"),
    (["--rep", "0"], "--rep 0: expected a time in ms above 0, at most 60000"),
    (["--model", "deepseek-v4-flash", "--tp", "3"], "tp 3"),
    (["--layers", "0"], "--layers 0: expected an integer >= 1"),
    (["--cuda-graph-max-bs", "-1"], "--cuda-graph-max-bs -1: expected an integer >= 0"),
    (["--seed", "9" * 23], f"--seed {'9' * 23}: expected an integer from 0 to {2**64 - 1}"),
    (["--check", "missing.yaml"], "missing.yaml"),
])
def test_bad_bench_values_are_refused_before_anything_runs(clean_env, capsys, argv, needle):
    rc = cli.main(["bench", "--device", "cpu", "--op", "kv_dequant", "--sizes", "1", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_what_libraries_print_while_measuring_stays_out_of_the_json(clean_env, capfd):
    import os

    def noisy(fn, graph):
        print("a library's log line")
        os.write(1, b"and one written to the file descriptor\n")
        return 1.0
    rc = bench_cmd.run(_args("--device", "cpu", "--op", "kv_dequant", "--sizes", "1", "--format", "json"),
                       timer=noisy)
    out, err = capfd.readouterr()
    assert rc == 0 and json.loads(out)["ops"]["kv_dequant"]["rows"][0]["ms"] == 1.0
    assert "a library's log line" in err and "file descriptor" in err


def test_a_backend_a_server_tunes_first_is_tuned_before_it_is_timed(monkeypatch):
    """FlashInfer's MoE is tuned by SGLang (one forward inside flashinfer.autotuner.autotune)
    before it serves: the served form enters the backend's tuning context for one call first."""
    import contextlib

    import torch
    from capdispatch.backends.kv_cache import reference as R
    events = []

    @contextlib.contextmanager
    def tune():
        events.append("tune in")
        yield
        events.append("tune out")

    def timer(fn, graph):
        events.append("timed")
        return 1.0
    monkeypatch.setattr(measure, "_tuning", lambda op, b: tune if b == "torch" else None)
    measure.measure("kv_dequant", (4,), {"torch": R.kv_dequant}, device="cpu", platform="cpu",
                    profile=ladder.PROFILES["small"], gen=torch.Generator().manual_seed(0), timer=timer)
    assert events[:3] == ["tune in", "tune out", "timed"] and events.count("tune in") == 1
    for name in ("flashinfer_cutlass_w4a8", "flashinfer_trtllm_w4a8", "flashinfer_cutlass_w4a16"):
        assert builtin().backend("moe", name).tune == "flashinfer.autotuner:autotune"
    assert measure._tuning("moe", "triton_w4a16") is None


def test_without_a_model_the_served_form_still_spreads_per_batch_work_over_a_models_layers():
    """Without --model, calibration on CUDA still times forwards of several layers: one layer
    per timed call would charge FlashMLA's whole schedule to every call."""
    form = served.form_for(_spec(), layers=ladder.PROFILES["full"]["layers"])
    assert form.layers == 43 and form.timed_layers == served.TIMED_LAYERS
