"""Layering: default < files in order < device-scoped entries < explicit selections."""
from __future__ import annotations

import os
from typing import Optional

import attrs

from ..errors import CapdispatchError
from .loader import MIXED_GROUP, ON_UNSUPPORTED, PolicyError, PolicyFile, _show, did_you_mean, load_default, load_file


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
    unmeasured: tuple = ()   # placed among BACKENDS by the default order (Bucket.unmeasured)


@attrs.frozen
class Preference:
    """The preference list of the layer that speaks for an op on a device."""
    backends: tuple
    origin: str          # file:line and scope, for the trace
    kind: str            # "default" | "policy" | "device" | "selection"
    user: bool           # a fallback away from it is logged (or refused under strict)
    buckets: tuple = ()  # BucketPreference..., ascending, the last the catch-all (BACKENDS)
    unmeasured: tuple = ()   # the catch-all's backends a calibration could not run
    # (where, {library: version}) of the calibration that wrote this preference, if any
    measured_with: Optional[tuple] = attrs.field(default=None, eq=False)


def _buckets(pf, m, scope: str = "") -> tuple:
    return tuple(BucketPreference(b.upper, b.backends, f"{_at(pf, b)}{scope}", b.unmeasured)
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
    settings: tuple = ()      # ((key, Setting), ...): explicit flags, above every file

    @property
    def layers(self) -> tuple:
        return (self.default,) + tuple(self.files)

    def setting(self, key: str) -> Setting:
        for k, explicit in reversed(self.settings):
            if k == key:
                return explicit
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
                                          "device", not pf.builtin, _buckets(pf, m, scope),
                                          m.unmeasured,
                                          None if entry.measured_with is None else
                                          (f"{pf.path}:{entry.line}", entry.measured_with))
            for pf in reversed(files):
                if op in pf.ops:
                    m = pf.ops[op]
                    return Preference(m.value, _at(pf, m),
                                      "default" if pf.builtin else "policy", not pf.builtin,
                                      _buckets(pf, m), m.unmeasured)
        return None


def default_order(default: PolicyFile, registry, op: str) -> tuple:
    """OP's backends in the built-in policy's order: the list DEFAULT gives for OP (its
    catch-all), then every registered backend it does not name (a plugin's), sorted by
    name. The order of registration plays no part."""
    named = tuple(default.ops[op].value) if op in default.ops else ()
    return named + tuple(sorted(b.name for b in registry.backends(op) if b.name not in named))


def _at(pf: PolicyFile, marked) -> str:
    # An in-memory policy (policy_from_dict) has no lines: its origin names it.
    return f"{pf.path}:{marked.line}" if marked.line else pf.path


class SelectionError(CapdispatchError, ValueError):
    pass


def parse_selections(items, origin: str, registry) -> list:
    """'op=backend' strings (or a mapping) -> Selections, checked against the registry."""
    if isinstance(items, str):
        items = [items]
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        try:
            items = list(items)
        except TypeError:
            raise SelectionError(f"{origin}: expected a mapping op -> backend or a list of "
                                 f"'op=backend' strings, got {type(items).__name__}") from None
        pairs = []
        for item in items:
            if not isinstance(item, str):
                raise SelectionError(f"{origin}: {_show(item)} is not an 'op=backend' string")
            for part in item.split(","):
                part = part.strip()
                if not part:
                    continue
                op, sep, backend = part.partition("=")
                if not sep or not op.strip() or not backend.strip():
                    raise SelectionError(f"{origin}: {_show(part)} is not OP=BACKEND "
                                         f"(e.g. kv_dequant=triton_u8)")
                pairs.append((op.strip(), backend.strip()))
    out = []
    for op, backend in pairs:
        if not isinstance(op, str) or op not in registry.ops:
            raise SelectionError(f"{origin}: unknown op {_show(op)}{did_you_mean(op, registry.ops)} "
                                 f"(valid: {', '.join(registry.ops)})")
        valid = [b.name for b in registry.backends(op)]
        if not isinstance(backend, str) or backend not in valid:
            raise SelectionError(f"{origin}: unknown backend {_show(backend)} for op {op}"
                                 f"{did_you_mean(backend, valid)} (valid: {', '.join(valid)})")
        out.append(Selection(op, backend, origin))
    return out


