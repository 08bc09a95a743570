"""Fuzzing the command line in-process: every flag and variable value ends in
exit 0, 2 or 3 with one line on stderr -- never an exception, never exit 1."""
import os
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from capdispatch.dispatch.cli import main
from cli_checks import assert_no_crash

ODD = ["", " ", ",", ",,", "cuda:²", "cuda:-1", "cuda:99999999999999999999", "cuda:" + "9" * 5000,
       "cuda:", "cuda:0x1", "cuda:\u0661", "sim:", "sim: ", "sim:#", "sim:rtx-3080#2",
       "sim:rtx-3080@1", "sim:NVIDIA GeForce RTX 5090", "sim:nvidia  geforce rtx 5090",
       "sim:geforce-rtx-3080", "sim:sm_90a", "sim:\x00", "sim:\udcff", "\ud800", "a\x00b",
       "cpu", "CPU", "gpu", "sim:rtx-5090,cpu", "sim:" + "x" * 5000, "-", "--", "=", "==",
       "kv_quant=", "=torch", "kv_quant=torch=x", "kv_quant=torch,", "kv_qaunt=torch",
       "triton==" + "9" * 5000, "triton==", "triton>=3", "triton==3.*", "triton[x]==3.0",
       "triton @ file:///x", "triton==3.0; python_version>'3'", "flashinfer==0.7.2",
       "flashinfer-python==0.7.2", "12.8", "13", "cuda13", "1e3", "nan", "-1", "maybe", "yes",
       "/proc/self/environ", "/", ".", "/dev/null", "no/such/file.yaml", "\U0001F600"]
_value = st.sampled_from(ODD) | st.text(max_size=12)

FLAGS = ["--device", "--op", "--set", "--assume-lib", "--assume-cuda", "--policy"]


def _run(argv, env=None):
    patch = {k: v for k, v in (env or {}).items()}
    clear = {k: "" for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT",
                             "CAPDISPATCH_VERIFY")}
    with mock.patch.dict(os.environ, {**clear, **patch}):
        try:
            rc = main(argv)
        except BaseException as exc:  # the property: nothing escapes main()
            pytest.fail(f"main({argv!r}) raised {type(exc).__name__}: {exc}")
    assert rc in (0, 2, 3), (argv, env, rc)
    return rc


def _no_traceback(capsys):
    err = capsys.readouterr().err
    assert_no_crash(err)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.sampled_from(FLAGS), _value), min_size=1, max_size=3))
def test_explain_flag_values(capsys, pairs):
    argv = ["explain", "--format", "json"]
    # Simulated devices keep the example cheap; a cuda:N value still goes through probing.
    if not any(f == "--device" for f, _ in pairs):
        argv += ["--device", "sim:rtx-3080"]
    for flag, value in pairs:
        argv += [flag, value]
    _run(argv)
    _no_traceback(capsys)


@settings(max_examples=40)
@given(st.sampled_from(["CAPDISPATCH_SET", "CAPDISPATCH_POLICY", "CAPDISPATCH_STRICT",
                        "CAPDISPATCH_IMPORT_TIMEOUT", "CAPDISPATCH_VERIFY"]),
       (st.sampled_from(ODD) | st.text(max_size=12)).filter(lambda v: "\x00" not in v))
def test_environment_values(capsys, name, value):
    try:
        os.fsencode(value)
    except UnicodeError:
        return   # not representable in an environment
    _run(["explain", "--device", "cpu", "--op", "kv_dequant"], env={name: value})
    _no_traceback(capsys)


@settings(max_examples=30)
@given(st.lists(_value, min_size=1, max_size=3))
def test_policy_commands_with_odd_paths(capsys, paths):
    _run(["policy", "validate", *paths])
    _no_traceback(capsys)
    _run(["policy", "show", *[a for p in paths for a in ("--policy", p)]])
    _no_traceback(capsys)


@settings(max_examples=30)
@given(_value)
def test_devices_command(capsys, value):
    _run(["devices", "--device", value])
    _no_traceback(capsys)


@pytest.mark.parametrize("argv,rc", [
    (["explain", "--device", "cuda:²"], 2), (["explain", "--device", "cuda:-1"], 2),
    (["explain", "--device", "sim:"], 2), (["explain", "--device", "sim:\udcff"], 2),
    (["explain", "--device", "sim:rtx-3080", "--assume-lib", "triton==" + "9" * 5000], 2),
    (["explain", "--device", "sim:rtx-3080", "--assume-cuda", "cuda13"], 2),
    (["explain", "--device", "sim:rtx-3080", "--policy", "a\x00b"], 2),
    (["explain", "--device", "sim:rtx-3080", "--policy", "/proc/self/environ"], 2),
    (["explain", "--device", "sim:rtx-3080", "--set", "kv_quant=torch=x"], 2),
    (["explain", "--device", "sim:NVIDIA GeForce RTX 5090", "--op", "kv_quant"], 0),
    (["explain", "--no-such-flag"], 2), (["explain", "--help"], 0),
    (["bench", "--device", "cpu", "--op", "kv_quant", "--sizes", "\u00b2"], 2),
    (["bench", "--device", "cpu", "--op", "kv_quant", "--sizes", "9" * 5000], 2),
])
def test_known_bad_values(capsys, argv, rc):
    assert _run(argv) == rc
    captured = capsys.readouterr()
    assert_no_crash(captured.err)
    if rc == 2 and "--no-such-flag" not in argv:
        assert captured.err.startswith("dispatch: error: "), captured.err
        assert len(captured.err.splitlines()) <= 3, captured.err


def test_an_unexpected_exception_is_one_line_and_exit_1(capsys, monkeypatch):
    import capdispatch.dispatch.cli as cli
    monkeypatch.setattr(cli, "_run", lambda args: 1 / 0)
    monkeypatch.delenv("CAPDISPATCH_DEBUG", raising=False)
    assert cli.main(["ops"]) == 1
    err = capsys.readouterr().err
    assert "internal error: ZeroDivisionError" in err and "please report" in err
    assert "Traceback" not in err
