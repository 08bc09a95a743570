"""The merged policy as one policy document: valid YAML that loads back to the
same effective policy, with where each value came from in comments."""
from __future__ import annotations

import json

from .stack import PolicyStack


def _q(value: str) -> str:
    """A match value as a YAML scalar that reads back as the same text."""
    return json.dumps(value, ensure_ascii=False)


def _comment(origin: str) -> str:
    return "    # " + " ".join(str(origin).split())


def merged(stack: PolicyStack, registry) -> tuple:
    """(JSON-able dict, YAML text) of the policy STACK's layers flattened into one file.

    The flattening keeps the stack's precedence: device entries of user files beat
    every `ops:` list, and the built-in default's device entries beat only the
    default's own lists, so a default entry is kept for the ops no user file sets.
    Selections (--set, CAPDISPATCH_SET) are not policy: they are listed as comments.
    """
    obj = {"schema": 1, "settings": {}, "ops": {}, "devices": [], "selections": []}
    lines = ["# The merged policy; loading this file gives the same decisions (comments say",
             "# where each value came from). Selections, if any, are listed at the end.",
             "schema: 1"]
    for key in ("mixed_group", "on_unsupported"):
        s = stack.setting(key)
        obj["settings"][key] = {"value": s.value, "from": s.origin}
        lines.append(f"{key}: {s.value}{_comment(s.origin)}")
    user_ops = {op for pf in stack.files for op in pf.ops}
    lines.append("ops:")
    for op in registry.ops:
        for pf in reversed(stack.layers):
            if op in pf.ops:
                m = pf.ops[op]
                obj["ops"][op] = {"backends": list(m.value), "from": f"{pf.path}:{m.line}"}
                lines.append(f"  {op}: [{', '.join(m.value)}]{_comment(f'{pf.path}:{m.line}')}")
                break
    entries = []
    for pf in stack.layers:
        for e in pf.devices:
            ops = {op: m for op, m in e.ops.items() if not (pf.builtin and op in user_ops)}
            if ops:
                entries.append((pf, e, ops))
    if entries:
        lines.append("devices:    # later entries win")
    for pf, e, ops in entries:
        obj["devices"].append({"match": dict(e.match), "from": f"{pf.path}:{e.line}",
                               "ops": {op: list(m.value) for op, m in ops.items()}})
        match = ", ".join(f"{k}: {_q(v)}" for k, v in e.match.items())
        lines.append(f"  - match: {{{match}}}{_comment(f'{pf.path}:{e.line}')}")
        lines.append("    ops:")
        for op, m in ops.items():
            lines.append(f"      {op}: [{', '.join(m.value)}]{_comment(f'{pf.path}:{m.line}')}")
    if stack.selections:
        lines.append("# selections (they beat every line above):")
    for s in stack.selections:
        obj["selections"].append({"op": s.op, "backend": s.backend, "from": s.origin})
        lines.append(f"#   {s.op}={s.backend}{_comment(s.origin)}")
    return obj, "\n".join(lines)
