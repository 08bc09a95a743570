"""Errors of a decision. BadInput -> exit 2; Unsatisfiable -> exit 3."""
from __future__ import annotations


class BadInput(ValueError):
    """Unknown op, device or backend; a bad flag value."""


class Unsatisfiable(RuntimeError):
    """Nothing can run, or a strict choice cannot run, or a group may not diverge."""


class NoBackendError(Unsatisfiable):
    def __init__(self, op: str, device_id: str, candidates):
        self.op, self.device_id, self.candidates = op, device_id, candidates
        lines = [f"no backend of {op} can run on {device_id}:"]
        for c in candidates:
            reasons = "; ".join(ch.message or f"{ch.code}: need {ch.need}, found {ch.found}"
                                for ch in c.checks if not ch.ok)
            lines.append(f"  {c.backend}: {reasons}")
        super().__init__("\n".join(lines))


class StrictFallbackError(Unsatisfiable):
    pass


class GroupDivergenceError(Unsatisfiable):
    pass
