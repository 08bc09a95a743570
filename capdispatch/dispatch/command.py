"""How every command runs, `dispatch ...` and adapters' commands alike: its output
streams, its parse, capdispatch's log lines on stderr, and the one error handler
(errors.run_guarded: a CapdispatchError is one line and exit 2 or 3, never a traceback)."""
from __future__ import annotations

import logging
import sys


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is when a record is emitted, not as it was when the
    handler was made (a command may run many times in one process, stderr replaced between)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging():
    log = logging.getLogger("capdispatch")
    if not any(getattr(h, "_capdispatch", False) for h in log.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(levelname)s capdispatch: %(message)s"))
        h._capdispatch = True
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.INFO)


def safe_streams():
    # A character the output's encoding lacks (PYTHONIOENCODING=ascii) is escaped, not a crash.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):
            pass


def run(prog: str, parser, argv, body) -> int:
    """Parse ARGV with PARSER and run BODY(args) -> exit code under the one error handler.
    PROG names the command in its error lines ('dispatch', 'dispatch sglang'). --help and
    usage errors return their exit code (0, 2) instead of raising SystemExit."""
    from .errors import ExitCode, run_guarded
    safe_streams()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:    # --help, or a usage error already printed: return its code
        return exc.code if isinstance(exc.code, int) else ExitCode.BAD_INPUT
    setup_logging()
    return run_guarded(prog, lambda: body(args))
