"""The knob map (knobs.yaml): which SGLang setting each capdispatch decision
drives, per SGLang release range. Loading checks the shape and the op and
backend names; tests check the SGLang names against the installed package."""
from __future__ import annotations

import functools
import os
from typing import Optional

import attrs
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "knobs.yaml")


class KnobsError(ValueError):
    pass


def _label(kind: str, name: str, value: str) -> str:
    """How plans and warnings name a server-args field or an environment switch."""
    return f"{name}={value}" if kind == "field" else f"env {name}={value}"


@attrs.frozen
class Setting:
    ops: tuple
    backends: Optional[tuple]     # None: any backend
    routed: bool
    kind: str                     # "field" | "env"
    name: str
    value: str
    why: str

    @property
    def label(self) -> str:
        return _label(self.kind, self.name, self.value)


@attrs.frozen
class Select:
    field: str
    value: str
    op: str
    backend: Optional[str]        # one backend on every device, or None: see `backends`
    backends: tuple = ()          # ((family, backend), ...): the value runs per device family

    @property
    def names(self) -> tuple:
        """Every capdispatch backend this value can mean."""
        return (self.backend,) if self.backend else tuple(b for _, b in self.backends)

    def backend_for(self, device) -> str:
        """The backend this value means on DEVICE (the first listed where its family has none)."""
        if self.backend:
            return self.backend
        fam = family(device)
        return next((b for f, b in self.backends if f == fam), self.backends[0][1])


def family(device) -> Optional[str]:
    """'sm90', 'sm100', 'sm120', ... (compute-capability major x 10), None without a cc."""
    cc = getattr(device, "cc", None)
    return None if cc is None else f"sm{cc[0] * 10}"


@attrs.frozen
class KnobSet:
    kind: str                     # "field" | "env"
    name: str
    value: str

    @property
    def label(self) -> str:
        return _label(self.kind, self.name, self.value)


@attrs.frozen
class Knob:
    """The SGLang settings under which SGLang runs BACKENDS of OP itself, or
    sets=None: SGLang has no setting that runs them (a route would be needed)."""
    op: str
    backends: tuple
    sets: Optional[tuple]         # KnobSet..., or None
    why: str


@attrs.frozen
class Route:
    op: str
    target: str
    call: str
    native: Optional[str]
    why: str
    cc: Optional[SpecifierSet] = None   # the cards on which SGLang calls this site; None: every card
    env: tuple = ()                     # ((name, value), ...): set in the rank's own process to route
    native_by: object = None            # moe_plan.NativeBy: `native` per launch value and card (moe)

    def calls_on(self, device) -> bool:
        """Does SGLang call this site on DEVICE (by its compute capability)?"""
        if self.cc is None:
            return True
        cc = getattr(device, "cc", None)
        return cc is not None and self.cc.contains(Version(f"{cc[0]}.{cc[1]}"), prereleases=True)


@attrs.frozen
class Model:
    ops: tuple
    kv_cache_dtypes: tuple
    knob_ops: tuple = ()          # decided and reported through `knobs`; not routed


@attrs.frozen
class Release:
    spec: SpecifierSet
    hooks: dict
    models: dict                  # architecture -> Model
    settings: tuple
    selects: tuple
    routes: tuple
    arch: dict
    knobs: tuple = ()

    def route(self, op: str, device=None) -> Optional[Route]:
        """The site SGLang calls for OP on DEVICE (the first route of OP without one)."""
        return next((r for r in self.routes if r.op == op and (device is None or r.calls_on(device))),
                    None)

    def routes_for(self, op: str) -> tuple:
        return tuple(r for r in self.routes if r.op == op)

    def route_env_names(self) -> tuple:
        """Every environment name a route sets (the launcher records the user's values)."""
        return tuple(dict.fromkeys(n for r in self.routes for n, _ in r.env))

    def knob(self, op: str, backend: str) -> Optional[Knob]:
        return next((k for k in self.knobs if k.op == op and backend in k.backends), None)


@attrs.frozen
class Knobs:
    path: str
    tested: SpecifierSet
    releases: tuple
    tested_text: str = ""        # as written (SpecifierSet reorders)

    def release(self, version: str) -> Optional[Release]:
        """The rows for SGLang VERSION, or None outside every range."""
        try:
            v = Version(version)
        except InvalidVersion:
            return None
        return next((r for r in self.releases if r.spec.contains(v, prereleases=True)), None)