SETTING_VALUES = {"mixed_group": MIXED_GROUP, "on_unsupported": ON_UNSUPPORTED}


def parse_settings(settings, origin: str) -> tuple:
    """{key: value} -> ((key, Setting), ...), checked like a policy file's values."""
    out = []
    for key, value in dict(settings or {}).items():
        if key not in SETTING_VALUES:
            raise SelectionError(f"{origin}: unknown setting {key!r}{did_you_mean(key, SETTING_VALUES)} "
                                 f"(valid: {', '.join(SETTING_VALUES)})")
        valid = SETTING_VALUES[key]
        if value not in valid:
            raise SelectionError(f"{origin}: {key} {value!r} is not one of {', '.join(valid)}"
                                 f"{did_you_mean(str(value), valid)}")
        out.append((key, Setting(value, origin)))
    return tuple(out)


def policy_paths(env, name: str = "CAPDISPATCH_POLICY") -> list:
    """The policy files of variable NAME: paths separated by os.pathsep (':' on Linux and
    macOS, ';' on Windows), as PATH is; unset or empty: none. An empty entry is refused
    (the same rule as every comma list), and so is a comma list of existing files."""
    raw = env.get(name, "")
    if not raw.strip():
        return []
    sep = os.pathsep
    parts = raw.split(sep)
    if not all(p.strip() for p in parts):
        raise PolicyError(name, None, f"{_show(raw)} has an empty entry (valid: FILE[{sep}FILE...], "
                                      f"files separated by {sep!r}; no leading, trailing or doubled {sep!r})")
    for p in parts:
        if "," in p and not os.path.exists(p) and all(os.path.exists(q.strip()) for q in p.split(",")):
            raise PolicyError(name, None, f"{_show(raw)}: no file {_show(p)}; {name} separates files "
                                          f"with {sep!r} (os.pathsep, as PATH does), not ','")
    return parts


def build(registry, *, policy=None, selections=None, env=None, known_devices=(),
          selection_origin: str = "selections=", settings=None,
          settings_origin: str = "settings=") -> PolicyStack:
    """The stack for one decision. ENV is read now (CAPDISPATCH_POLICY, CAPDISPATCH_SET).
    SETTINGS ({"mixed_group": "uniform"}) sit above every policy file."""
    env = os.environ if env is None else env
    if isinstance(policy, PolicyStack):
        stack = policy
    else:
        files = []
        for p in policy_paths(env):
            try:
                files.append(load_file(p, registry, known_devices=known_devices))
            except PolicyError as exc:
                raise PolicyError(exc.file, exc.line, f"{exc.bare} (from CAPDISPATCH_POLICY)") from None
        if policy is None:
            given = []
        elif isinstance(policy, (str, bytes, os.PathLike, PolicyFile)):
            given = [policy]
        elif isinstance(policy, (list, tuple)):
            given = list(policy)
        else:
            raise PolicyError(f"policy={type(policy).__name__}", None,
                              "expected a path, a PolicyFile or PolicyStack, or a list of paths")
        for item in given:
            files.append(item if isinstance(item, PolicyFile)
                         else load_file(item, registry, known_devices=known_devices))
        stack = PolicyStack(default=load_default(registry), files=tuple(files))
    sels = list(stack.selections)
    if env.get("CAPDISPATCH_SET"):
        sels += parse_selections([env["CAPDISPATCH_SET"]], "CAPDISPATCH_SET", registry)
    if selections:
        sels += parse_selections(selections, selection_origin, registry)
    explicit = tuple(stack.settings) + parse_settings(settings, settings_origin)
    return attrs.evolve(stack, selections=tuple(sels), settings=explicit)
