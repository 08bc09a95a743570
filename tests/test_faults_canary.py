"""Fault injection: canary children and what their outcomes may teach the cache.

Most cases replace the child's program with a few lines that misbehave at once (hang,
kill themselves, die before start-up), so they take about a second; two cases start the
real child (a `torch.py` planted in the working directory must not run in it) and the
real `dispatch verify` (interrupted and terminated, its children checked gone).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import capdispatch as cd
from capdispatch import proof
from capdispatch.backends.base import triton_interpret
from capdispatch.dispatch import verify as V
from capdispatch.dispatch.resolver import context
from capdispatch.proof import runner

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GOOD = os.path.join(HERE, "plugins", "good")

READY = "from capdispatch.proof.child import READY; print(READY, flush=True); "
FAKE = {
    "hang": READY + "import time; time.sleep(3600)",
    "outside_kill": READY + "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "abort": READY + "import os; os.abort()",
    "no_start": "import sys; sys.exit(7)",
    "hang_before_start": "import time; time.sleep(3600)",
}


# Runs `python ARGS...` with SIGINT at its default: a command started by a harness that runs
# as a background job without job control would otherwise inherit SIGINT ignored.
SIGINT_DEFAULT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")


def fake_boot(body: str) -> str:
    """A child program in runner._BOOT's shape (path from argv) that runs BODY."""
    return ("import json, sys; cfg = json.loads(sys.argv.pop(1)); sys.path[0:0] = cfg['path']; " + body)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in an interactive process: a
    harness run as a background job without job control inherits SIGINT ignored."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture
