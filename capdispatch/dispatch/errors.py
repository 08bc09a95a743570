"""Errors of a decision. BadInput -> exit 2; Unsatisfiable -> exit 3."""
from __future__ import annotations

import os
import sys

from ..safe_io import message_text
from ..errors import BadInput, CapdispatchError, ExitCode, Unsatisfiable  # noqa: F401 (the two kinds live below every room)
from .inputs import env_flag, warn_unknown_variables


class NoBackendError(Unsatisfiable):
    def __init__(self, op: str, device_id: str, candidates):
        self.op, self.device_id, self.candidates = op, device_id, candidates
        lines = [f"no backend of {op} can run on {device_id}:"]
        for c in candidates:
            lines.append(f"  {c.backend}: {c.why_not()}")
        if any(ch.code.startswith("library:") and not ch.ok for c in candidates for ch in c.checks):
            lines.append("  a library is missing: plan for the target's software with --libs PROFILE "
                         "(e.g. sglang-0.5.23; `local`: this machine's) or --assume-lib NAME[==VERSION] "
                         "(libs= / assume_libs= in the Python API)")
        super().__init__("\n".join(lines))


class StrictFallbackError(Unsatisfiable):
    pass


class GroupDivergenceError(Unsatisfiable):
    pass


def exit_code(exc: BaseException) -> int:
    """The command line's exit code for an error: 3 unsatisfiable, 2 any other of ours."""
    if isinstance(exc, Unsatisfiable):
        return ExitCode.UNSATISFIABLE
    if isinstance(exc, CapdispatchError):
        return ExitCode.BAD_INPUT
    return ExitCode.INTERNAL


def _say(text: str) -> None:
    """One line to stderr, whatever the terminal can encode (lone surrogates from
    argv or file names included), control characters escaped and a huge value cut."""
    text = message_text(text)
    enc = getattr(sys.stderr, "encoding", None) or "utf-8"
    try:
        text = text.encode(enc, "backslashreplace").decode(enc)
    except LookupError:
        text = text.encode("ascii", "backslashreplace").decode("ascii")
    print(text, file=sys.stderr)


def run_guarded(prog: str, fn) -> int:
    """Run a command body; turn our errors into one line and an exit code.

    An exception that is not ours is a bug: one line saying so and how to
    report it (the traceback with CAPDISPATCH_DEBUG=1), exit 1.
    """
    try:
        debug = env_flag(os.environ, "CAPDISPATCH_DEBUG")
    except CapdispatchError as exc:
        _say(f"{prog}: error: {exc}")
        return exit_code(exc)
    warn_unknown_variables(os.environ)
    try:
        return fn()
    except CapdispatchError as exc:
        kind = "unsatisfiable" if isinstance(exc, Unsatisfiable) else "error"
        _say(f"{prog}: {kind}: {exc}")
        return exit_code(exc)
    except KeyboardInterrupt:
        _say(f"{prog}: interrupted")
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`dispatch explain | head`): nothing more to say.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return ExitCode.OK
    except Exception as exc:
        if debug:
            raise
        _say(f"{prog}: internal error: {type(exc).__name__}: {exc}\n"
             f"  this is a bug in capdispatch; please report it with the command line and the "
             f"output of `dispatch env` (CAPDISPATCH_DEBUG=1 shows the traceback)")
        return ExitCode.INTERNAL
