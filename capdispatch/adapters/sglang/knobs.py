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
from capdispatch import extend

from . import compat
from .moe_plan import NativeBy
from .records import LaunchRule, SglangSetting, family

MAX_BYTES = 1 << 20     # the knob map is ~20 KiB
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "knobs.yaml")
ENTRY_KINDS = ("sglang", "route", "none")


log = logging.getLogger("capdispatch")


class KnobsError(cd.CapdispatchError, ValueError):
    """A knob map that cannot be used: FILE:LINE: where in the map: what is wrong."""

    def __init__(self, path: str, line: Optional[int], message: str):
        self.path, self.line, self.bare = path, line, message
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


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
    # `needs` (kind "sglang"): what SGLang's own kernel needs where it is not the library
    # capdispatch's adapter of BACKEND calls: requirement records (backends.base), by which
    # the decision judges SGLang's kernel instead of the adapter's. (): the adapter's.
    needs: tuple = ()


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
    native_by: Optional[NativeBy] = None      # `native` per launch value and card

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
class Hooks:
    """Where the adapter hooks into SGLang (knobs.yaml `hooks`): dotted names."""
    resolution_step: str          # the launcher's resolution step it wraps
    rank: str                     # every scheduler (TP-rank) process, before CUDA and the model
    group: str                    # after the TP groups exist: cross-rank agreement
    tp_group: str                 # the function that returns the TP group


@attrs.frozen
class Model:
    ops: tuple                        # the model declaration's (capdispatch/models/calls.yaml)
    kv_cache_dtypes: tuple            # the KV-cache dtypes SGLang keeps the model's KV pool in
    any_kv_cache_dtype: tuple = ()    # the declaration's ops not on the KV pool: run under any


@attrs.frozen
class Release:
    spec: SpecifierSet
    api: str                      # compat.APIS: which SGLang API the adapter's code calls
    hooks: Hooks
    models: dict                  # architecture -> Model
    settings: tuple
    selects: tuple
    routes: tuple
    arch: dict                    # plain data: it travels to the code that corrects SGLang's facts
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

    def hosted(self, launch=None) -> dict:
        """(op, backend) -> extend.Hosted for every entry with `needs`: the candidates SGLang runs
        itself with its own kernel, for capdispatch.context(hosted=...). A site whose route sets
        an environment switch takes SGLang off its own call for every size once any size is
        routed, so there SGLang's kernel runs for every size or none (split False). At a site
        whose kernel is a method per launch value (`native_by`, the MoE layer) the method runs
        for every size or none (split False), and only where LAUNCH (the launch's SglangSetting
        of that field; None: unknown) builds the method that runs the backend on the card's
        family: the statement leads with that requirement (moe_plan.Builds)."""
        from .moe_plan import Builds
        out = {}
        for (op, backend), e in self.entries.items():
            if not e.needs:
                continue
            sites = [r for r in self.routes_for(op) if r.native == backend and r.native_by is None]
            by = next((r.native_by for r in self.routes_for(op)
                       if r.native_by is not None and r.native_by.names(backend)), None)
            if by is not None:
                value = getattr(launch, "value", None) if getattr(launch, "name", by.field) == by.field else None
                out[(op, backend)] = extend.Hosted("SGLang", (Builds(by, backend, value),) + e.needs, split=False)
            else:
                out[(op, backend)] = extend.Hosted("SGLang", e.needs, split=not any(r.env for r in sites))
        return out

    def launch_hosted(self, launch) -> dict:
        """The statements of hosted() whose judgement depends on the launch's value (`native_by`
        sites), judged under LAUNCH: what a decision that knows the launch's value replaces."""
        from .moe_plan import Builds
        return {k: h for k, h in self.hosted(launch).items() if any(isinstance(r, Builds) for r in h.requires)}

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


# --------------------------------------------------------------------------- #
# Reading the map: one function per section, each returning its records
# --------------------------------------------------------------------------- #
_RELEASE_KEYS = dict(required=("sglang", "api", "hooks", "models", "arch"),
                     optional={"settings": None, "selects": None, "routes": None, "backends": None})
_SETTING_KEYS = dict(required=("ops", "value"),
                     optional={"backends": None, "routed": False, "field": None, "env": None, "why": ""})
_SELECT_KEYS = dict(required=("field", "value", "op"), optional=("backend", "backends"))
_ROUTE_KEYS = dict(required=("name", "op", "target", "call"),
                   optional={"native": None, "cc": None, "env": None, "why": "", "runner": None, "prepare": None,
                             "native_by": None})