def tmpdir_only(tmp_path, monkeypatch):
    """Temporary folders of the runner go to a folder of this test's, to be counted."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list:
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(p))
    return out


# --------------------------------------------------------------------------- #
# What a child's end means
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("case,outcome,fault", [
    ("outside_kill", "crash", "killed from outside (SIGKILL)"),
    ("abort", "crash", ""),
    ("no_start", "crash", "before it reached the kernel"),
    ("hang_before_start", "timeout", "did not start"),
])
def test_outcome_and_fault(case, outcome, fault, monkeypatch, tmpdir_only):
    monkeypatch.setattr(runner, "_BOOT", fake_boot(FAKE[case]))
    t0 = time.monotonic()
    v = runner.run_canary("kv_dequant", "torch", "cpu", timeout=1, startup_timeout=1.5)
    assert time.monotonic() - t0 < 10
    assert v.outcome == outcome and (fault in v.fault if fault else v.fault == ""), v
    assert os.listdir(tmpdir_only) == []                      # its folder is gone


def test_only_the_kernels_outcomes_are_cached(monkeypatch, tmpdir_only):
    env = dict(os.environ)
    cpu = cd.probe("cpu")
    ctx = context(env=env)
    job = V.Job(cpu, "kv_dequant", "torch")
    for case in ("outside_kill", "no_start"):
        monkeypatch.setattr(runner, "_BOOT", fake_boot(FAKE[case]))
        [r] = V.run(ctx, [job], timeout=2)
        assert r.verdict.fault and proof.lookup(cpu, "kv_dequant", "torch", env=env) is None, case
    monkeypatch.setattr(runner, "_BOOT", fake_boot(FAKE["abort"]))
    [r] = V.run(ctx, [job], timeout=2)
    assert r.verdict.outcome == "crash" and not r.verdict.fault
    assert proof.lookup(cpu, "kv_dequant", "torch", env=env).outcome == "crash"


def test_a_timeout_of_the_budget_is_not_the_kernels(monkeypatch, tmpdir_only):
    monkeypatch.setattr(runner, "_BOOT", fake_boot(FAKE["hang"]))
    cpu = cd.probe("cpu")
    t0 = time.monotonic()
    v = cd.verify_decisions(cpu, {"kv_dequant": "torch"}, budget_s=1.0)
    assert time.monotonic() - t0 < 10
    [r] = v.results
    assert r.verdict.outcome == "timeout" and "budget" in r.verdict.fault
    assert v.failed == () and v.unverified == (r,)             # not failed: unverified
    assert proof.lookup(cpu, "kv_dequant", "torch") is None    # and not cached
    assert "not the kernel's" in v.describe()
    # the caller's own --timeout is the kernel's limit: that timeout is cached
    [r] = V.run(context(), [V.Job(cpu, "kv_dequant", "torch")], timeout=1.0)
    assert r.verdict.outcome == "timeout" and not r.verdict.fault
    assert proof.lookup(cpu, "kv_dequant", "torch").outcome == "timeout"


def test_a_repeated_device_runs_its_canary_on_the_device_itself(monkeypatch, tmpdir_only):
    """cpu@1 (a group's second copy of the CPU) is `cpu` to torch: a child told `cpu@1`
    would fail before the kernel and that failure would be taken for the kernel's."""
    monkeypatch.setattr(runner, "_BOOT", fake_boot(
        READY + "from capdispatch.proof.child import _write; "
        "_write(sys.argv[5], {'outcome': 'pass' if sys.argv[3] == 'cpu' else 'runtime', "
        "'detail': sys.argv[3], 'seconds': {}})"))
    from capdispatch.dispatch.group import unique_ids
    specs = unique_ids([cd.probe("cpu"), cd.probe("cpu")])
    assert [s.id for s in specs] == ["cpu@0", "cpu@1"]
    results = V.run(context(), [V.Job(s, "kv_dequant", "torch") for s in specs], timeout=5)
    assert [r.verdict.outcome for r in results] == ["pass", "pass"], results


@pytest.mark.parametrize("bad", [0, -5, float("nan"), float("inf"), "x"])
def test_timeout_must_be_a_finite_positive_number(bad, capsys):
    with pytest.raises(cd.BadInput, match="is not a time limit"):
        V.run(context(), [], timeout=bad)
    if not isinstance(bad, str):
        from capdispatch.dispatch import cli
        assert cli.main(["verify", "--device", "cpu", "--timeout", str(bad)]) == 2
        assert "--timeout" in capsys.readouterr().err
    with pytest.raises(cd.BadInput):
        cd.verify_decisions(cd.probe("cpu"), {"kv_dequant": "torch"}, budget_s=1, timeout_s=bad)


def test_a_childs_max_err_past_floats_range_is_a_malformed_result(monkeypatch, tmpdir_only):
    monkeypatch.setattr(runner, "_BOOT", fake_boot(
        READY + "from capdispatch.proof.child import _write; "
        "_write(sys.argv[5], {'outcome': 'mismatch', 'max_err': 10**400, 'seconds': {}})"))
    v = runner.run_canary("kv_dequant", "torch", "cpu", timeout=5)
    assert v.outcome == "crash" and v.fault == "malformed result", v


@pytest.mark.parametrize("bad", ["1e-9", "0.5"])
def test_a_timeout_too_short_for_any_child_is_refused_before_a_canary_runs(bad, monkeypatch, capsys):
    """--timeout 1e-9 times out every canary before its child starts: cached, such a verdict
    rejects a sound backend for good. It is bad input, refused before anything runs."""
    ran = []
    monkeypatch.setattr(runner, "run_canary", lambda *a, **k: ran.append(a))
    from capdispatch.dispatch import cli
    assert cli.main(["verify", "--device", "cpu", "--op", "kv_quant", "--timeout", bad]) == 2
    err = capsys.readouterr().err
    assert f"--timeout: {float(bad)!r} is not a time limit" in err and ">= 1" in err, err
    assert len(err.strip().splitlines()) == 1 and ran == []
    with pytest.raises(cd.BadInput, match=">= 1"):
        cd.verify_decisions(cd.probe("cpu"), {"kv_quant": "torch"}, timeout_s=float(bad))


def test_a_decision_a_cached_failure_leaves_without_a_backend_names_the_way_out(capsys):
    """A cached failure that makes `explain` exit 3 says how to run the canary again or
    forget the cache."""
    cpu = cd.probe("cpu")
    proof.store(cpu, "torch", proof.Verdict(op="kv_quant", backend="torch", device="cpu", outcome="timeout",
                                            detail="no result 60 s after start-up (killed)"))
    from capdispatch.dispatch import cli
    assert cli.main(["explain", "--device", "cpu", "--op", "kv_quant"]) == 3
    err = capsys.readouterr().err
    assert "dispatch verify --clear-cache" in err, err
    assert "dispatch verify --device cpu --op kv_quant --backend torch" in err, err


def test_an_interrupt_kills_every_child_at_once(monkeypatch, tmpdir_only, sigint_raises):
    """KeyboardInterrupt in the calling thread, --jobs 4: every child's group killed within
    2 s, nothing cached, no folder left."""
    monkeypatch.setattr(runner, "_BOOT", fake_boot(FAKE["hang"]))
    cpu = cd.probe("cpu")
    ctx = context()
    names = ["torch", "triton_u8", "triton_fp8"]
    started = []

    def on_start(job):
        started.append(job)
        if len(started) == len(names):
            import threading

            def interrupt():     # a real signal: it wakes the main thread's wait
                time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=interrupt, daemon=True).start()
    t0 = None
    with pytest.raises(KeyboardInterrupt):
        t0 = time.monotonic()
        V.run(ctx, [V.Job(cpu, "kv_dequant", n) for n in names], timeout=60, workers=4, on_start=on_start)
    assert time.monotonic() - t0 < 1.0 + 2.0 + 1.0
    assert _children(os.getpid()) == []
    assert os.listdir(tmpdir_only) == []
    assert all(proof.lookup(cpu, "kv_dequant", n) is None for n in names)


