"""Run a canary in a child process with a timeout and turn what happened into a Verdict.

Each canary runs in a fresh interpreter (`python -m capdispatch.proof.child`) in its
own session, so a compile error, an illegal memory access that poisons the CUDA
context, a hang or an abort ends that child only: a timeout kills its whole process
group, a death by signal is recorded as a crash with the last lines it printed.
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
import time
from pathlib import Path
from typing import Optional

from .verdict import Verdict

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STARTUP_TIMEOUT_S = 120.0


def _package_root() -> str:
    import capdispatch
    return str(Path(capdispatch.__file__).resolve().parent.parent)


def child_env(env=None) -> dict:
    """The child's environment: the caller's, with this capdispatch first on the path."""
    env = dict(os.environ if env is None else env)
    parts = [_package_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


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
               startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S) -> Verdict:
    """Verify BACKEND of OP on DEVICE ("cpu", "cuda:N") in a child process. TIMEOUT
    counts from the child's start-up (python and torch imported): loading the kernel,
    compiling it and running the canary; STARTUP_TIMEOUT bounds the start-up itself."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else int(seed)
    at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="capdispatch-canary-") as tmp:
        result = os.path.join(tmp, "result.json")
        err_path = os.path.join(tmp, "stderr.txt")
        cmd = [sys.executable, "-m", "capdispatch.proof.child", op, backend, device, str(seed), result]
        t0 = time.perf_counter()
        with open(err_path, "w+b") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                    env=child_env(env), start_new_session=True)
            ready = _wait_ready(proc, startup_timeout)
            started = time.perf_counter()
            limit = timeout if ready else startup_timeout
            try:
                code = proc.wait(timeout=max(0.0, limit - (0 if ready else started - t0)))
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                code = proc.wait()
            proc.stdout.close()
            wall = time.perf_counter() - t0
            err.seek(0)
            stderr = err.read().decode("utf-8", "replace")
        base = dict(op=op, backend=backend, device=device, seed=seed, at=at)
        if timed_out:
            what = f"no result {timeout:g} s after start-up" if ready else \
                f"not started (python and torch) within {startup_timeout:g} s"
            return Verdict(outcome="timeout", detail=f"{what} (killed)\n{_tail(stderr, 4)}".strip(),
                           seconds={"startup": started - t0, "wall": wall}, **base)
        body = None
        if os.path.exists(result):
            try:
                with open(result, encoding="utf-8") as fh:
                    body = json.load(fh)
            except (OSError, ValueError):
                body = None
        if body is None:
            why = f"killed by {_signal_name(code)}" if code < 0 else f"exited with status {code} without a result"
            return Verdict(outcome="crash", detail=f"{why}\n{_tail(stderr)}".strip(),
                           seconds={"wall": wall}, **base)
    seconds = {k: float(v) for k, v in (body.get("seconds") or {}).items()}
    seconds["wall"] = wall
    seconds["startup"] = started - t0
    return Verdict(outcome=body["outcome"], detail=body.get("detail", ""),
                   max_err=body.get("max_err"), where=body.get("where", ""),
                   tolerance=body.get("tolerance", ""), seconds=seconds, **base)


def _wait_ready(proc, limit: float) -> bool:
    """True once the child prints READY; False when it exits or LIMIT passes first."""
    from .child import READY
    deadline = time.monotonic() + limit
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                return False
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return False
            buf += chunk
            if READY.encode() in buf:
                return True


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