_ENTRY_KEYS = {"sglang": None, "route": None, "none": None, "why": "", "needs": None}
# One requirement of an entry's `needs`: its kind (the key it gives) and the keys it takes.
_NEED_KINDS = {"library": ("version", "module"), "feature": (), "any_feature": (), "cc": (), "platform": ()}
_ARCH_KEYS = ("module", "probes", "platform", "globals", "jit_arch")


@functools.lru_cache(maxsize=4)
def load(path: Optional[str] = None) -> Knobs:
    """Parse and check the knob map (the packaged knobs.yaml by default): a regular file
    of at most 1 MiB (a FIFO or a device is refused, never read)."""
    path = path or DEFAULT_PATH
    r = extend.Reader.from_file(path, limit=MAX_BYTES, error=KnobsError, kind="knob map")
    out = _knobs(r, path, extend.registry.builtin())
    for message in dict.fromkeys(u.message for rel in out.releases for u in rel.unmapped):
        log.warning("capdispatch: %s", message)
    return out


def _knobs(r, path: str, registry) -> Knobs:
    root = r.root()
    if root is None:
        raise r.err(None, "the knob map is empty: it needs schema: 1, tested and releases")
    top = r.fields(root, "the knob map", required=("schema", "tested", "releases"), top=True)
    schema = r.integer(top["schema"], "schema")
    if schema != 1:
        raise r.err(top["schema"], f"schema {schema} is not supported (valid: 1)")
    releases = r.sequence(top["releases"], "releases")
    return Knobs(path, _spec(r, top["tested"], "tested"),
                 tuple(_release(r, node, f"releases[{i}]", registry) for i, node in enumerate(releases)),
                 r.text(top["tested"], "tested"))


def _release(r, node, where: str, registry) -> Release:
    """One release range's rows, section by section."""
    f = r.fields(node, where, **_RELEASE_KEYS)
    spec = _spec(r, f["sglang"], f.where("sglang"))
    api = r.name(f["api"], f.where("api"), list(compat.APIS), noun="SGLang API")
    hooks = _hooks(r, f["hooks"], f.where("hooks"))
    models = _models(r, f["models"], f.where("models"), registry)
    settings = _settings(r, f.get("settings"), f.where("settings"), registry)
    selects = _selects(r, f.get("selects"), f.where("selects"), registry)
    routes = _routes(r, f.get("routes"), f.where("routes"), registry)
    entries, lines = _entries(r, f.get("backends"), f.where("backends"), registry, routes)
    unmapped = _unmapped(r, models, entries, lines, f.where("backends"), f.where("models"), registry)
    return Release(spec, api, hooks, models, settings, selects, routes, _arch(r, f["arch"], f.where("arch")),
                   entries, unmapped)


def _spec(r, node, where: str) -> SpecifierSet:
    text = r.text(node, where, need="a version range such as '>=0.5.23,<0.5.24'")
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise r.err(node, f"{where}: {text!r} is not a version range (e.g. '>=0.5.23,<0.5.24')") from None


def _op(r, node, where: str, registry) -> str:
    """An op name of the registry."""
    return r.name(node, where, list(registry.ops), noun="op")


def _backend(r, node, where: str, op: str, registry) -> str:
    """A backend name of OP; WHERE: the row it stands in."""
    return r.name(node, where, [b.name for b in registry.backends(op)], noun="backend", of=f" for {op}")


def _one_of(r, f, node, where: str, keys) -> str:
    """The one key of KEYS that F gives; refused when none or more than one."""
    given = [k for k in keys if k in f]
    if len(given) != 1:
        names = " or ".join(map(repr, keys)) if len(keys) == 2 else ", ".join(map(repr, keys))
        more = " (SGLang's own settings, a route, or none)" if keys == ENTRY_KINDS else ""
        raise r.err(node, f"{where}: give exactly one of {names}{more}")
    return given[0]


def _hooks(r, node, where: str) -> Hooks:
    f = r.fields(node, where, required=tuple(attrs.fields_dict(Hooks)))
    return Hooks(**{key: r.text(f[key], f.where(key), need="a dotted name", nonempty=True) for key in f})


