"""The root of every error capdispatch raises on purpose.

A leaf module: it imports nothing of ours, so every room (capabilities,
policies, backends, dispatch, adapters) may import it. Each subclass keeps the
builtin base its callers already catch (ValueError for bad input,
RuntimeError for a decision that cannot be made), so `except CapdispatchError`
and `except ValueError` both keep working.

The command line maps them to exit codes: `Unsatisfiable` and its subclasses
-> 3; every other `CapdispatchError` -> 2 (see docs/architecture.md).
"""
from __future__ import annotations


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
