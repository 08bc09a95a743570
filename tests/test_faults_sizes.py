"""Fault injection: sizes. Every size a command takes has an upper bound checked before any
work starts, and a model command answers any config.json within a second or refuses it in
one line (exit 2)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from capdispatch.dispatch.cli import main
from capdispatch.models import ModelError, load_model

BASE = json.loads((Path(__file__).parent / "rehearse" / "v4-tp3" / "config.json").read_text())
COMMANDS = (["model", "deepseek-v4-flash"], ["explain", "--device", "sim:h200", "--model", "deepseek-v4-flash"],
            ["plan", "--device", "sim:h200", "--model", "deepseek-v4-flash"],
            ["sglang", "plan", "--device", "sim:h200", "--model", "deepseek-v4-flash"])


def _one_line_exit_2(capsys, argv, says):
    t0 = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("argv", COMMANDS)
@pytest.mark.parametrize("flag, value", [("--tp", "1000000000000000000"), ("--ep", "5000"),
                                         ("--tp", "9" * 5000)])
def test_rank_counts_are_bounded(capsys, argv, flag, value):
    _one_line_exit_2(capsys, [*argv, flag, value], "expected an integer from 1 to 4096")


def test_next_n_is_bounded(capsys):
    _one_line_exit_2(capsys, ["model", "deepseek-v4-flash", "--next-n", "1000"], "from 1 to 64")


def test_the_layout_search_is_bounded():
    t0 = time.monotonic()
    with pytest.raises(ModelError, match="would"):
        load_model("deepseek-v4-flash").for_rank(4093, 1, False)     # a prime: nothing divides
    assert time.monotonic() - t0 < 1


def _config(tmp_path, text) -> str:
    p = tmp_path / "config.json"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("name, text, says", [
    ("bigint", json.dumps(BASE).replace(f'"hidden_size": {BASE["hidden_size"]}', '"hidden_size": ' + "9" * 5000),
     "thousands of digits"),
    ("deep", '{"a": ' + "[" * 100000 + "]" * 100000 + "}", "nested deeper than"),
    ("hidden", json.dumps(dict(BASE, hidden_size=10 ** 300)), "up to 1048576"),
    ("layers", json.dumps(dict(BASE, num_hidden_layers=10 ** 6)), "up to 1024"),
    ("large", json.dumps(dict(BASE, pad="x" * (2 << 20))), "larger than"),
])
def test_any_config_is_answered_in_a_second(tmp_path, capsys, name, text, says):
    path = _config(tmp_path, text)
    for argv in (["model", path], ["plan", "--device", "sim:h200", "--model", path]):
        t0 = time.monotonic()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
        assert time.monotonic() - t0 < 1.5


def test_a_fifo_as_model_is_named_as_one(tmp_path, capsys):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    _one_line_exit_2(capsys, ["model", str(fifo)], "a FIFO (named pipe), not a regular file")
    _one_line_exit_2(capsys, ["model", str(tmp_path)], "a FIFO (named pipe), not a regular file")


def test_bench_sizes_on_the_cpu_are_bounded_by_the_ladder(capsys):
    _one_line_exit_2(capsys, ["bench", "--device", "cpu", "--op", "moe", "--sizes", "65536"],
                     "its ladder's largest, on the CPU")


@pytest.mark.parametrize("flag, says", [("--batch", "valid: 1..1048576 (requests"),
                                        ("--prefill", "valid: 1..1048576 (tokens")])
def test_plan_batch_and_prefill_are_bounded(capsys, flag, says):
    # once answered as "does not fit" (exit 3): a size nobody serves is bad input
    _one_line_exit_2(capsys, ["plan", "--device", "sim:h200", "--model", "deepseek-v4-flash", "--speed",
                              flag, "1" + "0" * 30], says)


def test_empty_bench_sizes_are_refused_not_the_default_ladder(capsys):
    # an empty --sizes once ran the whole default ladder (minutes on the CPU)
    _one_line_exit_2(capsys, ["bench", "--device", "cpu", "--op", "indexer", "--sizes", ""], "no sizes given")


def test_prefill_without_speed_is_refused(capsys):
    # --prefill sizes only the --speed prediction; without it a huge value was ignored (exit 3)
    _one_line_exit_2(capsys, ["plan", "--device", "sim:h200", "--model", "deepseek-v4-flash",
                              "--prefill", "1" + "0" * 18], "add --speed")


def test_bench_sizes_with_an_empty_entry_are_refused(capsys):
    _one_line_exit_2(capsys, ["bench", "--device", "cpu", "--op", "indexer", "--sizes", "1,,2"], "empty entry")


def test_lock_into_a_missing_folder_is_one_line(capsys, tmp_path):
    # the libraries:/note: lines once came before the error: the folder is checked before deciding
    _one_line_exit_2(capsys, ["lock", "--device", "sim:h200", "-o", str(tmp_path / "no" / "x.yaml")],
                     "does not exist")
