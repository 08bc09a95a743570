"""Errors of a rehearsal: bad input (exit 2) and a group that failed (exit 3)."""
from __future__ import annotations

from ..errors import BadInput, Unsatisfiable


class RehearseError(BadInput):
    """A device, layout or size the rehearsal cannot take."""


class RehearseFailed(Unsatisfiable):
    """A rank failed, hung or disagreed with the reference."""
