"""The knob map (knobs.yaml): how each capdispatch decision is carried out inside
SGLang, per SGLang release range. Loading checks the shape and the op, backend
and route names, with errors that name the file and line; tests check the
SGLang names against the installed package."""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import attrs
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

import capdispatch as cd

from .records import LaunchRule, SglangSetting

MAX_BYTES = 1 << 20     # the knob map is ~20 KiB
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "knobs.yaml")
ENTRY_KINDS = ("sglang", "route", "none")


log = logging.getLogger("capdispatch")


class KnobsError(cd.CapdispatchError, ValueError):
    pass


@attrs.frozen
class Unmapped:
    """A plugin's backend of a model op that the knob map has no entry for: its decisions
    are reported, not carried out inside SGLang. MESSAGE names it and the entry to add."""
    op: str
    backend: str
    plugin: str
    message: str


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

    def policy(self) -> dict:
        """As policy data (`capdispatch.policy_from_dict`): per family its backend, elsewhere
        the first listed (which cannot run there: downgraded loudly, refused under strict)."""
        return {"ops": {self.op: [self.backends[0][1]]},
                "devices": [{"match": {"cc": _family_range(fam)}, "ops": {self.op: [b]}}
                            for fam, b in self.backends]}


def _family_range(fam: str) -> str:
    """'sm120' -> '>=12.0,<13.0'."""
    major = int(fam[2:]) // 10
    return f">={major}.0,<{major + 1}.0"


def family(device) -> Optional[str]:
    """'sm90', 'sm100', 'sm120', ... (compute-capability major x 10), None without a cc."""
    cc = getattr(device, "cc", None)
    return None if cc is None else f"sm{cc[0] * 10}"


@attrs.frozen
class Entry:
    """How capdispatch's choice of BACKEND for OP runs inside SGLang: SGLang's own
    kernel under `settings` (kind "sglang"), capdispatch's kernel at one of `routes`
    (kind "route"), or neither (kind "none": the decision is reported)."""
    op: str
    backend: str
    kind: str                     # "sglang" | "route" | "none"
    settings: tuple = ()          # SglangSetting... (kind "sglang")
    routes: tuple = ()            # route names (kind "route")
    why: str = ""
    line: int = 0


@attrs.frozen
class Route:
    op: str
    target: str
    call: str
    native: Optional[str]
    why: str
    cc: Optional[SpecifierSet] = None   # the cards on which SGLang calls this site; None: every card
    env: tuple = ()                     # ((name, value), ...): set in the rank's own process to route
    name: str = ""
    runner: Optional[SglangSetting] = None   # the SGLang setting under which `native` runs here
    prepare: Optional[str] = None             # "module:function": weight preparation at load time
    native_by: object = None                  # moe_plan.NativeBy: `native` per launch value and card

    @property
    def site(self) -> str:
        return self.target.rsplit(".", 1)[-1]

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
    any_kv_cache_dtype: tuple = ()    # ops that run whatever the KV-cache dtype


@attrs.frozen
class Release:
    spec: SpecifierSet
    hooks: dict
    models: dict                  # architecture -> Model
    settings: tuple
    selects: tuple
    routes: tuple
    arch: dict
    entries: dict = attrs.field(factory=dict)    # (op, backend) -> Entry
    unmapped: tuple = ()                         # Unmapped: plugin backends without an entry

    def route(self, op: str, device=None) -> Optional[Route]:
        """The site SGLang calls for OP on DEVICE (the first route of OP without one)."""
        return next((r for r in self.routes if r.op == op and (device is None or r.calls_on(device))),
                    None)

    def routes_for(self, op: str) -> tuple:
        return tuple(r for r in self.routes if r.op == op)

    def route_env_names(self) -> tuple:
        """Every environment name a route sets (the launcher records the user's values)."""
        return tuple(dict.fromkeys(n for r in self.routes for n, _ in r.env))

    def entry(self, op: str, backend: Optional[str]) -> Optional[Entry]:
        return self.entries.get((op, backend))

    def unmapped_of(self, op: str, backend: Optional[str]) -> Optional[Unmapped]:
        return next((u for u in self.unmapped if (u.op, u.backend) == (op, backend)), None)

    def sglang_names(self, ops) -> tuple:
        """(kind, name) of every SGLang setting the entries of OPS name, in file order."""
        return tuple(dict.fromkeys((s.kind, s.name) for (op, _), e in self.entries.items()
                                   if op in ops for s in e.settings))


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