def _models(r, node, where: str, registry) -> dict:
    """Architecture -> Model: the ops a model runs, and which of them work on its KV pool, are
    its declaration's (extend.model_calls, capdispatch/models/calls.yaml); the knob map says
    under which KV-cache dtypes SGLang keeps that pool."""
    out = {}
    for arch, anode, mnode in r.mapping(node, where):
        w = f"{where}.{arch}"
        m = r.fields(mnode, w, required=("kv_cache_dtypes",))
        try:
            declared = extend.model_calls(arch)
        except cd.ModelError as e:
            raise r.err(anode, f"{w}: {e}") from None
        ops = declared.ops
        unknown = [op for op in ops if op not in registry.ops]
        if unknown:
            raise r.err(anode, f"{w}: the model calls {', '.join(unknown)}, which no registered op is "
                               f"(registered: {', '.join(registry.ops)})")
        out[arch] = Model(ops, r.names(m["kv_cache_dtypes"], m.where("kv_cache_dtypes"), noun="dtype"),
                          declared.any_kv_cache_dtype)
    return out


def _sglang_setting(r, f, node, where: str) -> SglangSetting:
    """`field: NAME` or `env: NAME`, with `value`, of the mapping F read."""
    kind = _one_of(r, f, node, where, ("field", "env"))
    return SglangSetting(kind, r.text(f[kind], f.where(kind), need="an SGLang name", nonempty=True),
                         r.text(f["value"], f.where("value"), need="the value SGLang takes"))


def _setting(r, node, where: str) -> SglangSetting:
    """{field|env: NAME, value: V}: one SGLang name and its value."""
    return _sglang_setting(r, r.fields(node, where, required=("value",), optional=("field", "env")), node, where)


def _settings(r, node, where: str, registry) -> tuple:
    """Launch-time settings, the same for every rank: one name never set to two values."""
    rows, seen = [], {}
    for w, snode in r.rows(node, where):
        s = r.fields(snode, w, **_SETTING_KEYS)
        ops = r.names(s["ops"], s.where("ops"), list(registry.ops), noun="op")
        backends = s.get("backends", r.names, noun="backend")
        backends = None if backends in (None, ("*",)) else backends     # "*": any backend
        for op in ops if backends else ():
            r.names(s["backends"], w, [b.name for b in registry.backends(op)], noun="backend", of=f" for {op}")
        knob = _sglang_setting(r, s, snode, w)
        if seen.get((knob.kind, knob.name), knob.value) != knob.value:
            raise r.err(s["value"], f"{w}: {knob.name} is set to {knob.value!r} here and "
                                    f"{seen[(knob.kind, knob.name)]!r} in another row")
        seen[(knob.kind, knob.name)] = knob.value
        rows.append(LaunchRule(knob.kind, knob.name, knob.value, ops=ops, backends=backends,
                               routed=s.get("routed", r.boolean), why=s.get("why", r.text)))
    return tuple(rows)


def _selects(r, node, where: str, registry) -> tuple:
    """SGLang flag values that name a capdispatch backend (one, or one per device family)."""
    rows = []
    for w, snode in r.rows(node, where):
        s = r.fields(snode, w, **_SELECT_KEYS)
        op = _op(r, s["op"], w, registry)
        if _one_of(r, s, snode, w, ("backend", "backends")) == "backend":
            backend, per = _backend(r, s["backend"], w, op, registry), ()
        else:
            per = _by_family(r, s["backends"], s.where("backends"), other=False,
                             backends=[b.name for b in registry.backends(op)], op=op)
            backend = None
        row = Select(r.text(s["field"], s.where("field")), r.text(s["value"], s.where("value")), op, backend, per)
        if any(o.field == row.field and o.value == row.value for o in rows):
            raise r.err(snode, f"{w}: {row.field}={row.value} is mapped twice")
        rows.append(row)
    return tuple(rows)


def _by_family(r, node, where: str, *, other: bool, backends=None, op: str = "") -> tuple:
    """((family, name), ...) of a mapping of device families (sm90, sm120, ...; OTHER: also
    `other`, any family not listed, and null names); BACKENDS: the names it takes."""
    families = "sm90, sm100, sm120, ..." + (", other" if other else "")
    pairs = r.mapping(node, where)
    if not pairs:
        raise r.err(node, f"{where}: expected a mapping of device families ({families}), found an empty one")
    out = []
    for fam, knode, vnode in pairs:
        if not (other and fam == "other" or fam.startswith("sm") and fam[2:].isdigit()):
            raise r.err(knode, f"{where}: {fam!r} is not a device family; expected a mapping of device "
                               f"families ({families})")
        name = r.text(vnode, f"{where}.{fam}", null=other)
        if name is not None and backends is not None:
            r.name(vnode, f"{where}.{fam}", backends, noun="backend", of=f" for {op}")
        out.append((fam, name))
    return tuple(out)


