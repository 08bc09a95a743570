"""Child processes that never outlive the command that started them.

A parent killed outright (SIGKILL) cannot kill its children: each child watches its
parent and ends its own process group once the parent is gone. A parent stopped by
SIGTERM or SIGHUP gets a KeyboardInterrupt instead, so its `finally` kills its children
and removes its folders on the way out, as Ctrl-C does.
"""
from __future__ import annotations

import os
import signal
import threading
import time


def watch_parent(parent: int, interval: float = 0.25) -> None:
    """Kill this process's group (itself and whatever it started) once PARENT is gone."""
    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
        try:
            os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(1)
    threading.Thread(target=watch, name="capdispatch-parent-watch", daemon=True).start()


def kill_group(proc) -> None:
    """SIGKILL PROC's process group (started with start_new_session) and reap PROC."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


class terminate_as_interrupt:
    """While inside: SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread (a no-op
    off the main thread, where signal handlers cannot be set)."""

    SIGNALS = ("SIGTERM", "SIGHUP")

    def __enter__(self):
        self.old = {}
        if threading.current_thread() is not threading.main_thread():
            return self

        def interrupt(signum, frame):
            raise KeyboardInterrupt(signal.Signals(signum).name)
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self.old[sig] = signal.signal(sig, interrupt)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False
