"""Helpers of the fault-injection tests (tests/test_faults_*.py)."""
from __future__ import annotations

import threading
import time


def bounded(fn, seconds: float = 10.0):
    """FN's result, or a failure when it takes longer than SECONDS (a hang)."""
    out = {}

    def go():
        try:
            out["value"] = fn()
        except BaseException as exc:     # noqa: BLE001 - reported below
            out["error"] = exc
    t = threading.Thread(target=go, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (a hang)"
    out["seconds"] = time.monotonic() - t0
    return out