def _native_by(r, node, where: str, op: str, registry):
    """The moe route's `native_by`: per launch value of one SGLang field, the method SGLang
    builds on each card family and the capdispatch backend whose kernel it runs."""
    f = r.fields(node, where, required=("field", "default", "values", "methods"), optional={"why": None})
    backends = [b.name for b in registry.backends(op)]
    values = [(v, _by_family(r, vn, f"{where}.values.{v}", other=True, backends=backends, op=op))
              for v, _, vn in r.mapping(f["values"], f.where("values"))]
    if not values:
        raise r.err(f["values"], f"{where}.values: expected a mapping of launch values to device families")
    methods = r.mapping(f["methods"], f.where("methods"))
    if {v for v, _, _ in methods} != {v for v, _ in values}:
        raise r.err(f["methods"], f"{where}.methods: expected one SGLang method name per value of `values` "
                                  f"({', '.join(v for v, _ in values)})")
    why = r.mapping(f["why"], f.where("why")) if f.get("why") is not None else ()
    return NativeBy(r.text(f["field"], f.where("field"), nonempty=True),
                    _by_family(r, f["default"], f.where("default"), other=True), tuple(values),
                    tuple((v, r.text(m, f"{where}.methods.{v}") if r.is_scalar(m) else
                           _by_family(r, m, f"{where}.methods.{v}", other=True)) for v, _, m in methods),
                    tuple((v, " ".join(r.text(t, f"{where}.why.{v}").split())) for v, _, t in why))


def _routes(r, node, where: str, registry) -> tuple:
    """Call sites a rank can route to the bound capdispatch kernel; targets and names unique."""
    rows = []
    for w, rnode in r.rows(node, where):
        row = _route(r, rnode, w, registry)
        if any(o.target == row.target for o in rows):
            raise r.err(rnode, f"{w}: {row.target} is routed twice")
        if any(o.name == row.name for o in rows):
            raise r.err(rnode, f"{w}: route name {row.name!r} is used twice")
        rows.append(row)
    return tuple(rows)


def _route(r, node, w: str, registry) -> Route:
    f = r.fields(node, w, **_ROUTE_KEYS)
    op = _op(r, f["op"], w, registry)
    native = f.get("native", r.text)
    if native is not None:
        _backend(r, f["native"], w, op, registry)
    row = Route(op, r.text(f["target"], f.where("target"), nonempty=True),
                _call(r, f["call"], f.where("call")), native, f.get("why", r.text),
                f.get("cc", lambda n, what: _spec(r, n, what)), _env(r, f.get("env"), f.where("env")),
                r.text(f["name"], f.where("name"), nonempty=True),
                f.get("runner", lambda n, what: _setting(r, n, what)),
                f.get("prepare", lambda n, what: _prepare(r, n, what)))
    nb = f.get("native_by")      # moe: SGLang's method depends on a launch-wide value
    return row if nb is None else attrs.evolve(row, native_by=_native_by(r, nb, f.where("native_by"), op, registry))


def _call(r, node, where: str) -> str:
    """A route's call wrapper: one of routes.CALLS (each with its release's SGLang parameters)."""
    from .routes import CALLS
    return r.name(node, where, list(CALLS), noun="call wrapper")


def _env(r, node, where: str) -> tuple:
    """((NAME, value), ...): environment names and their text values."""
    out = []
    for name, _, vnode in (r.mapping(node, where) if node is not None else ()):
        value = r.scalar(vnode, f"{where}.{name}")
        if not isinstance(value, str):
            raise r.err(vnode, f"{where}: expected a mapping of environment names to string values, "
                               f"found {name}: {value!r} (quote it)")
        out.append((name, value))
    return tuple(out)


def _prepare(r, node, where: str) -> str:
    text = r.text(node, where, need="'module:function'")
    if text.count(":") != 1:
        raise r.err(node, f"{where}: expected 'module:function', got {text!r}")
    return text


def _entries(r, node, where: str, registry, routes) -> tuple:
    """(op, backend) -> Entry, and op -> the line of its table (for messages)."""
    by_name = {rt.name: rt for rt in routes}
    entries, lines = {}, {}
    for op, knode, per in (r.mapping(node, where) if node is not None else ()):
        w = f"{where}.{op}"
        _op(r, knode, w, registry)
        lines[op] = r.line(per)
        for backend, bknode, enode in r.mapping(per, w):
            we = f"{w}.{backend}"
            _backend(r, bknode, we, op, registry)
            entries[(op, backend)] = _entry(r, enode, we, op, backend, by_name, routes)
    return entries, lines


