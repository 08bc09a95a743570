"""`dispatch rehearse`: ranks in their own processes over gloo on the CPU, each running its
own decisions on a small V4-shaped model against the single-process reference; a fault
planted on one rank is named with its rank and op within a bounded time."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from capdispatch.dispatch.cli import main
from capdispatch.models import ModelError
from capdispatch.rehearse import devices, runner
from capdispatch.rehearse.errors import RehearseError
from capdispatch.rehearse.rank import FAULT_ENV, parse_fault

TP3 = str(Path(__file__).parent / "rehearse" / "v4-tp3" / "config.json")   # 48 heads: tp 3 divides
SEED_RIG = "emu:rtx-5090@cpu,emu:rtx-3080@cpu,emu:rtx-3080@cpu"
SMALL = dict(layers=1, prompt=4, steps=2)


def _rehearse(devs, model="deepseek-v4-flash", libs="sglang-0.5.23", **kw):
    return runner.rehearse(devices.parse_list([devs]), model, libs=libs, **kw)


def test_seed_rig_emulated_on_cpu_matches_reference():
    r = _rehearse(SEED_RIG, TP3, layers=2, prompt=4, steps=2, timeout=90)
    assert r.ok, r.cause
    assert r.backend == "gloo" and r.tp == 3 and r.dims["heads"] == 16
    for k in r.ranks:
        assert k.max_rel_err is not None and k.max_rel_err <= runner.LOGITS_REL_TOL
        assert {o.op for o in k.ops} == {"kv_quant", "kv_dequant", "indexer", "sparse_prefill",
                                         "decode_mla", "moe"}
        for o in k.ops:
            assert o.ok and o.calls > 0
            # Nothing claims a GPU kernel ran on the CPU: every other choice is a marked substitution.
            assert (o.substituted is None) == (o.decided == o.ran), o
    by = {(k.rank, o.op): o for k in r.ranks for o in k.ops}
    # The cards decide differently (fp8 on the 5090, u8 on the 3080s), as a real rig would.
    assert by[(0, "kv_quant")].decided != by[(1, "kv_quant")].decided
    assert by[(1, "kv_quant")].decided == by[(2, "kv_quant")].decided
    assert by[(0, "moe")].calls == 2 * 3        # 2 layers x (prefill + 2 decode steps)


def test_wrong_output_is_named_with_rank_and_op(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:moe:wrong")
    r = _rehearse("cpu,cpu", timeout=60, **SMALL)
    assert not r.ok
    bad = r.ranks[1]
    assert bad.failed_op == "moe" and "differs from the reference" in bad.error
    assert r.cause.startswith("rank 1:") and "moe" in r.cause


def test_hang_is_bounded_and_named(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:decode_mla:hang")
    t0 = time.monotonic()
    r = _rehearse("cpu,cpu", timeout=4, **SMALL)
    # Start (imports: under 20 s on a loaded CI machine), the run up to the hang, the timeout.
    assert time.monotonic() - t0 < 20 + 10 + 4
    assert not r.ok
    assert r.ranks[1].failed_op == "decode_mla" and "made no progress for 4 s" in r.ranks[1].error
    assert r.cause.startswith("rank 1:")
    assert not r.ranks[0].ok and "all_reduce" in r.ranks[0].error   # it waited, bounded, in its all-reduce


@pytest.mark.parametrize("kind, says", [("raise", "planted fault"), ("exit", "died (exit 17)")])
def test_exception_or_death_is_named(monkeypatch, kind, says):
    monkeypatch.setenv(FAULT_ENV, f"0:kv_quant:{kind}")
    r = _rehearse("cpu,cpu", timeout=60, **SMALL)
    assert not r.ok and r.ranks[0].failed_op == "kv_quant"
    assert says in r.cause and r.cause.startswith("rank 0:")


# --- bad input: refused before any process starts ---------------------------------------------

def test_layout_the_model_cannot_take_is_refused():
    with pytest.raises(ModelError, match="heads 64 do not divide over tp 3"):
        _rehearse(SEED_RIG)


@pytest.mark.parametrize("text, msg", [
    ("sim:rtx-3080", "has no device to run on: use emu:rtx-3080@cpu"),
    ("emu:rtx-3080", "expected emu:NAME@DEV"),
    ("emu:rtx-3081@cpu", "did you mean 'rtx-3080'"),
    ("emu:rtx-3080@gpu0", "a rank runs on cpu or cuda:N"),
])
def test_bad_devices(text, msg):
    with pytest.raises(RehearseError, match=msg):
        devices.parse(text)


def test_emulated_device_decides_as_the_card_and_runs_on_dev():
    d = devices.parse("emu:rtx-3080@cpu")
    assert (d.decide, d.run, d.emulated) == ("sim:rtx-3080", "cpu", True)
    assert not devices.parse("cpu").emulated


@pytest.mark.parametrize("value", ["1:moe", "x:moe:wrong", "1:mo:wrong", "1:moe:slow"])
def test_bad_fault_values(value):
    with pytest.raises(RehearseError, match=FAULT_ENV):
        parse_fault(value)


def test_cli_bad_input_exits_2(monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "nonsense")
    assert main(["rehearse", "--device", "cpu", "--model", "deepseek-v4-flash"]) == 2
    assert FAULT_ENV in capsys.readouterr().err
    monkeypatch.delenv(FAULT_ENV)
    assert main(["rehearse", "--device", "cpu,cpu", "--tp", "3", "--model", "deepseek-v4-flash"]) == 2
    assert main(["rehearse", "--device", "cpu", "--model", "deepseek-v4-flash", "--hidden", "100"]) == 2


# --- on a CUDA card (skipped without one) -----------------------------------------------------

@pytest.mark.gpu
def test_seed_rig_emulated_on_one_card():
    """The seed rig's cards as three processes on cuda:0 (gloo: the ranks share the card): the
    decisions are the cards', what cannot run on this card is a marked substitution."""
    r = _rehearse("emu:rtx-5090@cuda:0,emu:rtx-3080@cuda:0,emu:rtx-3080@cuda:0", TP3,
                  layers=2, prompt=8, steps=3, timeout=120)
    assert r.ok, r.cause
    assert r.backend == "gloo"
    for k in r.ranks:
        assert k.max_rel_err <= runner.LOGITS_REL_TOL
        for o in k.ops:
            assert o.ok and (o.substituted is None) == (o.decided == o.ran), o


@pytest.mark.gpu
def test_one_card_at_the_model_heads():
    # This machine's libraries decide: every chosen kernel is one that can run here.
    r = _rehearse("cuda:0", libs=None, layers=2, prompt=8, steps=3, timeout=120)
    assert r.ok, r.cause
    assert r.dims["heads"] == 64 and all(o.substituted is None for o in r.ranks[0].ops)