class _Checker:
    """Errors as `file:line: where: what`, from the line-marked document."""

    def __init__(self, path: str, registry):
        self.path, self.registry = path, registry

    def err(self, node, where: str, message: str, key=None) -> KnobsError:
        line = 0
        if node is not None:
            line = node.line_of(key) if key is not None and hasattr(node, "line_of") else getattr(node, "line", 0)
        at = f"{self.path}:{line}" if line else self.path
        return KnobsError(f"{at}: {where}: {message}")

    def need(self, d, key: str, where: str, kind=None):
        if not isinstance(d, dict):
            raise self.err(d, where, f"expected a mapping, got {d!r}")
        if key not in d:
            raise self.err(d, where, f"missing {key!r}")
        value = d[key]
        if kind is not None and not isinstance(value, kind):
            raise self.err(d, f"{where}.{key}", f"expected {getattr(kind, '__name__', kind)}, got {value!r}",
                           key)
        return value

    def only(self, d, keys, where: str) -> None:
        from capdispatch import did_you_mean
        for k in d:
            if k not in keys:
                raise self.err(d, where, f"unknown key {k!r}{did_you_mean(k, keys)} "
                                         f"(valid: {', '.join(keys)})", k)

    def spec(self, d, key, where: str) -> SpecifierSet:
        text = d[key]
        try:
            return SpecifierSet(str(text))
        except InvalidSpecifier:
            raise self.err(d, f"{where}.{key}", f"{text!r} is not a version range "
                                                f"(e.g. '>=0.5.23,<0.5.24')", key) from None

    def names(self, d, key, where: str) -> tuple:
        value = d[key]
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise self.err(d, f"{where}.{key}", f"expected a name or a list of names, got {value!r}", key)
        return tuple(items)

    def op(self, node, op: str, where: str, key=None) -> None:
        from capdispatch import did_you_mean
        if op not in self.registry.ops:
            raise self.err(node, where, f"unknown op {op!r}{did_you_mean(op, self.registry.ops)} "
                                        f"(valid: {', '.join(self.registry.ops)})", key)

    def backends(self, node, op: str, backends, where: str, key=None) -> None:
        from capdispatch import did_you_mean
        self.op(node, op, where, key)
        valid = [b.name for b in self.registry.backends(op)]
        for b in backends or ():
            if b not in valid:
                raise self.err(node, where, f"unknown backend {b!r} for {op}{did_you_mean(b, valid)} "
                                            f"(valid: {', '.join(valid)})", key)

    def setting(self, x, where: str) -> SglangSetting:
        if not isinstance(x, dict):
            raise self.err(None, where, f"expected {{field|env: NAME, value: V}}, got {x!r}")
        kinds = [k for k in ("field", "env") if k in x]
        if len(kinds) != 1:
            raise self.err(x, where, "give exactly one of 'field' or 'env'")
        self.only(x, ("field", "env", "value"), where)
        return SglangSetting(kinds[0], str(x[kinds[0]]), str(self.need(x, "value", where)))