# --------------------------------------------------------------------------- #
# The real child and the real command
# --------------------------------------------------------------------------- #
def test_a_torch_py_in_the_working_directory_does_not_run(tmp_path, monkeypatch, tmpdir_only):
    planted = tmp_path / "cwd"
    planted.mkdir()
    marker = tmp_path / "ran"
    for mod in ("torch", "numpy", "capdispatch_testplugin"):
        (planted / f"{mod}.py").write_text(f"open({str(marker)!r}, 'a').write('{mod}')\n"
                                           "raise SystemExit(3)\n")
    monkeypatch.chdir(planted)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, "", GOOD]))   # "" would be the cwd
    v = runner.run_canary("kv_dequant", "torch", "cpu", timeout=60)
    assert not marker.exists(), marker.read_text()
    assert v.passed, v


def test_verify_stops_within_2s_and_leaves_no_child(tmp_path):
    """`dispatch verify --jobs 8` with two canaries running, sent SIGINT, SIGTERM or
    SIGKILL (three commands at once): it ends within 2 s, its children with it; no
    verdict is recorded; after SIGINT and SIGTERM no canary folder is left."""
    runs = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        base = tmp_path / sig.name
        (base / "tmp").mkdir(parents=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, GOOD]), TMPDIR=str(base / "tmp"),
                   CAPDISPATCH_CACHE_DIR=str(base / "cache"))
        env.pop("TRITON_INTERPRET", None)
        runs[sig] = (base, subprocess.Popen(
            [sys.executable, "-c", SIGINT_DEFAULT, "-m", "capdispatch", "verify", "--device", "cpu", "--op", "kv_dequant",
             "--op", "kv_quant", "--backend", "torch", "--jobs", "8", "--timeout", "60"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    try:
        for sig, (base, p) in runs.items():
            deadline = time.monotonic() + 60
            kids = []
            while time.monotonic() < deadline and len(kids) < 2:
                time.sleep(0.05)
                kids = _children(p.pid)
                assert p.poll() is None, p.communicate()
            assert len(kids) == 2, "the canaries did not start"
            t0 = time.monotonic()
            os.kill(p.pid, sig)
            out, err = p.communicate(timeout=10)
            assert time.monotonic() - t0 < 2.0, (sig, err)
            gone = time.monotonic() + 2.0
            while any(_alive(k) for k in kids) and time.monotonic() < gone:
                time.sleep(0.05)
            assert not any(_alive(k) for k in kids), f"a canary child outlived verify ({sig.name})"
            if sig != signal.SIGKILL:
                assert p.returncode == 130 and "interrupted" in err, (sig, p.returncode, err)
                assert os.listdir(base / "tmp") == []          # every canary folder removed
            assert not list((base / "cache").rglob("*.json"))   # nothing recorded
    finally:
        for _, p in runs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


# --------------------------------------------------------------------------- #
# TRITON_INTERPRET, as Triton reads it
# --------------------------------------------------------------------------- #
SPELLINGS = ["1", "true", "TRUE", "On", "yes", "y", "0", "false", "no", "off", " 0", " 1", "1 ", "",
             "2", "t", "enable"]


def test_triton_interpret_spellings_match_triton():
    pytest.importorskip("triton")
    probe = ("import json, os, sys\n"
             "from triton._C.libtriton import getenv_bool\n"
             "out = {}\n"
             "for v in json.loads(sys.argv[1]):\n"
             "    os.environ['TRITON_INTERPRET'] = v\n"
             "    out[v] = getenv_bool('TRITON_INTERPRET', False)\n"
             "print(json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", probe, json.dumps(SPELLINGS)], capture_output=True, text=True,
                       timeout=60)
    if p.returncode != 0:
        pytest.skip(f"this Triton has no getenv_bool: {p.stderr.strip().splitlines()[-1:]}")
    triton_says = json.loads(p.stdout)
    ours = {v: triton_interpret({"TRITON_INTERPRET": v}) for v in SPELLINGS}
    assert ours == triton_says
    assert triton_interpret({}) is False


def test_interpreter_off_spellings_share_the_off_key(tmp_path):
    cpu = cd.probe("cpu")
    env = dict(os.environ, CAPDISPATCH_CACHE_DIR=str(tmp_path))
    env.pop("TRITON_INTERPRET", None)
    proof.store(cpu, "triton_u8", proof.Verdict(op="kv_dequant", backend="triton_u8", device="cpu",
                                                 outcome="runtime", detail="x"), env=env)
    for off in ("false", "no", "off", " 0"):
        assert proof.lookup(cpu, "kv_dequant", "triton_u8", env={**env, "TRITON_INTERPRET": off}) \
            is not None, off
        assert cd.resolve("kv_dequant", "cpu", env={**env, "TRITON_INTERPRET": off}).backend == "torch"
    assert proof.lookup(cpu, "kv_dequant", "triton_u8", env={**env, "TRITON_INTERPRET": "1"}) is None