def _entry(r, node, where: str, op: str, backend: str, by_name: dict, routes=()) -> Entry:
    """How one (op, backend) runs inside SGLang: its settings, its routes, or none."""
    e = r.fields(node, where, optional=_ENTRY_KEYS)
    kind = _one_of(r, e, node, where, ENTRY_KINDS)
    settings, routes_ = (), ()
    if kind == "sglang":
        items = r.sequence(e["sglang"], e.where("sglang"))
        settings = tuple(_setting(r, x, f"{where}.sglang[{j}]") for j, x in enumerate(items))
    elif kind == "route":
        routes_ = r.names(e["route"], e.where("route"), list(by_name), noun="route")
        for name, rnode in zip(routes_, r.sequence(e["route"], e.where("route"), one_is_list=True)):
            if by_name[name].op != op:
                raise r.err(rnode, f"{where}.route: route {name!r} is a {by_name[name].op} site, not a {op} one")
    elif r.boolean(e["none"], e.where("none")) is not True:
        raise r.err(e["none"], f"{where}.none: expected true, got false")
    needs = ()
    if e.get("needs") is not None:
        needs = _needs(r, e["needs"], e.where("needs"), op, backend, kind, routes)
    return Entry(op, backend, kind, settings, routes_, e.get("why", r.text), r.line(node), needs)


def _needs(r, node, where: str, op: str, backend: str, kind: str, routes) -> tuple:
    """An entry's `needs`: what SGLang's own kernel needs, as requirement records. Only for
    SGLang's own kernel (kind sglang) at a site whose `native` is this backend, or whose
    `native_by` names it for some launch value and card family."""
    if kind != "sglang":
        raise r.err(node, f"{where}: only an entry SGLang runs itself (sglang: [...]) says what SGLang's "
                          f"own kernel needs; this one is a {kind} entry")
    sites = [rt for rt in routes if rt.op == op and (rt.native == backend and rt.native_by is None
                                                     or rt.native_by is not None and rt.native_by.names(backend))]
    if not sites:
        natives = ", ".join(sorted({f"{rt.name}: {rt.native}" for rt in routes
                                    if rt.op == op and rt.native is not None and rt.native_by is None}
                                   | {f"{rt.name}: {b} (native_by)" for rt in routes
                                      if rt.op == op and rt.native_by is not None
                                      for _, per in rt.native_by.values for _, b in per if b})) or "none"
        raise r.err(node, f"{where}: no {op} route names {backend} as its native kernel, so no SGLang call "
                          f"site runs it (valid: an entry of a route's native backend, or of one its "
                          f"native_by names; {op} routes' natives: {natives})")
    items = r.sequence(node, where)
    if not items:
        raise r.err(node, f"{where}: expected a list of requirements ({', '.join(_NEED_KINDS)}), found an "
                          f"empty one")
    out = [_need(r, item, f"{where}[{i}]") for i, item in enumerate(items)]
    if not any(isinstance(x, extend.Library) for x in out):
        raise r.err(node, f"{where}: names no library (give the distribution SGLang's kernel comes from: "
                          f"{{library: DIST, version: RANGE, module: MODULE}})")
    return tuple(out)


def _need(r, node, where: str):
    """One requirement: {library: DIST, version: RANGE, module: MODULE}, {feature: NAME},
    {any_feature: [NAME, ...]}, {cc: RANGE} or {platform: cuda|cpu}."""
    from packaging.utils import canonicalize_name
    keys = [k for k, _, _ in r.mapping(node, where, valid=tuple(_NEED_KINDS))]
    kind = next((k for k in keys if k in _NEED_KINDS), None)
    if kind is None:
        raise r.err(node, f"{where}: give one of {', '.join(_NEED_KINDS)} (e.g. {{library: sglang-kernel, "
                          f"version: \">=0.4.5,<0.4.6\", module: sgl_kernel.flash_mla}})")
    f = r.fields(node, where, required=(kind,), optional=_NEED_KINDS[kind])
    known = list(extend.feature_names())
    if kind == "library":
        dist = r.text(f["library"], f.where("library"), need="a distribution name", nonempty=True)
        if canonicalize_name(dist) != dist:
            raise r.err(f["library"], f"{where}.library: {dist!r} is not a distribution's canonical name "
                                      f"(valid: {canonicalize_name(dist)!r})")
        if "module" not in f:
            raise r.err(node, f"{where}: missing 'module' (the module SGLang imports from {dist}: a real "
                              f"rank checks that it imports)")
        spec = _range(r, f["version"], f.where("version"), "a version range", "'>=0.4.5,<0.4.6'") \
            if "version" in f else ""
        return extend.Library(dist, spec, module=r.text(f["module"], f.where("module"), need="a dotted module name",
                                                        nonempty=True))
    if kind == "feature":
        return extend.Feature(r.name(f["feature"], f.where("feature"), known, noun="device feature"))
    if kind == "any_feature":
        names = r.names(f["any_feature"], f.where("any_feature"), known, noun="device feature")
        return extend.AnyFeature(tuple(names))
    if kind == "cc":
        return extend.ComputeCapability(_range(r, f["cc"], f.where("cc"), "a compute-capability range",
                                               "'>=9.0,<11.0'"))
    return extend.Platform(r.choice(f["platform"], f.where("platform"), ("cuda", "cpu")))