def _need(d: dict, key: str, where: str, kind=None):
    if not isinstance(d, dict) or key not in d:
        raise KnobsError(f"{where}: missing {key!r}")
    value = d[key]
    if kind is not None and not isinstance(value, kind):
        raise KnobsError(f"{where}.{key}: expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _spec(text, where: str) -> SpecifierSet:
    try:
        return SpecifierSet(str(text))
    except InvalidSpecifier:
        raise KnobsError(f"{where}: {text!r} is not a version range (e.g. '>=0.5.23,<0.5.24')") from None


def _names(value, where: str) -> tuple:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise KnobsError(f"{where}: expected a name or a list of names, got {value!r}")
    return tuple(items)


def _check_backends(registry, op: str, backends, where: str) -> None:
    if op not in registry.ops:
        raise KnobsError(f"{where}: unknown op {op!r} (valid: {', '.join(registry.ops)})")
    valid = [b.name for b in registry.backends(op)]
    for b in backends or ():
        if b not in valid:
            raise KnobsError(f"{where}: unknown backend {b!r} for {op} (valid: {', '.join(valid)})")


def _release(d: dict, where: str, registry) -> Release:
    spec = _spec(_need(d, "sglang", where), f"{where}.sglang")
    hooks = _need(d, "hooks", where, dict)
    for key in ("resolution_step", "rank", "group", "tp_group"):
        _need(hooks, key, f"{where}.hooks", str)
    models = {}
    for arch, m in (_need(d, "models", where, dict)).items():
        w = f"{where}.models.{arch}"
        ops = _names(_need(m, "ops", w), f"{w}.ops")
        for op in ops:
            _check_backends(registry, op, (), w)
        knob_ops = _names(m.get("knob_ops") or [], f"{w}.knob_ops")
        for op in knob_ops:
            _check_backends(registry, op, (), w)
        models[arch] = Model(ops, _names(_need(m, "kv_cache_dtypes", w), f"{w}.kv_cache_dtypes"),
                             knob_ops)
    settings, seen = [], {}
    for i, s in enumerate(d.get("settings") or ()):
        w = f"{where}.settings[{i}]"
        ops = _names(_need(s, "ops", w), f"{w}.ops")
        raw = s.get("backends", "*")
        backends = None if raw == "*" else _names(raw, f"{w}.backends")
        for op in ops:
            _check_backends(registry, op, backends, w)
        kinds = [k for k in ("field", "env") if k in s]
        if len(kinds) != 1:
            raise KnobsError(f"{w}: give exactly one of 'field' or 'env'")
        kind = kinds[0]
        row = Setting(ops, backends, bool(s.get("routed", False)), kind, str(s[kind]),
                      str(_need(s, "value", w)), str(s.get("why", "")))
        key = (kind, row.name)
        if key in seen and seen[key] != row.value:
            raise KnobsError(f"{w}: {row.name} is set to {row.value!r} here and {seen[key]!r} in another row")
        seen[key] = row.value
        settings.append(row)
    selects = []
    for i, s in enumerate(d.get("selects") or ()):
        w = f"{where}.selects[{i}]"
        if ("backend" in s) == ("backends" in s):
            raise KnobsError(f"{w}: give exactly one of 'backend' or 'backends'")
        per = s.get("backends")
        if per is not None:
            if not isinstance(per, dict) or not per or not all(
                    isinstance(f, str) and f.startswith("sm") and f[2:].isdigit() for f in per):
                raise KnobsError(f"{w}.backends: expected a mapping of device families "
                                 f"(sm90, sm100, sm120, ...) to backends, got {per!r}")
            per = tuple((f, str(b)) for f, b in per.items())
        row = Select(str(_need(s, "field", w)), str(_need(s, "value", w)), str(_need(s, "op", w)),
                     None if per else str(s["backend"]), per or ())
        _check_backends(registry, row.op, row.names, w)
        if any(o.field == row.field and o.value == row.value for o in selects):
            raise KnobsError(f"{w}: {row.field}={row.value} is mapped twice")
        selects.append(row)
    knob_rows = []
    for i, k in enumerate(d.get("knobs") or ()):
        w = f"{where}.knobs[{i}]"
        if ("backend" in k) == ("backends" in k):
            raise KnobsError(f"{w}: give exactly one of 'backend' or 'backends'")
        op = str(_need(k, "op", w))
        backends = _names(k["backend"] if "backend" in k else k["backends"], f"{w}.backends")
        _check_backends(registry, op, backends, w)
        raw = _need(k, "set", w)
        sets = None
        if raw is not None:
            if not isinstance(raw, list) or not raw:
                raise KnobsError(f"{w}.set: expected a list of {{field|env, value}}, or null (no knob)")
            sets = []
            for j, x in enumerate(raw):
                kinds = [kk for kk in ("field", "env") if kk in (x if isinstance(x, dict) else {})]
                if len(kinds) != 1:
                    raise KnobsError(f"{w}.set[{j}]: give exactly one of 'field' or 'env'")
                sets.append(KnobSet(kinds[0], str(x[kinds[0]]), str(_need(x, "value", f"{w}.set[{j}]"))))
            sets = tuple(sets)
        for b in backends:
            if any(b in o.backends for o in knob_rows if o.op == op):
                raise KnobsError(f"{w}: {op}={b} has two knob rows")
        knob_rows.append(Knob(op, backends, sets, str(k.get("why", ""))))
    for arch_name, m in models.items():
        for op in m.knob_ops:
            covered = {b for k in knob_rows if k.op == op for b in k.backends}
            missing = [b.name for b in registry.backends(op) if b.name not in covered]
            if missing:
                raise KnobsError(f"{where}.knobs: no row for {op} backend(s) {', '.join(missing)} "
                                 f"(a knob op needs one row per backend; `set: null` where SGLang has none)")
    routes = []
    for i, r in enumerate(d.get("routes") or ()):
        w = f"{where}.routes[{i}]"
        cc_text = r.get("cc")
        env = r.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise KnobsError(f"{w}.env: expected a mapping of environment names to string values, got {env!r}")
        row = Route(str(_need(r, "op", w)), _need(r, "target", w, str), _need(r, "call", w, str),
                    r.get("native"), str(r.get("why", "")),
                    None if cc_text is None else _spec(cc_text, f"{w}.cc"),
                    tuple((str(k), v) for k, v in env.items()))
        _check_backends(registry, row.op, (row.native,) if row.native else (), w)
        if r.get("native_by") is not None:      # moe: SGLang's method depends on the launch's value
            from .moe_plan import check_native_by
            try:
                row = attrs.evolve(row, native_by=check_native_by(r["native_by"], f"{w}.native_by", registry,
                                                                  row.op))
            except ValueError as exc:
                raise KnobsError(str(exc)) from None
        clash = next((o for o in routes if o.target == row.target), None)
        if clash is not None:
            raise KnobsError(f"{w}: {row.target} is routed twice")
        routes.append(row)
    arch = _need(d, "arch", where, dict)
    for key in ("module", "probes", "platform", "globals", "jit_arch"):
        _need(arch, key, f"{where}.arch")
    facts = set(arch["probes"]) | {"sm", "cc"}
    for fact, probe in arch["platform"].items():
        if probe not in facts:
            raise KnobsError(f"{where}.arch.platform.{fact}: {probe!r} is not a probe or sm/cc")
    for i, g in enumerate(arch["globals"]):
        if g.get("fact") not in facts:
            raise KnobsError(f"{where}.arch.globals[{i}]: fact {g.get('fact')!r} is not a probe or sm/cc")
    return Release(spec, dict(hooks), models, tuple(settings), tuple(selects), tuple(routes), dict(arch),
                   tuple(knob_rows))


@functools.lru_cache(maxsize=4)
def load(path: Optional[str] = None) -> Knobs:
    """Parse and check the knob map (the packaged knobs.yaml by default)."""
    import yaml

    from ...backends import builtin
    path = path or DEFAULT_PATH
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise KnobsError(f"{path}: cannot read the knob map: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != 1:
        raise KnobsError(f"{path}: expected a mapping with 'schema: 1'")
    tested = _spec(_need(data, "tested", path), f"{path}: tested")
    registry = builtin()
    releases = tuple(_release(r, f"{path}: releases[{i}]", registry)
                     for i, r in enumerate(_need(data, "releases", path, list)))
    return Knobs(path, tested, releases, str(data["tested"]))