def _release(c: _Checker, d, where: str) -> Release:
    spec = c.spec(d, "sglang", where) if "sglang" in d else c.need(d, "sglang", where)
    hooks = c.need(d, "hooks", where, dict)
    for key in ("resolution_step", "rank", "group", "tp_group"):
        c.need(hooks, key, f"{where}.hooks", str)
    models = {}
    for arch, m in c.need(d, "models", where, dict).items():
        w = f"{where}.models.{arch}"
        c.only(m, ("ops", "kv_cache_dtypes", "any_kv_cache_dtype"), w)
        c.need(m, "ops", w)
        ops = c.names(m, "ops", w)
        for op in ops:
            c.op(m, op, f"{w}.ops", "ops")
        anyd = c.names(m, "any_kv_cache_dtype", w) if "any_kv_cache_dtype" in m else ()
        for op in anyd:
            if op not in ops:
                raise c.err(m, f"{w}.any_kv_cache_dtype", f"{op!r} is not one of the model's ops",
                            "any_kv_cache_dtype")
        c.need(m, "kv_cache_dtypes", w)
        models[arch] = Model(ops, c.names(m, "kv_cache_dtypes", w), anyd)
    settings, seen = [], {}
    rows = d.get("settings") or []
    for i, s in enumerate(rows):
        w = f"{where}.settings[{i}]"
        c.need(s, "ops", w)
        ops = c.names(s, "ops", w)
        raw = s.get("backends", "*")
        backends = None if raw == "*" else c.names(s, "backends", w)
        for op in ops:
            c.backends(s, op, backends, w)
        kinds = [k for k in ("field", "env") if k in s]
        if len(kinds) != 1:
            raise c.err(s, w, "give exactly one of 'field' or 'env'")
        kind = kinds[0]
        row = LaunchRule(ops, backends, bool(s.get("routed", False)), kind, str(s[kind]),
                      str(c.need(s, "value", w)), str(s.get("why", "")))
        key = (kind, row.name)
        if key in seen and seen[key] != row.value:
            raise c.err(s, w, f"{row.name} is set to {row.value!r} here and {seen[key]!r} in another row",
                        "value")
        seen[key] = row.value
        settings.append(row)
    selects = []
    for i, s in enumerate(d.get("selects") or []):
        w = f"{where}.selects[{i}]"
        if ("backend" in s) == ("backends" in s):
            raise c.err(s, w, "give exactly one of 'backend' or 'backends'")
        per = s.get("backends")
        if per is not None:
            if not isinstance(per, dict) or not per or not all(
                    isinstance(f, str) and f.startswith("sm") and f[2:].isdigit() for f in per):
                raise c.err(s, f"{w}.backends", f"expected a mapping of device families "
                                                f"(sm90, sm100, sm120, ...) to backends, got {dict(per)!r}",
                            "backends")
            per = tuple((f, str(b)) for f, b in per.items())
        row = Select(str(c.need(s, "field", w)), str(c.need(s, "value", w)), str(c.need(s, "op", w)),
                     None if per else str(s["backend"]), per or ())
        c.backends(s, row.op, row.names, w, "backends" if per else "backend")
        if any(o.field == row.field and o.value == row.value for o in selects):
            raise c.err(s, w, f"{row.field}={row.value} is mapped twice")
        selects.append(row)
    routes = []
    for i, r in enumerate(d.get("routes") or []):
        w = f"{where}.routes[{i}]"
        c.only(r, ("name", "op", "target", "call", "native", "cc", "env", "why", "runner", "prepare",
                   "native_by"), w)
        env = r.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise c.err(r, f"{w}.env", f"expected a mapping of environment names to string values, "
                                       f"got {dict(env) if isinstance(env, dict) else env!r}", "env")
        prepare = r.get("prepare")
        if prepare is not None and (not isinstance(prepare, str) or prepare.count(":") != 1):
            raise c.err(r, f"{w}.prepare", f"expected 'module:function', got {prepare!r}", "prepare")
        runner = c.setting(r["runner"], f"{w}.runner") if r.get("runner") is not None else None
        c.need(r, "op", w)
        c.op(r, str(r["op"]), w, "op")
        row = Route(str(r["op"]), c.need(r, "target", w, str), c.need(r, "call", w, str),
                    r.get("native"), str(r.get("why", "")),
                    None if r.get("cc") is None else c.spec(r, "cc", w),
                    tuple((str(k), v) for k, v in env.items()), str(c.need(r, "name", w, str)),
                    runner, prepare)
        c.backends(r, row.op, (row.native,) if row.native else (), w, "native")
        if r.get("native_by") is not None:      # moe: SGLang's method depends on the launch's value
            from .moe_plan import check_native_by
            try:
                nb = check_native_by(r["native_by"], f"{w}.native_by", c.registry, row.op)
            except ValueError as exc:
                at, _, what = str(exc).partition(": ")
                raise c.err(r, at, what, "native_by") from None
            row = attrs.evolve(row, native_by=nb)
        if any(o.target == row.target for o in routes):
            raise c.err(r, w, f"{row.target} is routed twice", "target")
        if any(o.name == row.name for o in routes):
            raise c.err(r, w, f"route name {row.name!r} is used twice", "name")
        routes.append(row)
    by_name = {r.name: r for r in routes}
    entries = {}
    table = d.get("backends") or {}
    if not isinstance(table, dict):
        raise c.err(d, f"{where}.backends", "expected a mapping of op -> backend -> entry", "backends")
    for op, per in table.items():
        w = f"{where}.backends.{op}"
        c.op(table, op, w, op)
        if not isinstance(per, dict):
            raise c.err(table, w, "expected a mapping of backend -> entry", op)
        for backend, e in per.items():
            we = f"{w}.{backend}"
            c.backends(per, op, (backend,), we, backend)
            if not isinstance(e, dict):
                raise c.err(per, we, f"expected a mapping with one of {', '.join(ENTRY_KINDS)}, got {e!r}",
                            backend)
            c.only(e, ENTRY_KINDS + ("why",), we)
            kinds = [k for k in ENTRY_KINDS if k in e]
            if len(kinds) != 1:
                raise c.err(e, we, f"give exactly one of {', '.join(map(repr, ENTRY_KINDS))} "
                                   f"(SGLang's own settings, a route, or none)")
            kind = kinds[0]
            sets, names = (), ()
            if kind == "sglang":
                raw = e["sglang"]
                if not isinstance(raw, list):
                    raise c.err(e, f"{we}.sglang", f"expected a list of {{field|env, value}} ([] when "
                                                   f"SGLang's default runs it), got {raw!r}", "sglang")
                sets = tuple(c.setting(x, f"{we}.sglang[{j}]") for j, x in enumerate(raw))
            elif kind == "route":
                c.need(e, "route", we)
                names = c.names(e, "route", we)
                for n in names:
                    if n not in by_name:
                        from capdispatch import did_you_mean
                        raise c.err(e, f"{we}.route", f"unknown route {n!r}{did_you_mean(n, by_name)} "
                                                      f"(valid: {', '.join(by_name)})", "route")
                    if by_name[n].op != op:
                        raise c.err(e, f"{we}.route", f"route {n!r} is a {by_name[n].op} site, "
                                                      f"not a {op} one", "route")
            elif e["none"] is not True:
                raise c.err(e, f"{we}.none", f"expected true, got {e['none']!r}", "none")
            entries[(op, backend)] = Entry(op, backend, kind, sets, names, str(e.get("why", "")),
                                           per.line_of(backend))
    # A built-in backend without an entry is an error of the packaged map; a plugin's is
    # reported (its name and the entry to add) and its decisions are not carried out.
    from_plugin = {b: p.name for p in c.registry.plugins if p.ok for b in p.backends}
    unmapped = []
    for arch_name, m in models.items():
        for op in m.ops:
            missing = [b.name for b in c.registry.backends(op) if (op, b.name) not in entries]
            builtin_missing = [b for b in missing if f"{op}/{b}" not in from_plugin]
            if builtin_missing:
                raise c.err(table, f"{where}.backends.{op}",
                            f"no entry for {op} backend(s) {', '.join(builtin_missing)} (every backend of a "
                            f"model op needs one: sglang, route or none; e.g. "
                            f"{builtin_missing[0]}: {{none: true, why: \"...\"}})", op if op in table else None)
            for b in missing:
                if any((u.op, u.backend) == (op, b) for u in unmapped):
                    continue
                plugin = from_plugin[f"{op}/{b}"]
                at = f"{c.path}:{table.line_of(op)}" if op in table and hasattr(table, "line_of") else c.path
                unmapped.append(Unmapped(op, b, plugin, (
                    f"the knob map has no entry for {op} backend {b} (plugin {plugin!r}): add "
                    f"`{b}: {{none: true, why: \"...\"}}` (or sglang: [...], or route: [NAME]) under "
                    f"{where}.backends.{op} ({at}); until then a decision for it is reported, "
                    f"not carried out inside SGLang")))
    arch = c.need(d, "arch", where, dict)
    for key in ("module", "probes", "platform", "globals", "jit_arch"):
        c.need(arch, key, f"{where}.arch")
    facts = set(arch["probes"]) | {"sm", "cc"}
    for fact, probe in arch["platform"].items():
        if probe not in facts:
            raise c.err(arch["platform"], f"{where}.arch.platform.{fact}", f"{probe!r} is not a probe or sm/cc",
                        fact)
    for i, g in enumerate(arch["globals"]):
        if g.get("fact") not in facts:
            raise c.err(g, f"{where}.arch.globals[{i}]", f"fact {g.get('fact')!r} is not a probe or sm/cc")
    return Release(spec, dict(hooks), models, tuple(settings), tuple(selects), tuple(routes),
                   _plain(arch), entries, tuple(unmapped))


