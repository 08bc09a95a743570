"""Which ops a mixed rig's cards run differently, for tests that word the summary line
("mixed group: K of N ops ...") without a hand count of the registry's ops: the ops a test
names diverge or not as it asserts (what it checks), every other op as the plan decides it."""
from __future__ import annotations

import capdispatch as cd


def divergent(devices: str, known: dict, **plan_kw) -> tuple:
    """(the ops whose backends differ across DEVICES' cards, in the plan's order; the ops
    planned). KNOWN: op -> whether it diverges there, as the test asserts (checked
    against the plan too); every other op of the registry as the plan decides it."""
    p = cd.plan(devices.split(","), log_warnings=False, libs="default", **plan_kw)
    assert set(known) <= set(p.ops), sorted(set(known) - set(p.ops))
    assert {op: bool(p.ops[op].divergence) for op in known} == known
    return [op for op, g in p.ops.items() if g.divergence], list(p.ops)
