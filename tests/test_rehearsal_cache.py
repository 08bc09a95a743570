"""The rehearsal cache (proof/rehearsals.py) and the SGLang launch's use of it
(adapters/sglang/rehearsal.py): a verdict recorded for a group's cards, software and
decisions is found by a launch with the same, signed like the canary cache, and
CAPDISPATCH_REQUIRE_REHEARSAL refuses a launch without a passed one."""
from __future__ import annotations

import json
import logging
import os

import attrs
import pytest

import capdispatch as cd
from capdispatch.adapters.sglang import rehearsal as R
from capdispatch.proof import rehearsals as RC

CARD = {"platform": "cuda", "name": "NVIDIA GeForce RTX 3080", "cc": "8.6", "uuid": "abc", "driver": "580.1",
        "cuda": "12.8", "torch": "2.11", "triton": "3.6", "capdispatch": "0.1"}
DEC = {"kv_quant": [[{"op": "kv_quant", "name": "triton_u8"}, []], [{"op": "kv_quant", "name": "triton_u8"}, []]],
       "moe": [[{"op": "moe", "name": "triton_w4a16"}, []], [{"op": "moe", "name": "marlin_w4a16"}, []]]}


def _verdict(ok=True, at="2026-12-03T10:00:00Z", cause=None):
    return RC.RehearsalVerdict(ok, cause, ("cuda:0", "cuda:1"), "deepseek-v4-flash", 2, 1, False, 1e-3, at)


def test_round_trip_subset_and_newest():
    cards = [CARD, dict(CARD, uuid="def")]
    assert RC.lookup(cards, DEC) is None
    p = RC.store(cards, DEC, _verdict(ok=False, cause="rank 1: moe differs", at="2026-12-03T09:00:00Z"))
    assert p is not None and p.parent.parent == RC.root() and oct(os.stat(p).st_mode & 0o777) == "0o600"
    assert RC.lookup(cards, DEC).ok is False
    RC.store(cards, DEC, _verdict())                     # the same key: the newer verdict replaces it
    assert RC.lookup(cards, DEC).ok is True
    assert RC.lookup(cards, {"moe": DEC["moe"]}).ok        # a launch deciding fewer ops
    other = {"moe": [DEC["moe"][0], DEC["moe"][0]]}       # another rank-1 kernel
    assert RC.lookup(cards, other) is None
    assert RC.lookup([CARD, CARD], DEC) is None           # another card (UUID)
    assert RC.lookup([dict(c, torch="2.12") for c in cards], DEC) is None   # other software


def test_a_changed_file_is_not_trusted(caplog):
    cards = [CARD]
    dec = {"moe": [DEC["moe"][0]]}
    p = RC.store(cards, dec, _verdict(ok=False, cause="x"))
    body = json.loads(p.read_text())
    body["verdict"]["ok"] = True                          # a forged pass
    p.write_text(json.dumps(body))
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert RC.lookup(cards, dec) is None
    assert "keyed digest does not match" in caplog.text


def test_emulated_cards_never_answer_for_real_ones():
    real = cd.probe("cpu")
    emu = RC.rank_card(real, emulated_spec=cd.probe("sim:rtx-3080"))
    assert emu["emulated"] == "rtx-3080" and emu["on"] == RC.rank_card(real)
    RC.store([emu], {"moe": [DEC["moe"][0]]}, _verdict())
    assert RC.lookup([RC.rank_card(real)], {"moe": [DEC["moe"][0]]}) is None


def test_uuid_is_written_one_way():
    spec = attrs.evolve(cd.probe("sim:rtx-3080"), uuid="GPU-ABC", probe="torch")
    assert RC.rank_card(spec)["uuid"] == "abc"
    assert RC.rank_card(attrs.evolve(spec, uuid="abc"))["uuid"] == "abc"


def _cpu_plan():
    return cd.plan(["cpu"], ["kv_quant", "moe"])


def test_verdict_for_a_plan_and_the_launch_setting():
    plan = _cpu_plan()
    env = dict(os.environ)
    entry, refusal = R.check(plan, ["kv_quant", "moe"], "deepseek-v4-flash", env)
    assert entry == {"required": False, "found": False, "verdict": None} and refusal is None
    env[R.ENV_REQUIRE] = "1"
    entry, refusal = R.check(plan, ["kv_quant", "moe"], "deepseek-v4-flash", env)
    assert isinstance(refusal, cd.RehearsalRequiredError) and isinstance(refusal, cd.CapdispatchError)
    text = str(refusal)
    assert text.startswith("CAPDISPATCH_REQUIRE_REHEARSAL=1: no rehearsal is recorded")
    assert "`dispatch rehearse --device cpu --model deepseek-v4-flash --tp 1`" in text and entry["refused"]
    cards = [RC.rank_card(s) for s in plan.devices]
    RC.store(cards, RC.decisions_of(plan), _verdict(ok=False, cause="rank 0: moe differs from the reference"))
    entry, refusal = R.check(plan, ["kv_quant", "moe"], "deepseek-v4-flash", env)
    assert entry["found"] and "FAILED: rank 0: moe differs" in str(refusal)
    RC.store(cards, RC.decisions_of(plan), _verdict(at="2026-12-03T11:00:00Z"))
    entry, refusal = R.check(plan, ["kv_quant", "moe"], "deepseek-v4-flash", env)
    assert refusal is None and entry["verdict"]["ok"] and entry["required"]
    assert cd.rehearsal_verdict(plan).ok
    assert cd.rehearsal_verdict(cd.plan(["sim:rtx-3080"], ["moe"])) is None     # no card to key by


def test_a_bad_setting_is_named():
    with pytest.raises(cd.BadInput, match="CAPDISPATCH_REQUIRE_REHEARSAL='maybe'|CAPDISPATCH_REQUIRE_REHEARSAL=maybe"):
        R.check(_cpu_plan(), ["moe"], None, {R.ENV_REQUIRE: "maybe"})