def _range(r, node, where: str, what: str, example: str) -> str:
    """A version range as written (SpecifierSet would reorder it), checked."""
    text = r.text(node, where, need=f"{what} such as {example}", nonempty=True)
    try:
        SpecifierSet(text)
    except InvalidSpecifier:
        raise r.err(node, f"{where}: {text!r} is not {what} (e.g. {example})") from None
    return text


def _unmapped(r, models: dict, entries: dict, lines: dict, where: str, models_where: str, registry) -> tuple:
    """A built-in backend of a model op without an entry is an error of the packaged map; a
    plugin's is reported (its name and the entry to add) and its decisions are not carried out."""
    from_plugin = {b: p.name for p in registry.plugins if p.ok for b in p.backends}
    out = []
    for op in dict.fromkeys(op for m in models.values() for op in m.ops):
        missing = [b.name for b in registry.backends(op) if (op, b.name) not in entries]
        builtin = [b for b in missing if f"{op}/{b}" not in from_plugin]
        if builtin:
            raise r.err(lines.get(op), f"{where}.{op}: no entry for {op} backend(s) {', '.join(builtin)} "
                                       f"(every backend of a model op needs one: sglang, route or none; e.g. "
                                       f"{builtin[0]}: {{none: true, why: \"...\"}})")
        at = f"{r.path}:{lines[op]}" if op in lines else r.path
        out += [Unmapped(op, b, from_plugin[f"{op}/{b}"], (
            f"the knob map has no entry for {op} backend {b} (plugin {from_plugin[f'{op}/{b}']!r}): add "
            f"`{b}: {{none: true, why: \"...\"}}` (or sglang: [...], or route: [NAME]) under "
            f"{where}.{op} ({at}); until then a decision for it is reported, "
            f"not carried out inside SGLang")) for b in missing]
    # A plugin's op no model lists: decided at the launch and reported, with what to add.
    listed = {op for m in models.values() for op in m.ops}
    for op in registry.ops:
        names = [f"{op}/{b.name}" for b in registry.backends(op)]
        if op in listed or not names or not all(n in from_plugin for n in names):
            continue
        plugin = from_plugin[names[0]]
        said = extend.model_calls(next(iter(models))).not_called(op) if models else \
            f"no model of {models_where} calls op {op!r}"
        message = (f"op {op} (plugin {plugin!r}): {said}, and an entry per backend under {where}.{op} "
                   f"({r.path}); until then a decision for it is reported, not carried out inside SGLang")
        out += [Unmapped(op, n.split("/", 1)[1], plugin, message) for n in names]
    return tuple(out)


def _arch(r, node, where: str) -> dict:
    """SGLang's architecture facts to correct, as plain data; every fact named is a probe
    of the table or sm/cc."""
    f = r.fields(node, where, required=_ARCH_KEYS)
    facts = {probe for probe, _, _ in r.mapping(f["probes"], f.where("probes"))} | {"sm", "cc"}
    for fact, _, pnode in r.mapping(f["platform"], f.where("platform")):
        probe = r.text(pnode, f"{where}.platform.{fact}")
        if probe not in facts:
            raise r.err(pnode, f"{where}.platform.{fact}: {probe!r} is not a probe or sm/cc")
    for w, gnode in r.rows(f["globals"], f.where("globals")):
        g = r.fields(gnode, w, required=("module", "name", "fact"))
        fact = r.text(g["fact"], g.where("fact"))
        if fact not in facts:
            raise r.err(g["fact"], f"{w}: fact {fact!r} is not a probe or sm/cc")
    return r.plain(node, where)
