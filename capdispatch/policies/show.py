"""The merged policy as one policy document: valid YAML that loads back to the
same effective policy, with where each value came from in comments."""
from __future__ import annotations

import json

from .loader import SETTINGS
from .stack import PolicyStack


def _q(value: str) -> str:
    """A match value as a YAML scalar that reads back as the same text."""
    return json.dumps(value, ensure_ascii=False)


def _comment(origin: str) -> str:
    return "    # " + " ".join(str(origin).split())


def _op_obj(registry, op, pf, m) -> dict:
    key = registry.ops[op].size.key if registry.ops[op].size else None
    return {"backends": list(m.value), "from": f"{pf.path}:{m.line}",
            "buckets": [{key: f"<={b.upper}" if b.upper is not None else "any", "upper": b.upper,
                         "backends": list(b.backends), "from": f"{pf.path}:{b.line}"}
                        for b in m.buckets]}


def _op_lines(registry, op, pf, m, indent) -> list:
    if not m.buckets:
        return [f"{indent}{op}: [{', '.join(m.value)}]{_comment(f'{pf.path}:{m.line}')}"]
    key = registry.ops[op].size.key
    out = [f"{indent}{op}:"]
    for b in m.buckets:
        bound = f"{key}: \"<={b.upper}\", " if b.upper is not None else ""
        out.append(f"{indent}  - {{{bound}prefer: [{', '.join(b.backends)}]}}"
                   f"{_comment(f'{pf.path}:{b.line}')}")
    return out


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
    for key in SETTINGS:
        s = stack.setting(key)
        obj["settings"][key] = {"value": s.value, "from": s.origin}
        lines.append(f"{key}: {s.value}{_comment(s.origin)}")
    user_ops = {op for pf in stack.files for op in pf.ops}
    lines.append("ops:")
    for op in registry.ops:
        for pf in reversed(stack.layers):
            if op in pf.ops:
                m = pf.ops[op]
                obj["ops"][op] = _op_obj(registry, op, pf, m)
                lines += _op_lines(registry, op, pf, m, "  ")
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
                               "ops": {op: list(m.value) for op, m in ops.items()},
                               "buckets": {op: _op_obj(registry, op, pf, m)["buckets"]
                                           for op, m in ops.items() if m.buckets}})
        match = ", ".join(f"{k}: {_q(v)}" for k, v in e.match.items())
        lines.append(f"  - match: {{{match}}}{_comment(f'{pf.path}:{e.line}')}")
        lines.append("    ops:")
        for op, m in ops.items():
            lines += _op_lines(registry, op, pf, m, "      ")
    if stack.selections:
        lines.append("# selections (they beat every line above):")
    for s in stack.selections:
        obj["selections"].append({"op": s.op, "backend": s.backend, "from": s.origin})
        lines.append(f"#   {s.op}={s.backend}{_comment(s.origin)}")
    return obj, "\n".join(lines)
