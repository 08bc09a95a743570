"""Layering: default < files in order < device-scoped entries < explicit selections."""
from __future__ import annotations

import os
from typing import Optional

import attrs

from .loader import PolicyError, PolicyFile, _did_you_mean, load_default, load_file


@attrs.frozen
class Selection:
    op: str
    backend: str
    origin: str          # "--set", "CAPDISPATCH_SET", "selections=", "sglang --attention-backend", ...


@attrs.frozen
class BucketPreference:
    """One size bucket of the speaking layer: sizes up to UPPER (None: the catch-all)."""
    upper: Optional[int]
    backends: tuple
    origin: str


@attrs.frozen
class Preference:
    """The preference list of the layer that speaks for an op on a device."""
    backends: tuple
    origin: str          # file:line and scope, for the trace
    kind: str            # "default" | "policy" | "device" | "selection"
    user: bool           # a fallback away from it is logged (or refused under strict)
    buckets: tuple = ()  # BucketPreference..., ascending, the last the catch-all (BACKENDS)


def _buckets(pf, m, scope: str = "") -> tuple:
    return tuple(BucketPreference(b.upper, b.backends, f"{_at(pf, b)}{scope}")
                 for b in getattr(m, "buckets", ()))


@attrs.frozen
class Setting:
    value: str
    origin: str


@attrs.frozen
class PolicyStack:
    default: PolicyFile
    files: tuple = ()
    selections: tuple = ()

    @property
    def layers(self) -> tuple:
        return (self.default,) + tuple(self.files)

    def setting(self, key: str) -> Setting:
        for pf in reversed(self.layers):
            marked = getattr(pf, key)
            if marked is not None:
                return Setting(marked.value, _at(pf, marked))
        raise KeyError(key)

    def preference(self, op: str, device) -> Optional[Preference]:
        for sel in reversed(self.selections):
            if sel.op == op:
                return Preference((sel.backend,), sel.origin, "selection", True)
        # The built-in default, device entries included, sits below every user file.
        for files in (tuple(self.files), (self.default,)):
            for pf in reversed(files):
                for entry in reversed(pf.devices):
                    if op in entry.ops and entry.matches(device):
                        m = entry.ops[op]
                        scope = f" (device {entry.describe()})"
                        return Preference(m.value, f"{_at(pf, m)}{scope}",
                                          "device", not pf.builtin, _buckets(pf, m, scope))
            for pf in reversed(files):
                if op in pf.ops:
                    m = pf.ops[op]
                    return Preference(m.value, _at(pf, m),
                                      "default" if pf.builtin else "policy", not pf.builtin,
                                      _buckets(pf, m))
        return None


def _at(pf: PolicyFile, marked) -> str:
    # An in-memory policy (policy_from_dict) has no lines: its origin names it.
    return f"{pf.path}:{marked.line}" if marked.line else pf.path


class SelectionError(ValueError):
    pass


def parse_selections(items, origin: str, registry) -> list:
    """'op=backend' strings (or a mapping) -> Selections, checked against the registry."""
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items:
            for part in str(item).split(","):
                part = part.strip()
                if not part:
                    continue
                op, sep, backend = part.partition("=")
                if not sep or not op.strip() or not backend.strip():
                    raise SelectionError(f"{origin}: {part!r} is not OP=BACKEND")
                pairs.append((op.strip(), backend.strip()))
    out = []
    for op, backend in pairs:
        if op not in registry.ops:
            raise SelectionError(f"{origin}: unknown op {op!r}{_did_you_mean(op, registry.ops)} "
                                 f"(valid: {', '.join(registry.ops)})")
        valid = [b.name for b in registry.backends(op)]
        if backend not in valid:
            raise SelectionError(f"{origin}: unknown backend {backend!r} for op {op}"
                                 f"{_did_you_mean(backend, valid)} (valid: {', '.join(valid)})")
        out.append(Selection(op, backend, origin))
    return out


def build(registry, *, policy=None, selections=None, env=None, known_devices=(),
          selection_origin: str = "selections=") -> PolicyStack:
    """The stack for one decision. ENV is read now (CAPDISPATCH_POLICY, CAPDISPATCH_SET)."""
    env = os.environ if env is None else env
    if isinstance(policy, PolicyStack):
        stack = policy
    else:
        files = []
        env_paths = [p for p in env.get("CAPDISPATCH_POLICY", "").split(os.pathsep) if p]
        given = [] if policy is None else ([policy] if isinstance(policy, (str, os.PathLike, PolicyFile)) else list(policy))
        for item in env_paths + given:
            files.append(item if isinstance(item, PolicyFile)
                         else load_file(item, registry, known_devices=known_devices))
        stack = PolicyStack(default=load_default(registry), files=tuple(files))
    sels = list(stack.selections)
    if env.get("CAPDISPATCH_SET"):
        sels += parse_selections([env["CAPDISPATCH_SET"]], "CAPDISPATCH_SET", registry)
    if selections:
        sels += parse_selections(selections, selection_origin, registry)
    return attrs.evolve(stack, selections=tuple(sels))
