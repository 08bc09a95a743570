"""A canary's verdict: one backend of one op on one card, passed or failed and how."""
from __future__ import annotations

import math
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
    # Why the outcome is not the kernel's (the time budget ran out, the child was killed
    # from outside or never started, the run was interrupted); "" when it is. A verdict
    # with a fault is reported, never cached.
    fault: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    def describe(self) -> str:
        """One line: 'pass', or the class with what went wrong."""
        from ..safe_io import printable      # a kernel's message may hold escape sequences
        if self.passed:
            return "pass"
        if self.outcome == "mismatch" and self.max_err is not None:
            tol = f" (tolerance: {self.tolerance})" if self.tolerance else ""
            return printable(f"mismatch: max error {self.max_err:.3g} at {self.where or '?'}{tol}")
        lines = [printable(ln.strip()) for ln in self.detail.splitlines() if ln.strip()]
        # A compiler's own message ends its report; other failures lead with theirs.
        line = (lines[-1] if self.outcome == "compile" else lines[0]) if lines else ""
        text = f"{self.outcome}: {line[:200]}" if line else self.outcome
        return f"{text} (not the kernel's: {printable(self.fault)})" if self.fault else text

    def to_dict(self) -> dict:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Verdict":
        names = {f.name for f in attrs.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown verdict fields {sorted(unknown)}")
        d = dict(d)
        for name in ("op", "backend", "device", "outcome"):
            if not isinstance(d.get(name), str):
                raise ValueError(f"{name} must be a string, found {type(d.get(name)).__name__}")
        for name in ("detail", "where", "tolerance", "at", "fault"):
            if not isinstance(d.get(name, ""), str):
                raise ValueError(f"{name} must be a string, found {type(d[name]).__name__}")
        if d.get("max_err") is not None:
            if isinstance(d["max_err"], bool) or not isinstance(d["max_err"], (int, float)):
                raise ValueError(f"max_err must be a number, found {type(d['max_err']).__name__}")
            # An integer past float's range (10**400), NaN or -Infinity was never a canary's
            # error (its checks write a float, +Infinity for non-finite output): the verdict
            # is malformed, not a crash.
            try:
                d["max_err"] = float(d["max_err"])
            except OverflowError:
                raise ValueError("max_err is too large for a float (valid: a float, or Infinity)") from None
            if math.isnan(d["max_err"]) or d["max_err"] == -math.inf:
                raise ValueError(f"max_err must be a float or Infinity, found {d['max_err']!r}")
        seed = d.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an integer, found {type(seed).__name__}")
        secs = d.get("seconds", {})
        if not isinstance(secs, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                and _finite(v) for k, v in secs.items()):
            raise ValueError("seconds must map phases to finite numbers")
        return cls(**d)


def _finite(v) -> bool:
    """V (an int or a float) is a finite float: 10**400 is not, nor NaN or Infinity."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False
