"""Small truths of a first hour: plan's table names its units (GiB beside memory, tokens beside
a context) and its parts add up to the table's KV; a refused layout's --speed says it was
skipped; rehearse's default expert count is one --ep divides; `dispatch sglang plan` merges
identical cards deciding alike into one column when the matrix is too wide, as explain does."""
import json
import re

import pytest

from capdispatch.dispatch import cli, plan_cmd, rehearse_cmd

H200_TP4 = ["plan", "--model", "deepseek-v4-flash", "--device", "sim:h200", "--tp", "4"]
REFUSED = ["plan", "--model", "deepseek-v4-flash", "--device", "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080",
           "--tp", "3"]


def test_the_plan_table_names_its_units(capsys):
    assert cli.main(H200_TP4) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("rank  card"))
    assert lines[head - 1] == "memory per rank in GiB; max context in tokens per request:"
    assert "(GiB)" not in out and lines[head].endswith("max context")
    assert all(ln == ln.rstrip() for ln in lines)


def test_small_parts_are_in_mib_and_add_up_to_the_table(capsys):
    assert cli.main(H200_TP4) == 0
    out = capsys.readouterr().out
    kv_cell = float(out.splitlines()[next(i for i, ln in enumerate(out.splitlines())
                                          if ln.startswith("rank  card")) + 1].split()[4])
    kv = out.split("\n  KV:\n", 1)[1].split("\n  workspace", 1)[0]
    parts = re.findall(r"^ +([\d.]+) (GiB|MiB)  ", kv, re.M)
    assert parts and " 0.0 GiB" not in kv
    total = sum(float(v) / (1024 if unit == "MiB" else 1) for v, unit in parts)
    assert abs(total - kv_cell) <= 0.05 + 1e-9, (parts, kv_cell)
    assert plan_cmd._part_size(0) == "0.0 GiB" and plan_cmd._part_size(48 * 2**20) == "48.0 MiB"
    assert plan_cmd._part_size(2**30) == "1.0 GiB"


def test_a_refused_layout_says_its_speed_was_skipped(capsys):
    assert cli.main(REFUSED + ["--speed"]) == 3
    out = capsys.readouterr().out
    assert "REFUSED by SGLang" in out
    assert "predicted step: skipped: SGLang refuses this layout" in out.replace("\n  ", " ")
    assert cli.main(REFUSED + ["--speed", "--format", "json"]) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["speed"] == {"skipped": plan_cmd.SPEED_SKIPPED}
    assert cli.main(REFUSED + ["--format", "json"]) == 3
    assert json.loads(capsys.readouterr().out)["speed"] is None       # not asked for


@pytest.mark.parametrize("ep,experts", [(1, 8), (2, 8), (3, 9), (5, 10), (8, 8), (16, 16)])
def test_the_default_expert_count_is_the_smallest_from_8_that_ep_divides(ep, experts):
    assert rehearse_cmd.default_experts(ep) == experts


def test_rehearse_without_experts_takes_a_count_the_layout_divides(monkeypatch, capsys):
    from capdispatch.rehearse import runner
    seen = {}

    class Done(Exception):
        pass

    def fake(devs, model, **kw):
        seen.update(kw)
        raise Done
    from capdispatch.dispatch import inputs
    monkeypatch.setattr(runner, "rehearse", fake)
    monkeypatch.setattr(inputs, "needs_torch", lambda what: None)      # the rehearsal is faked
    monkeypatch.setattr(rehearse_cmd, "planned", lambda *a, **k: type("P", (), {"whose": {}})(), raising=False)
    args = cli._parser().parse_args(["rehearse", "--device", "cpu", "--model", "deepseek-v4-flash",
                                     "--tp", "3", "--ep", "3"])
    assert args.experts is None
    with pytest.raises(Done):
        rehearse_cmd.run(args)
    assert seen["experts"] == 9


def test_an_explicit_expert_count_ep_does_not_divide_is_still_refused():
    from capdispatch.rehearse import model as M
    from capdispatch.rehearse.errors import RehearseError
    shape = type("S", (), {"ep": 3})()
    with pytest.raises(RehearseError, match=r"--experts 8 does not divide over ep 3"):
        M.dims_of(shape, layers=1, hidden=256, vocab=512, experts=8, intermediate=64)


def test_sglang_plan_merges_identical_wide_cards_into_one_column():
    from capdispatch.adapters.sglang import plan, render
    from capdispatch.adapters.sglang.records import PlanOptions
    out = plan.build(tp=2, sglang_args=None, options=PlanOptions(),
                     env={"CAPDISPATCH_SGLANG_DEVICES": "sim:rtx-pro-6000,sim:rtx-pro-6000"})
    wide = render.matrix(out, width=60, color=False)
    assert "cuda:0-1 x2" in wide and "ranks 0-1" in wide and "(rank 1)" not in wide
    assert "2 ranks in 1 column: identical cards deciding alike share one" in wide
    roomy = render.matrix(out, width=400, color=False)
    assert "cuda:0 (rank 0)" in roomy and "cuda:1 (rank 1)" in roomy and "x2" not in roomy
