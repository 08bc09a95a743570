"""Fault injection: values that once escaped the package's errors or flooded them
(item 10): numbers too long to write, non-text environment values, over-long values."""
from __future__ import annotations

import pytest

import capdispatch as cd


@pytest.mark.parametrize("data", [{"ops": {"moe": 10**5000}}, {"verify": 10**5000}])
def test_policy_from_dict_raises_only_policy_errors(data):
    with pytest.raises(cd.PolicyError, match="not plain data"):
        cd.policy_from_dict(data, origin="test")


@pytest.mark.parametrize("env", [{"CAPDISPATCH_SET": 5}, {"TRITON_INTERPRET": 1}, {"CAPDISPATCH_POLICY": None},
                                 {7: "x"}])
def test_non_text_environment_values_are_bad_input(env):
    with pytest.raises(cd.BadInput, match="environment variables and their values are strings"):
        cd.resolve("moe", "sim:h200", env=env)


@pytest.mark.parametrize("name,value", [("CAPDISPATCH_VERIFY", "x" * 5000),
                                        ("CAPDISPATCH_STRICT", "z" * 5000),
                                        ("CAPDISPATCH_SET", "moe=" + "y" * 5000),
                                        ("CAPDISPATCH_POLICY", "/nonexistent/" + "p" * 5000)])
def test_long_environment_values_are_not_echoed_whole(name, value):
    with pytest.raises(cd.CapdispatchError) as err:
        cd.resolve("moe", "sim:h200", env={name: value})
    assert len(str(err.value)) < 600, len(str(err.value))


def _error_line(capsys, argv):
    from capdispatch.dispatch.cli import main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("argv", [["model", "m" * 5000], ["model", "deepseek-v4-flash", "--tp", "9" * 5000],
                                  ["explain", "--bogus", "b" * 5000]])
def test_a_huge_value_is_named_not_echoed_whole(capsys, argv):
    # argparse's own messages and ours alike: the one error line cuts a long value
    err = _error_line(capsys, argv)
    assert len(err) < 600 and argv[-1][:300] not in err, err


def test_control_characters_in_a_path_are_escaped_in_the_error(tmp_path, capsys):
    bad = tmp_path / "\u202e\x1bconfig.json"
    bad.write_text("{")
    err = _error_line(capsys, ["checkpoint", "--model", str(bad), "--layers", "1", "--out", str(tmp_path / "o")])
    assert "\x1b" not in err and "\u202e" not in err and "\\x1b" in err, err


def test_sglang_refusal_is_its_error_line_not_its_usage(capsys):
    # SGLang's parser prints its whole usage before its error; the plan keeps only the error
    import argparse

    from capdispatch.adapters.sglang import compat
    parser = argparse.ArgumentParser(prog="sglang serve")
    parser.add_argument("--tp-size", type=int)
    with pytest.raises(compat.Rejected) as got:
        compat.parsed(parser.parse_args, ["--tp-size", "nan"])
    assert got.value.code == 2 and got.value.message == "argument --tp-size: invalid int value: 'nan'"
    assert "usage" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["==1", "triton==x.y.z", "\x1btriton"])
def test_a_bad_assume_lib_is_one_line(capsys, value):
    err = _error_line(capsys, ["explain", "--device", "sim:h200", "--assume-lib", value])
    assert "expected NAME or NAME==VERSION" in err and "\x1b" not in err, err


def test_a_model_path_with_control_characters_prints_escaped(tmp_path, capsys):
    import shutil
    from pathlib import Path

    from capdispatch.dispatch.cli import main
    path = tmp_path / "\u202e\x1bconfig.json"
    shutil.copy(Path(__file__).parent / "rehearse" / "v4-tp3" / "config.json", path)
    assert main(["model", str(path), "--tp", "3"]) == 0
    assert main(["plan", "--device", "sim:h200", "--tp", "3", "--model", str(path), "--brief"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\\u202e\\x1bconfig" in out


def test_the_env_report_cuts_a_long_value(capsys, monkeypatch):
    from capdispatch.dispatch.cli import main
    monkeypatch.setenv("CAPDISPATCH_VERIFY", "v" * 5000)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "v" * 300 not in out and "(5000 characters)" in out
