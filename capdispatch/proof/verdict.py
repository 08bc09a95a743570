"""A canary's verdict: one backend of one op on one card, passed or failed and how."""
from __future__ import annotations

from typing import Optional

import attrs

# Failure classes, in the order a run can reach them.
OUTCOMES = ("pass", "compile", "runtime", "mismatch", "timeout", "crash")


@attrs.frozen
class Verdict:
    op: str
    backend: str
    device: str
    outcome: str = attrs.field(validator=attrs.validators.in_(OUTCOMES))
    detail: str = ""                 # the failure's first lines (empty on pass)
    max_err: Optional[float] = None  # mismatch: the largest error, in the canary's own unit
    where: str = ""                  # mismatch: which output and element
    tolerance: str = ""              # what the canary compared against
    seed: Optional[int] = None       # the random inputs' seed, to replay
    seconds: dict = attrs.field(factory=dict)   # phase -> seconds ("load", "run", "wall")
    at: str = ""                     # when it ran (UTC, ISO 8601)

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    def describe(self) -> str:
        """One line: 'pass', or the class with what went wrong."""
        if self.passed:
            return "pass"
        if self.outcome == "mismatch" and self.max_err is not None:
            tol = f" (tolerance: {self.tolerance})" if self.tolerance else ""
            return f"mismatch: max error {self.max_err:.3g} at {self.where or '?'}{tol}"
        lines = [ln.strip() for ln in self.detail.splitlines() if ln.strip()]
        # A compiler's own message ends its report; other failures lead with theirs.
        line = (lines[-1] if self.outcome == "compile" else lines[0]) if lines else ""
        return f"{self.outcome}: {line[:200]}" if line else self.outcome

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        names = {f.name for f in attrs.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown verdict fields {sorted(unknown)}")
        d = dict(d)
        if d.get("max_err") is not None:
            d["max_err"] = float(d["max_err"])
        return cls(**d)
