"""benchmarks/bench_sm_share.py without a GPU: its arguments, the partition check, the
projection bracket and the orders it supports, and a card's section from child results."""
from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given, strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
import bench_sm_share as B  # noqa: E402


def test_arguments_and_the_catalogs_sm_counts(tmp_path):
    a = B._args(["--out", str(tmp_path)])
    assert a.cards == B.DEFAULT_CARDS and a.ops == B.DEFAULT_OPS
    assert [B.sm_count(c) for c in a.cards] == [68, 82, 128]
    for argv, words in ((["--cards", "rtx-9999"], "--cards rtx-9999: no published bandwidth"),
                        (["--ops", "nope"], "--ops nope: not an op"),
                        (["--timeout", "0"], "--timeout 0: expected seconds above 0")):
        with pytest.raises(SystemExit):
            B._args(["--out", str(tmp_path), *argv])


def test_the_partition_check_fails_closed():
    assert B.partition_ok(700 * 68 / 132, 700, 68, 132)
    assert not B.partition_ok(690, 700, 68, 132)          # every SM still working: not taken
    assert not B.partition_ok(0.0, 700, 68, 132) and not B.partition_ok(100, 0.0, 68, 132)
    assert not B.partition_ok(100, 700, 0, 132) and not B.partition_ok(100, 700, 140, 132)


@given(st.floats(1e-3, 1e3), st.floats(10, 1e4), st.floats(10, 1e4))
def test_the_bracket_is_never_faster_than_the_time_on_k_sms(t, bw_k, bw_card):
    lo, hi = B.bracket(t, bw_k, bw_card)
    assert lo == t and hi >= lo and (hi == t or abs(hi - t * bw_k / bw_card) <= 1e-9 * hi)


def test_an_order_is_supported_only_where_one_is_ahead_at_both_ends():
    rows = {"triton_w4a16": (1.0, 3.0), "marlin_w4a16": (2.0, 4.0), "torch": (0.5, 5.0)}
    assert B.order_supported(rows) == [("triton_w4a16", "marlin_w4a16")]
    assert B.order_supported({"a": (1.0, 1.0)}) == []


def _result(rate_eager, rate_graph, sms, ms):
    rows = [{"op": "moe", "size": 1, "backend": b, "ms": t, "ok": True} for b, t in ms.items()]
    rows.append({"op": "moe", "size": 1, "backend": "torch", "ms": None, "ok": False})
    return {"ceilings": {"sms": sms, "copy_gbps": 2000.0, "bf16_tflops_eager": rate_eager,
                         "bf16_tflops_graph": rate_graph},
            "bench": {"ops": {"moe": {"rows": rows}}}}


def test_a_cards_section_projects_only_where_its_partition_took():
    full = _result(700.0, 700.0, 132, {"triton_w4a16": 0.05, "marlin_w4a16": 0.06})
    part = _result(700.0 * 68 / 132, 700.0 * 68 / 132, 68, {"triton_w4a16": 0.08, "marlin_w4a16": 0.1})
    can = lambda card, op: {"triton_w4a16", "marlin_w4a16"}       # noqa: E731 (the card's runnable backends)
    s = B.project(full, part, "rtx-3080", 68, can)
    assert "error" not in s and s["partition"] == {"eager": True, "graph": True}
    r = {x["backend"]: x for x in s["rows"]}
    assert set(r) == {"triton_w4a16", "marlin_w4a16"}           # a row that failed its check is left out
    assert r["triton_w4a16"]["ms_on_k_sms"] == 0.08 and r["triton_w4a16"]["ms_whole_card"] == 0.05
    assert r["triton_w4a16"]["ms_memory_bound"] == pytest.approx(0.08 * 2000 / 760)
    assert s["orders"] == [{"op": "moe", "size": 1, "faster": "triton_w4a16", "slower": "marlin_w4a16"}]
    # A graph replayed outside the green context runs on every SM: no projection.
    part = _result(700.0 * 68 / 132, 690.0, 68, {"triton_w4a16": 0.08})
    s = B.project(full, part, "rtx-3080", 68, can)
    assert s["partition"] == {"eager": True, "graph": False} and s["rows"] == [] and "did not take" in s["error"]


def test_only_the_backends_the_card_can_run_are_projected():
    full = _result(700.0, 700.0, 132, {})
    part = _result(700.0 * 68 / 132, 700.0 * 68 / 132, 68, {"triton_w4a16": 0.08, "flashinfer_cutlass_w4a16": 0.01})
    s = B.project(full, part, "rtx-3080", 68, lambda card, op: {"triton_w4a16"})
    assert [r["backend"] for r in s["rows"]] == ["triton_w4a16"]
    assert "flashinfer_cutlass_w4a16" not in B.runnable("rtx-3080", "moe")       # wgmma: not on SM86
    assert "triton_w4a16" in B.runnable("rtx-3080", "moe")
