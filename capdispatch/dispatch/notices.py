"""Warnings for people: device ids as ranges, per-device warnings that differ only in
the device said once, and a group's mixed-group divergences as one summary line."""
from __future__ import annotations

import logging
import re

log = logging.getLogger("capdispatch")

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def ids_text(ids) -> str:
    """['cuda:0', ..., 'cuda:63', 'sim:h200'] -> 'cuda:0-63, sim:h200': ids that differ
    only in a trailing number, as ranges of it, in first-seen order."""
    runs = {}                     # prefix -> numbers; an id without a number is its own prefix
    for d in ids:
        m = _NUMBERED.match(d)
        if m and str(int(m.group(2))) == m.group(2):      # 'gpu07' keeps its zero: no range
            runs.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            runs.setdefault(d, []).append(None)
    parts = []
    for prefix, numbers in runs.items():
        nums = sorted({n for n in numbers if n is not None})
        if None in numbers:
            parts.append(prefix)
        start = None
        for i, n in enumerate(nums):
            start = n if start is None else start
            if i + 1 == len(nums) or nums[i + 1] != n + 1:
                parts.append(f"{prefix}{start}" + (f"-{n}" if n != start else ""))
                start = None
    return ", ".join(parts)


def collapse(warnings, device_ids) -> list:
    """WARNINGS with those that differ only in the device they name (one per card of a
    128-card group) said once, the devices as ranges (ids_text). Order kept: a merged
    warning stands where its first copy stood."""
    ids = sorted(set(device_ids), key=len, reverse=True)     # cuda:12 before cuda:1
    pattern = re.compile("|".join(re.escape(d) + r"(?![\w@.-])" for d in ids)) if ids else None
    groups = {}
    for w in warnings:
        named = list(dict.fromkeys(pattern.findall(w))) if pattern else []
        key = pattern.sub("\0", w) if len(named) == 1 else w
        groups.setdefault(key, []).append(named[0] if len(named) == 1 else w)
    out = []
    for key, who in groups.items():
        if "\0" not in key:          # names no device, or several: as it was, each copy
            out += [key] * len(who)
        else:
            out.append(key.replace("\0", ids_text(who)))
    return out


def summary(plan, hint: str = "-v shows each", total=None) -> str:
    """One line for every mixed-group divergence of PLAN ("" when none), of TOTAL ops
    (default: the plan's; a caller that shows more ops than it decided says how many)."""
    ops = [op for op, g in plan.ops.items() if g.divergence]
    if not ops:
        return ""
    origin = plan.ops[ops[0]].origin
    total = len(plan.ops) if total is None else total
    return (f"mixed group: {len(ops)} of {total} ops run different backends on different "
            f"cards ({', '.join(ops)}; mixed_group: warn, {origin}); {hint}")


def shown(plan, *, brief: bool = False, hint: str = "-v shows each") -> list:
    """PLAN's warnings as people read them: collapsed across devices; under BRIEF the
    mixed-group divergences as one summary line after the rest."""
    divergent = {g.divergence for g in plan.ops.values() if g.divergence}
    ws = [w for w in plan.warnings if not (brief and w in divergent)]
    out = collapse(ws, [d.id for d in plan.devices])
    line = summary(plan, hint) if brief else ""
    return out + ([line] if line else [])


def log_plan(plan, *, brief: bool = False, hint: str = "-v shows each") -> None:
    for w in shown(plan, brief=brief, hint=hint):
        log.warning(w)
