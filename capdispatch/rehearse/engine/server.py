"""SGLang's server as a child process group: started through child.py (which kills the group
once this process is gone), watched while it starts, asked over HTTP, and stopped with
SIGTERM to the group, then SIGKILL after a bound."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

from .launch import HOST

STOP_GRACE_S = 20.0       # SIGTERM to the group, then SIGKILL
POLL_S = 0.5
TAIL_LINES = 30


class EngineFailed(Exception):
    """A step of the run failed: STEP names it (start, request 2, ...), RANK the TP rank
    when the server's log names one."""

    def __init__(self, step: str, message: str, rank: Optional[int] = None, log_tail: str = ""):
        super().__init__(message)
        self.step, self.rank, self.log_tail = step, rank, log_tail


def start(server: tuple, argv: list, env: dict, log_path: str) -> subprocess.Popen:
    """Start SERVER (("-m", MODULE) or (SCRIPT,)) with ARGV in its own process group, its
    output in LOG_PATH."""
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "capdispatch.rehearse.engine.child", str(os.getpid()),
                                 *server, *argv], env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def tail(log_path: str, lines: int = TAIL_LINES) -> str:
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_RANK = re.compile(r"\bTP(\d+)\b|capdispatch: rank (\d+) \(")    # SGLang's tag, or the plugin's refusal


_ERROR = re.compile(r"Error|Exception|Traceback|exception|capdispatch\.errors\.")   # the plugin's Unsatisfiable too


def rank_in(text: str) -> Optional[int]:
    """The TP rank SGLang's log names in its last error line (`[... TP1] ... Error`, or the
    plugin's refusal in the launcher: `...Unsatisfiable: capdispatch: rank 0 (...)`), if any."""
    found = None
    for line in text.splitlines():
        m = _RANK.search(line)
        if m and _ERROR.search(line):
            found = int(m.group(1) or m.group(2))
    return found


def last_error(text: str) -> str:
    """The log's last line that names an error (else its last line), cut to 600 characters
    (the plugin's one-line refusals run to about 450)."""
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    errs = [x for x in lines if _ERROR.search(x) and not x.startswith("Traceback")]
    pick = (errs or lines or ["(the log is empty)"])[-1]
    return pick if len(pick) <= 600 else pick[:597] + "..."


def _opener():
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never a proxy for 127.0.0.1


def get(port: int, path: str, timeout: float):
    with _opener().open(f"http://{HOST}:{port}{path}", timeout=timeout) as r:
        body = r.read()
        return r.status, body


def why(exc) -> object:
    """What a failed HTTP call says: urllib's reason where it gives one, else the error."""
    return getattr(exc, "reason", None) or exc


def get_json(port: int, path: str, timeout: float) -> dict:
    status, body = get(port, path, timeout)
    return json.loads(body)


def post_json(port: int, path: str, obj: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=json.dumps(obj).encode(),
                                 headers={"Content-Type": "application/json"})
    with _opener().open(req, timeout=timeout) as r:
        return json.loads(r.read())


def died(proc, log_path: str, step: str) -> EngineFailed:
    text = tail(log_path)
    rank = rank_in(text)
    who = f"rank {rank} of SGLang" if rank is not None else "SGLang"
    return EngineFailed(step, f"{who} exited (code {proc.poll()}) during {step}: {last_error(text)}", rank, text)


def wait_ready(proc, port: int, log_path: str, timeout: float) -> float:
    """Seconds until /health answers 200; a server that exits first is named at once, one that
    is not ready within TIMEOUT is a failure (and is stopped by the caller)."""
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise died(proc, log_path, "start")
        try:
            status, _ = get(port, "/health", timeout=min(5.0, timeout))
            if status == 200:
                return time.monotonic() - t0
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() - t0 > timeout:
            text = tail(log_path)
            raise EngineFailed("start", f"SGLang was not ready within --start-timeout {timeout:g} s "
                                        f"(/health never answered 200); its log's last line: {last_error(text)}",
                               rank_in(text), text)
        time.sleep(POLL_S)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop(proc, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to PROC's group; SIGKILL to whatever of it is left after GRACE seconds."""
    pgid = proc.pid
    if proc.poll() is None or _group_alive(pgid):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()                          # reap the leader so the group can empty
        if proc.returncode is not None and not _group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
