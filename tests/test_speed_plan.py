"""The speed prediction of `dispatch plan --speed`: calibrations read from a calibrated policy
or `dispatch bench` JSON, interpolation, scaling to a rank's shapes, estimates by bandwidth."""
import json
import os
import subprocess
import sys

import pytest

import capdispatch as cd
from capdispatch.dispatch import speed
from capdispatch.models import model_calls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_POLICY = os.path.join(ROOT, "capdispatch", "policies", "examples", "h200.yaml")
RUN = os.path.join(ROOT, "benchmarks", "results", "h200-2026-12-03")


def test_policy_comments_are_read():
    cal = speed.load(H200_POLICY)
    assert cal.card == "h200"
    # "# tokens 1 in a CUDA graph: flashmla 13 us, triton_fp8 15.8 us, ..."
    assert cal.time("decode_mla", "flashmla", 1) == pytest.approx(0.013)
    # "# tokens 4096: flashmla 1.244 ms, ..."
    assert cal.time("decode_mla", "flashmla", 4096) == pytest.approx(1.244)
    assert cal.shapes == {"heads": 64, "experts": 64, "moe_intermediate": 2048}
    # Every op the calibrated policy names has its times read, and each is an op the model calls.
    import yaml
    named = set(yaml.safe_load(open(H200_POLICY))["devices"][0]["ops"])
    assert set(cal.times) == named and named <= set(model_calls().ops)


def _uncalibrated() -> set:
    """The model's ops the packaged H200 calibration has no times for: a new op until it is
    timed on the card (docs/contributing.md); `plan --speed` names each, and a step that
    calls one is not predicted."""
    return set(model_calls().ops) - set(speed.load(H200_POLICY).times)


def _check_steps(steps):
    """A step whose ops are all calibrated is predicted (every op's time > 0); one that calls
    an uncalibrated op is not, and each rank names that op as h200.yaml has no times for."""
    missing = _uncalibrated()
    assert steps
    for s in steps:
        called = set(model_calls().phase_ops(s["phase"]))
        for r in s["ranks"]:
            for o in r["ops"]:
                if o["op"] in missing:
                    assert o["ms"] is None and o["how"] == f"not predicted: h200.yaml has no {o['op']} times", o
                else:
                    assert o["ms"] > 0, o
        if called & missing:
            assert s["step_ms"] is None and s["tokens_per_s"] is None, s
        else:
            assert s["step_ms"] > 0 and s["tokens_per_s"] > 0, s


def test_bench_json_is_read_and_merged():
    a = speed.load(os.path.join(RUN, "calibrate_moe.json"))
    b = speed.load(os.path.join(RUN, "calibrate_indexer.json"))   # library log lines before its JSON
    m = speed.merged([a, b])
    assert len(m) == 1 and set(m[0].times) == {"moe", "indexer"}


def test_interpolation():
    pts = ((1, 1.0), (4, 4.0), (16, 8.0))
    assert speed.interpolate(pts, 1) == 1.0
    assert speed.interpolate(pts, 2) == pytest.approx(2.0)          # log-log between 1 and 4
    assert speed.interpolate(pts, 8) == pytest.approx(32 ** 0.5)     # between 4 and 16: sqrt(4 x 8)
    assert speed.interpolate(pts, 32) == pytest.approx(16.0)        # proportional beyond the largest


def test_bad_calibrations(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("schema: 1\n")
    with pytest.raises(speed.SpeedError, match="not a calibrated policy"):
        speed.load(str(bad))
    with pytest.raises(speed.SpeedError, match="cannot read"):
        speed.load(str(tmp_path / "missing.json"))


def _decisions(specs, shapes):
    p = cd.plan(specs, shapes=shapes, libs="sglang-0.5.23", log_warnings=False)
    return {op: g.per_device for op, g in p.ops.items()}


def test_calibrated_card_scaled_and_other_card_estimated():
    model = cd.load_model("deepseek-v4-flash")
    shapes = model.for_rank(4, 4, True)          # the calibration's own shapes
    cal = speed.load(H200_POLICY)
    h200 = cd.probe("sim:h200")
    t = speed.op_time("decode_mla", "flashmla", 8, shapes, h200, [cal])
    assert t.how == "calibrated" and t.ms == pytest.approx(cal.time("decode_mla", "flashmla", 8) * model.layers)
    # At tp 8 (no dp-attention) a rank computes 8 heads: an eighth of the calibrated 64.
    t8 = speed.op_time("decode_mla", "flashmla", 8, model.for_rank(8), h200, [cal])
    assert t8.ms == pytest.approx(t.ms / 8) and "scaled" in t8.how
    # A card without a calibration: the H200's time x the bandwidth ratio.
    r5090 = cd.probe("sim:rtx-5090")
    e = speed.op_time("decode_mla", "flashmla", 8, shapes, r5090, [cal])
    assert e.ms == pytest.approx(t.ms * 4800 / 1792) and e.how.startswith("estimated")
    # A card the bandwidth table lacks (a bare architecture): not predicted, and said so.
    n = speed.op_time("decode_mla", "flashmla", 8, shapes, cd.probe("sim:sm_90"), [cal])
    assert n.ms is None and n.how.startswith("not predicted")


def test_predict_names_slowest_rank():
    from capdispatch.dispatch.group import unique_ids
    model = cd.load_model("deepseek-v4-flash")
    shapes = model.for_rank(2)
    specs = unique_ids([cd.probe("sim:h200"), cd.probe("sim:rtx-5090")])
    rows = speed.predict(model, shapes, specs, _decisions(specs, shapes), [speed.load(H200_POLICY)])
    dec1 = [r for r in rows if r.phase == "decode" and r.size == 1]
    assert len(dec1) == 2 and all(r.comm_ms > 0 for r in dec1)          # tp 2 over PCIe
    if _uncalibrated() & set(model_calls().phase_ops("decode")):
        # A decode op without H200 times: neither rank's step is predicted, and each says which.
        assert all(r.total is None for r in dec1)
        assert all(any(o.how.startswith("not predicted: h200.yaml has no ") for o in r.ops) for r in dec1)
    else:
        assert all(r.total for r in dec1)
        assert max(dec1, key=lambda r: r.total).device == "sim:rtx-5090"     # less bandwidth


def test_cli_speed_json_and_text():
    p = subprocess.run([sys.executable, "-m", "capdispatch", "plan", "--model", "deepseek-v4-flash",
                        "--device", "sim:h200", "--tp", "4", "--ep", "4", "--dp-attention", "--speed",
                        "--libs", "sglang-0.5.23", "--format", "json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    sp = json.loads(p.stdout)["speed"]
    assert [(s["phase"], s["size"]) for s in sp["steps"]] == [("decode", 1), ("decode", 8), ("decode", 32),
                                                              ("prefill", 4096)]
    _check_steps(sp["steps"])
    assert sp["calibrations"] == ["h200.yaml"] and "MTP acceptance" in sp["ignores"]
    t = subprocess.run([sys.executable, "-m", "capdispatch", "plan", "--model", "deepseek-v4-flash",
                        "--device", "sim:h200", "--tp", "4", "--speed", "--brief", "--prefill", "0"],
                       capture_output=True, text=True, timeout=120)
    assert t.returncode == 2 and "--prefill 0 is not valid" in t.stderr
