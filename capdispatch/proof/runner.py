"""Run a canary in a child process with a timeout and turn what happened into a Verdict.

Each canary runs in a fresh interpreter in its own session (process group), started
isolated (`python -I`: neither the caller's working directory, nor PYTHON* variables,
nor the user's site-packages reach its import path; it runs in a temporary folder), with
the import path of this process's capdispatch and the caller's PYTHONPATH entries made
absolute. A compile error, an illegal memory access that poisons the CUDA context, a hang
or an abort ends that child only. Its process group is killed on every way out of
`run_canary` (a result, a timeout, an exception, an interrupt), its temporary folder
removed; the child also kills its group when its parent dies.

A verdict is the kernel's only when the kernel caused it: a child that never reached the
kernel (Python, torch or capdispatch did not start), one killed from outside (SIGKILL,
SIGTERM, SIGINT, SIGHUP, SIGQUIT), a run cut short by the caller's time budget or
interrupted carries a `fault` and is not cached.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from .verdict import Verdict

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 120.0
POLL_S = 0.1                     # how often a wait looks at its cancel event
MAX_RESULT_BYTES = 1 << 20
EXTERNAL_SIGNALS = ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

# The child's first statement: its import path from the parent, then the canary.
_BOOT = ("import json, sys; cfg = json.loads(sys.argv.pop(1)); sys.path[0:0] = cfg['path']; "
         "from capdispatch.proof.child import main; raise SystemExit(main(parent=cfg['parent']))")



def _package_root() -> str:
    """The folder holding this capdispatch package (capdispatch/proof/runner.py, two up)."""
    return str(Path(__file__).resolve().parents[2])


def child_env(env=None) -> dict:
    """The child's environment: the caller's, with this capdispatch first on the path."""
    env = dict(os.environ if env is None else env)
    parts = [_package_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def child_path(env) -> list:
    """The folders the child puts first on its import path: this capdispatch's, then the
    caller's PYTHONPATH entries made absolute (an empty entry, which would mean the
    working directory, is dropped)."""
    parts = [_package_root()] + [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                 if p.strip()]
    return list(dict.fromkeys(parts))


def _tail(text: str, n: int = 6) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def run_canary(op: str, backend: str, device: str, *, timeout: float = DEFAULT_TIMEOUT_S,
               seed: Optional[int] = None, env=None,
               startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S, budget_cut: bool = False,
               cancel: Optional[threading.Event] = None) -> Verdict:
    """Verify BACKEND of OP on DEVICE ("cpu", "cuda:N") in a child process. TIMEOUT
    counts from the child's start-up (python and torch imported): loading the kernel,
    compiling it and running the canary; STARTUP_TIMEOUT bounds the start-up itself.
    BUDGET_CUT: TIMEOUT is what the caller's time budget left, less than it asked for
    (a timeout then is the budget's, not the kernel's). CANCEL: set it to stop the child
    at once (the verdict then has a fault)."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else int(seed)
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    env = dict(os.environ if env is None else env)
    base = dict(op=op, backend=backend, device=device, seed=seed, at=at)
    with tempfile.TemporaryDirectory(prefix="capdispatch-canary-", ignore_cleanup_errors=True) as tmp:
        result = os.path.join(tmp, "result.json")
        err_path = os.path.join(tmp, "stderr.txt")
        cfg = json.dumps({"path": child_path(env), "parent": os.getpid()})
        cmd = [sys.executable, "-I", "-c", _BOOT, cfg, op, backend, device, str(seed), result]
        t0 = time.perf_counter()
        with open(err_path, "w+b") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                    env=child_env(env), cwd=tmp, start_new_session=True)
            try:
                ready = _wait_ready(proc, startup_timeout, cancel)
                started = time.perf_counter()
                limit = timeout if ready else startup_timeout - (started - t0)
                code, timed_out = _wait_exit(proc, limit, cancel)
            finally:
                _kill_group(proc)          # every way out: grandchildren (compilers) too
                try:
                    proc.wait(timeout=10)  # a child stuck in the driver may not die at once
                except subprocess.TimeoutExpired:
                    pass
                proc.stdout.close()
            wall = time.perf_counter() - t0
            err.seek(max(0, err.seek(0, os.SEEK_END) - (1 << 20)))   # its last MiB: the tail is shown
            stderr = err.read().decode("utf-8", "replace")
        if cancel is not None and cancel.is_set():
            return Verdict(outcome="timeout", detail="interrupted before it finished (killed)",
                           seconds={"wall": wall}, fault="interrupted", **base)
        if timed_out:
            if ready:
                what = f"no result {timeout:g} s after start-up"
                fault = f"the time budget left {timeout:g} s" if budget_cut else ""
            else:
                what = f"not started (python and torch) within {startup_timeout:g} s"
                fault = "the child did not start within the start-up limit"
            return Verdict(outcome="timeout", detail=f"{what} (killed)\n{_tail(stderr, 4)}".strip(),
                           seconds={"startup": started - t0, "wall": wall}, fault=fault, **base)
        body = _read_result(result)
        if body is None:
            why = f"killed by {_signal_name(code)}" if code < 0 else f"exited with status {code} without a result"
            fault = ""
            if code < 0 and _signal_name(code) in EXTERNAL_SIGNALS:
                fault = f"killed from outside ({_signal_name(code)})"
            elif not ready:
                fault = "the child failed before it reached the kernel (python, torch or capdispatch)"
            return Verdict(outcome="crash", detail=f"{why}\n{_tail(stderr)}".strip(),
                           seconds={"wall": wall}, fault=fault, **base)
    seconds = {}
    for k, v in (body.get("seconds") or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            seconds[str(k)] = float(v)
    seconds["wall"] = wall
    seconds["startup"] = started - t0
    try:
        return Verdict(outcome=body["outcome"], detail=str(body.get("detail", "")),
                       max_err=None if body.get("max_err") is None else float(body["max_err"]),
                       where=str(body.get("where", "")), tolerance=str(body.get("tolerance", "")),
                       seconds=seconds, **base)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:   # 10**400 overflows float
        return Verdict(outcome="crash", detail=f"the child's result is malformed ({exc})",
                       seconds=seconds, fault="malformed result", **base)


def _read_result(path: str):
    """The child's result (a dict), or None when it left none that reads."""
    from ..safe_io import FileError, read_bytes
    if not os.path.exists(path):
        return None
    try:
        body = json.loads(read_bytes(path, limit=MAX_RESULT_BYTES, what="canary result"))
    except (FileError, ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _wait_exit(proc, limit: float, cancel) -> tuple:
    """(exit code, timed out): wait up to LIMIT seconds, or until CANCEL is set."""
    deadline = time.monotonic() + max(0.0, limit)
    while True:
        left = deadline - time.monotonic()
        step = min(POLL_S, left) if cancel is not None else left
        try:
            return proc.wait(timeout=max(0.0, step)), False
        except subprocess.TimeoutExpired:
            pass
        if cancel is not None and cancel.is_set():
            return None, True
        if time.monotonic() >= deadline:
            return None, True


def _wait_ready(proc, limit: float, cancel=None) -> bool:
    """True once the child prints READY; False when it exits, LIMIT passes or CANCEL is set."""
    from .child import READY
    deadline = time.monotonic() + limit
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (cancel is not None and cancel.is_set()):
                return False
            if not sel.select(timeout=min(left, POLL_S)):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return False
            buf = (buf + chunk)[-4096:]
            if READY.encode() in buf:
                return True


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except (ProcessLookupError, OSError):
            pass