def _plain(x):
    """Marked containers as plain dicts and lists (the arch table travels to SGLang code)."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


@functools.lru_cache(maxsize=4)
def load(path: Optional[str] = None) -> Knobs:
    """Parse and check the knob map (the packaged knobs.yaml by default)."""
    import capdispatch as cd
    PolicyError, load_marked = cd.PolicyError, cd.load_marked
    path = path or DEFAULT_PATH
    try:     # a regular file of at most 1 MiB: a FIFO or a device is refused, never read
        text = cd.read_file(path, limit=MAX_BYTES, what="the knob map").decode("utf-8")
    except cd.FileError as exc:
        raise KnobsError(f"{exc.path}: {exc.reason}") from None
    except UnicodeDecodeError as exc:
        raise KnobsError(f"{path}: the knob map is not UTF-8 text (byte offset {exc.start})") from None
    try:
        data = load_marked(text, path)
    except PolicyError as exc:
        raise KnobsError(str(exc)) from None
    c = _Checker(path, cd.registry())
    if not isinstance(data, dict) or data.get("schema") != 1:
        raise c.err(data if isinstance(data, dict) else None, "the knob map", "expected a mapping with 'schema: 1'",
                    "schema")
    c.need(data, "tested", "the knob map")
    tested = c.spec(data, "tested", "the knob map")
    releases = c.need(data, "releases", "the knob map", list)
    out = Knobs(path, tested, tuple(_release(c, r, f"releases[{i}]") for i, r in enumerate(releases)),
                str(data["tested"]))
    for message in dict.fromkeys(u.message for r in out.releases for u in r.unmapped):
        log.warning("capdispatch: %s", message)
    return out
