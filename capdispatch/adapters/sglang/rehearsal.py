"""The rehearsal's verdict in a launch: each rank's report records the `dispatch rehearse`
verdict recorded for the group's cards, software and decisions (capdispatch's rehearsal
cache), and CAPDISPATCH_REQUIRE_REHEARSAL=1 makes a missing or failed one refuse the
launch, on every rank, before the model loads.

The setting is read from the rank's environment when the group has agreed (as
CAPDISPATCH_STRICT and CAPDISPATCH_LOCK are read when the rank decides), never at import.
"""
from __future__ import annotations

import os

ENV_REQUIRE = "CAPDISPATCH_REQUIRE_REHEARSAL"


def command(plan, model) -> str:
    """The command that rehearses PLAN's group for MODEL."""
    # The agreement names each rank's device "rankN:ID".
    devices = ",".join(d.id.split(":", 1)[1] if d.id.startswith("rank") else d.id for d in plan.devices)
    return f"dispatch rehearse --device {devices} --model {model or 'MODEL'} --tp {len(plan.devices)}"


def check(plan, ops, model, env=None) -> tuple:
    """(the report's entry for PLAN's group and decisions on OPS, the cd.RehearsalRequiredError
    that refuses the launch where ENV_REQUIRE is on and the verdict is missing or failed, else None)."""
    import capdispatch as cd
    from capdispatch import extend
    env = os.environ if env is None else env
    required = extend.env_flag(env, ENV_REQUIRE)         # a bad value is bad input, named
    v = cd.rehearsal_verdict(plan, ops, env=env)
    entry = {"required": required, "found": v is not None,
             "verdict": None if v is None else v.to_dict()}
    if not required or (v is not None and v.ok):
        return entry, None
    if any(d.simulated for d in plan.devices):
        why = "the group's cards are simulated: a rehearsal is recorded for real cards only"
    elif v is None:
        why = "no rehearsal is recorded for these cards, this software and these decisions"
    else:
        why = f"the rehearsal recorded for them at {v.at} FAILED: {v.cause or 'see its report'}"
    entry["refused"] = why
    return entry, cd.RehearsalRequiredError(f"{ENV_REQUIRE}=1: {why}; run `{command(plan, model)}` (with the "
                                            f"launch's --ep and --dp-attention, if any) on this machine: it "
                                            f"records its verdict; or unset {ENV_REQUIRE}")
