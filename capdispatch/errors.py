"""The root of every error capdispatch raises on purpose.

A leaf module: it imports nothing of ours, so every room (capabilities,
policies, backends, dispatch, adapters) may import it. Each subclass keeps the
builtin base its callers already catch (ValueError for bad input,
RuntimeError for a decision that cannot be made), so `except CapdispatchError`
and `except ValueError` both keep working.

The command line maps them to exit codes (ExitCode, the one table of every
command's exit status): `Unsatisfiable` and its subclasses -> 3; every other
`CapdispatchError` -> 2 (see docs/cli.md#exit-codes).
"""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Every command's exit status: the one table (docs/cli.md#exit-codes). A command
    returns one of these; no module defines an exit code of its own."""
    OK = 0              # done: decided, fits, matched, passed
    INTERNAL = 1        # a bug in capdispatch: one line asking for a report
    BAD_INPUT = 2       # a usage error or a CapdispatchError other than Unsatisfiable
    UNSATISFIABLE = 3   # an Unsatisfiable; a layout that cannot serve; a lock that drifted;
    #                     a backend that failed verification; a rehearsal that failed
    CHECK_FAILED = 4    # `bench`: a measured backend failed its check, no backend passed at a
    #                     size, or a checked policy's regret is above the threshold
    INTERRUPTED = 130   # Ctrl-C: 128 + SIGINT, as shells report it


class CapdispatchError(Exception):
    """Raised on purpose by capdispatch: the message says what was needed and what was found."""


# The two kinds the command line tells apart; every room's errors derive from one of them
# (or from the root), so they live here, below every room.
class BadInput(CapdispatchError, ValueError):
    """Unknown op, device or backend; a bad flag value."""


class Unsatisfiable(CapdispatchError, RuntimeError):
    """Nothing can run, or a strict choice cannot run, or a group may not diverge."""


class ArgumentError(CapdispatchError, ValueError):
    """A kernel called with arguments that break its op's contract (a shape, a size, a layout)."""


class ArgumentTypeError(CapdispatchError, TypeError):
    """A kernel called with an argument of the wrong type or dtype."""


class UnsupportedDeviceError(CapdispatchError, RuntimeError):
    """A kernel called directly on a device it cannot run on (the resolver never
    chooses it there; `bind` with an explicit backend refuses it first)."""
