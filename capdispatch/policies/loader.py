"""Policy files: read with the marked YAML reader (capdispatch.marked_yaml), checked
against the registry's ops and backends, with file:line and a did-you-mean in every error.
"""
from __future__ import annotations

import re
from typing import Optional
from importlib import resources

import attrs
import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from .. import marked_yaml
from ..errors import CapdispatchError
from ..marked_yaml import Reader, did_you_mean, line_of
from ..marked_yaml import show as _show

MIXED_GROUP = ("allow", "warn", "uniform", "error")
ON_UNSUPPORTED = ("downgrade", "error")
VERIFY = ("off", "warn", "required")
SETTINGS = {"mixed_group": MIXED_GROUP, "on_unsupported": ON_UNSUPPORTED, "verify": VERIFY}
TOP_KEYS = ("schema", "mixed_group", "on_unsupported", "verify", "ops", "devices")
DEVICE_KEYS = ("match", "measured_with", "ops")
MATCH_KEYS = ("id", "name", "cc")
MAX_BYTES = 1 << 20          # a policy is a few dozen lines; refuse more than 1 MiB unread
MAX_VALUES = marked_yaml.MAX_VALUES
MAX_DEPTH = marked_yaml.MAX_DEPTH    # nesting beyond any valid policy (whose deepest value is 5 levels in)
_KIND = "policy file"
_DEPTH_HINT = "a policy is at most 5 (ops -> op -> list, devices -> entry -> ops -> op -> list)"

# A device id in a policy: cuda:N, cpu or sim:NAME; `@N` names the copy at group
# position N when a card is given twice; `rankN:` the rank of a distributed group.
_ID = re.compile(r"(rank\d+:)?(cuda:\d+|cpu|sim:[A-Za-z0-9_.-]+)(@\d+)?", re.ASCII)
# A compute capability ("8.6") or a range of them (">=8.9,<13.0", "!=9.0", "==12.*").
# A compute capability's minor number is one digit (8.6, 12.0): `8.60` compares as the
# version 8.60, which no card has, so an entry with it would validate and never match.
_CC_CLAUSE = re.compile(r"\s*(==|!=|<=|>=|<|>|~=)?\s*\d{1,3}(\.\d)?(\.\*)?\s*", re.ASCII)
_CC_LONG_MINOR = re.compile(r"(\d{1,3})\.(\d{2,})", re.ASCII)


class PolicyError(CapdispatchError, ValueError):
    """A policy that cannot be used, with where and why."""

    def __init__(self, file: str, line: Optional[int], message: str):
        self.file, self.line, self.bare = file, line, message
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: {message}")


def _reader(text: str, path: str) -> Reader:
    return Reader(path, text, error=PolicyError, kind=_KIND, depth_hint=_DEPTH_HINT)


_SM = re.compile(r"sm_?(\d{1,2})(\d)[af]?", re.ASCII | re.IGNORECASE)


def cc_spec(text: str) -> Optional[SpecifierSet]:
    """'8.6' -> ==8.6; '>=8.9,<13' -> that range; 'sm_86' (as --device sim:sm_86 takes it,
    also in a range: '>=sm_89') -> 8.6; None when TEXT is none of these."""
    text = _SM.sub(lambda m: f"{int(m.group(1))}.{m.group(2)}", str(text)).strip()
    if not text or not all(_CC_CLAUSE.fullmatch(part) for part in text.split(",")):
        return None
    spec = text if text[0] in "<>=!~" else f"=={text}"
    try:
        return SpecifierSet(spec)
    except InvalidSpecifier:
        return None


def id_forms(device_id: str) -> set:
    """The ids a policy may use for a device: its own, and without `@N` / `rankN:`."""
    m = _ID.fullmatch(device_id)
    if not m:
        return {device_id}
    rank, base, copy = m.group(1) or "", m.group(2), m.group(3) or ""
    return {device_id, base, base + copy, rank + base}


@attrs.frozen
class Marked:
    value: object
    line: int


@attrs.frozen
class Bucket:
    """One size bucket of an op's preference: sizes up to UPPER (inclusive) above the
    previous bucket's bound; UPPER None is the catch-all."""
    upper: Optional[int]
    backends: tuple
    line: int
    # Backends the calibration could not run on its card: each takes its default place
    # among BACKENDS, and running past one that cannot run here is no fallback.
    unmeasured: tuple = ()

    def describe(self, key: str, lower: Optional[int] = None) -> str:
        if self.upper is None:
            return f"{key} > {lower}" if lower is not None else f"any {key}"
        return f"{key} <= {self.upper}"


@attrs.frozen
class OpPreference(Marked):
    """An op's preference in one layer. VALUE is the catch-all list (every size when
    BUCKETS is empty); BUCKETS, when given, ascend by bound and end with the catch-all.
    UNMEASURED: the catch-all's (Bucket.unmeasured)."""
    buckets: tuple = ()
    unmeasured: tuple = ()


@attrs.frozen
class DeviceEntry:
    match: dict           # key -> str, as written
    ops: dict             # op -> OpPreference
    line: int
    catalog_key: Optional[str] = None   # the catalog entry a `name` match names, if any
    # A calibration's libraries (name -> version, or "absent"): serving with others warns.
    measured_with: Optional[dict] = attrs.field(default=None, eq=False)

    def matches(self, device) -> bool:
        for key, want in self.match.items():
            if key == "id":
                if want not in id_forms(device.id):
                    return False
            elif key == "name":
                w = want.strip().lower()
                by_key = self.catalog_key is not None and device.catalog_key == self.catalog_key
                if not by_key and w not in (device.name.lower(), (device.catalog_key or "").lower()):
                    return False
            elif key == "cc":
                spec = cc_spec(want)
                if device.cc is None or spec is None:
                    return False
                if device.cc_str not in spec:
                    return False
        return True

    def describe(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.match.items())


@attrs.frozen
class PolicyFile:
    path: str
    mixed_group: Optional[Marked] = None
    on_unsupported: Optional[Marked] = None
    verify: Optional[Marked] = None
    ops: dict = attrs.field(factory=dict)          # op -> OpPreference
    devices: tuple = ()                            # DeviceEntry...
    builtin: bool = False


def load_marked(text: str, path: str):
    """Plain YAML (strings, numbers, booleans, null, lists, mappings; anchors and
    aliases allowed) as MarkedMap / MarkedList / scalars, so a checker can say
    file:line. Duplicate keys and other tags are refused with PolicyError(path, line, ...)."""
    return marked_yaml.load_marked(text, path, error=PolicyError)


def parse(text: str, path: str, registry, *, known_devices=(), builtin: bool = False) -> PolicyFile:
    """Parse and check one policy document against REGISTRY's ops and backends."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(path, text.count(b"\n", 0, exc.start) + 1,
                              f"not UTF-8 text (byte {text[exc.start]:#04x} at offset {exc.start}); "
                              f"policy files are UTF-8 YAML") from None
    if not isinstance(text, str):
        raise PolicyError(str(path), None, f"a policy is YAML text, not a {type(text).__name__}")
    r = _reader(text, path)
    root = r.root()
    if root is None or r.is_null(root) and not root.value.strip() and r.explicit_tag(root) is None:
        # A file that says nothing is a mistake more often than a choice (a truncated write,
        # the wrong path in CAPDISPATCH_POLICY); a policy that changes nothing says `schema: 1`.
        raise PolicyError(path, None, "the file holds no policy (it is empty or only comments); "
                                      "write `schema: 1` for a policy that changes nothing")
    top = r.fields(root, "the policy", optional=TOP_KEYS, top=True)
    fields = {}
    for key in top:          # in file order: the first mistake is the one reported
        if key == "schema":
            _schema(r, top[key])
        elif key in SETTINGS:
            # YAML 1.1 reads a bare `off` as false: for `verify` it is the choice `off`.
            v = r.choice(top[key], key, SETTINGS[key], false_is="off" if key == "verify" else None)
            fields[key] = Marked(v, line_of(top[key]))
        elif key == "ops":
            fields["ops"] = _ops(r, top[key], registry, "ops")
        else:
            fields["devices"] = tuple(_devices(r, top[key], registry, known_devices))
    return PolicyFile(path=path, builtin=builtin, **fields)


def _schema(r: Reader, node) -> None:
    v = r.scalar(node, "schema", valid="1")
    if type(v) is not int or v != 1:   # bool is an int subclass: `schema: true` is not 1
        raise r.err(node, f"schema {_show(node.value)[1:-1] if v is not None else '(empty)'} "
                          f"is not supported (valid: 1)")


def _ops(r: Reader, node, registry, what: str) -> dict:
    out = {}
    for op, knode, vnode in r.mapping(node, what, valid=tuple(registry.ops)):
        if op not in registry.ops:
            raise r.err(knode, f"unknown op {_show(op)}{did_you_mean(op, registry.ops)} "
                               f"(valid: {', '.join(registry.ops)})")
        if r.is_null(vnode):
            valid = [b.name for b in registry.backends(op)]
            raise r.err(vnode, f"{what}.{op} is empty; name at least one backend "
                               f"(valid: {', '.join(valid)})")
        items = r.sequence(vnode, f"{what}.{op}", one_is_list=True)    # `op: torch` is a list of one
        if any(isinstance(i, yaml.MappingNode) for i in items):
            out[op] = _buckets(r, vnode, items, registry, op, f"{what}.{op}")
        else:
            out[op] = OpPreference(_names(r, vnode, items, registry, op, f"{what}.{op}"), line_of(vnode))
    return out


def _names(r: Reader, node, items, registry, op: str, what: str) -> tuple:
    names = []
    valid = [b.name for b in registry.backends(op)]
    for item in items:
        name = r.scalar(item, f"a backend of {op}", valid=", ".join(valid))
        if not isinstance(name, str) or name not in valid:
            shown = _show(item.value) if name is not None else "an empty entry"
            raise r.err(item, f"unknown backend {shown} for op {op}"
                              f"{did_you_mean(item.value, valid)} (valid: {', '.join(valid)})")
        if name in names:
            raise r.err(item, f"backend {name!r} listed twice for op {op}")
        names.append(name)
    if not names:
        raise r.err(node, f"{what}: the list is empty; name at least one backend")
    return tuple(names)


_BOUND = re.compile(r"<=\s*(\d{1,12})", re.ASCII)


def _buckets(r: Reader, node, items, registry, op: str, what: str) -> OpPreference:
    """`- {tokens: "<=16", prefer: [...]}` ... `- {prefer: [...]}`: ascending bounds, one
    catch-all, last."""
    size = registry.ops[op].size
    if size is None:
        raise r.err(node, f"{what}: op {op} takes no size buckets; give a plain list of backends")
    key = size.key
    other = "tokens" if key == "rows" else "rows"
    hint = f"; {op} buckets on {key} (the leading dimension of its argument {size.name!r})"
    buckets = []
    for i, item in enumerate(items):
        where = f"{what}[{i}]"
        if not isinstance(item, yaml.MappingNode):
            raise r.err(item, f"{where}: {_show(r.scalar(item, where))} is a backend name in a list of "
                              f"buckets; write every entry as a bucket, e.g. {{{key}: \"<=16\", "
                              f"prefer: [...]}}, the last one {{prefer: [...]}}")
        body = r.fields(item, where, optional=(key, "prefer", "unmeasured"),
                        hint=lambda k: hint if k == other else "")
        if "prefer" not in body:
            raise r.err(item, f"{where}: needs 'prefer', the backends for this bucket in order")
        prefer = _names(r, body["prefer"], r.sequence(body["prefer"], f"{where}.prefer", one_is_list=True),
                        registry, op, f"{where}.prefer")
        unmeasured = ()
        if "unmeasured" in body:
            unode = body["unmeasured"]
            unmeasured = _names(r, unode, r.sequence(unode, f"{where}.unmeasured", one_is_list=True),
                                registry, op, f"{where}.unmeasured")
            both = [n for n in unmeasured if n in prefer]
            if both:
                raise r.err(unode, f"{where}.unmeasured: {both[0]!r} is also in 'prefer'; a "
                                   f"backend is either measured (prefer) or not (unmeasured)")
        upper = _bound(r, body[key], f"{where}.{key}", key) if key in body else None
        line = line_of(item)
        if buckets and buckets[-1].upper is None:
            raise r.err(item, f"{where}: comes after the catch-all bucket (line {buckets[-1].line}), "
                              f"so it would never apply; the catch-all (no {key}) goes last")
        if upper is not None and buckets and upper <= buckets[-1].upper:
            prev = buckets[-1]
            how = "repeats" if upper == prev.upper else "is below"
            raise r.err(body[key], f"{where}.{key}: \"<={upper}\" {how} the bound of the bucket before it "
                                   f"(\"<={prev.upper}\", line {prev.line}); buckets go in increasing order "
                                   f"of their bounds, each taking the sizes above the previous bound")
        buckets.append(Bucket(upper, prefer, line, unmeasured))
    if not buckets:
        raise r.err(node, f"{what}: the list is empty; name at least one backend")
    if buckets[-1].upper is not None:
        raise r.err(node, f"{what}: no catch-all bucket for {key} above {buckets[-1].upper}; "
                          f"end the list with {{prefer: [...]}} (a bucket without {key})")
    return OpPreference(buckets[-1].backends, buckets[-1].line,
                        buckets=tuple(buckets) if len(buckets) > 1 else (), unmeasured=buckets[-1].unmeasured)


def _bound(r: Reader, node, what: str, key: str) -> int:
    """A bucket's bound: "<=N"."""
    raw = r.scalar(node, what, valid='"<=N" with N a whole number >= 1')
    m = _BOUND.fullmatch(str(raw).strip()) if isinstance(raw, str) else None
    if m is None or int(m.group(1)) < 1:
        raise r.err(node, f"{what}: {_show(raw)} is not a bucket bound (valid: \"<=N\" with N a "
                          f"whole number >= 1, e.g. \"<=16\"; leave {key} out for the catch-all)")
    return int(m.group(1))


_MATCH_NEED = {"cc": 'a compute capability or range, e.g. "8.6", "sm_86", ">=8.9", ">=12.0,<13.0"',
               "name": "a catalog key such as rtx-5090, or the name the driver reports",
               "id": "a device id: cuda:N, cpu or sim:NAME"}


def _devices(r: Reader, node, registry, known_devices):
    for i, item in enumerate(r.sequence(node, "devices", one_is_list=True)):
        where = f"devices[{i}]"
        body = r.fields(item, where, optional=DEVICE_KEYS)
        if "match" not in body:
            raise r.err(item, f"{where}: needs a 'match' (by id, name or cc)")
        match, catalog_key = _match(r, body["match"], f"{where}.match", known_devices)
        ops = _ops(r, body["ops"], registry, f"{where}.ops") if "ops" in body else {}
        measured = None
        if "measured_with" in body:
            measured = {}
            for lib, _, vn in r.mapping(body["measured_with"], f"{where}.measured_with"):
                measured[lib] = r.text(vn, f"{where}.measured_with.{lib}", nonempty=True,
                                       need='a version such as "2.11.0", or "absent"').strip()
        yield DeviceEntry(match=match, ops=ops, line=line_of(item), catalog_key=catalog_key,
                          measured_with=measured)


def _match(r: Reader, node, what: str, known_devices) -> tuple:
    """A device entry's `match`: key -> text as written, and the catalog key a name names."""
    match, catalog_key = {}, None
    given = r.fields(node, what, optional=MATCH_KEYS)
    for key in given:
        vn = given[key]
        value = r.text(vn, f"{what}.{key}", need=_MATCH_NEED[key], nonempty=True).strip()
        long_minor = _CC_LONG_MINOR.search(value) if key == "cc" else None
        if long_minor:
            major, minor = long_minor.groups()
            fix = f"{major}.{minor.rstrip('0') or '0'}"
            mean = f'; did you mean "{value.replace(long_minor.group(0), fix, 1)}"?' if len(fix) - len(major) == 2 else ""
            raise r.err(vn, f"{what}.cc: {_show(value)}: a compute capability's minor number is one digit "
                            f"({long_minor.group(0)} reads as the version {long_minor.group(0)}, which no card has){mean} (valid: e.g. \"8.6\", "
                            f"\"12.0\", \">=8.9\")")
        if key == "cc" and cc_spec(value) is None:
            raise r.err(vn, f"{what}.cc: {_show(value)} is not a compute capability "
                            f"or range (e.g. \"8.6\", \"sm_86\", \">=8.9\", \">=12.0,<13.0\")")
        if key == "name" and known_devices:
            if value.lower() not in known_devices:
                raise r.err(vn, f"{what}.name: unknown device {_show(value)}"
                                f"{did_you_mean(value.lower(), known_devices)} "
                                f"(a catalog key such as rtx-5090, or the name the driver reports)")
            if isinstance(known_devices, dict):
                catalog_key = known_devices[value.lower()]
        if key == "id" and not _ID.fullmatch(value):
            hint = "; a card given twice is named by its group position, sim:NAME@N" if "#" in value else ""
            raise r.err(vn, f"{what}.id: {_show(value)} is not a device id{hint} "
                            f"(valid: cuda:N, cpu, sim:NAME, each optionally with @N, the "
                            f"position of a card given more than once)")
        match[key] = value
    if not match:
        raise r.err(node, f"{what} is empty; match by id, name or cc")
    return match, catalog_key


def load_file(path, registry, *, known_devices=()) -> PolicyFile:
    """Read and check one policy file: at most MAX_BYTES of UTF-8 YAML."""
    return parse(read_text(path), marked_yaml.display(path), registry, known_devices=known_devices)


def read_text(path) -> str:
    """The text of policy file PATH; every way of failing is a PolicyError naming it."""
    return marked_yaml.read_text(path, limit=MAX_BYTES, kind=_KIND, error=PolicyError,
                                 hint="a policy is a short YAML file")


def load_default(registry) -> PolicyFile:
    text = resources.files("capdispatch.policies").joinpath("default.yaml").read_text("utf-8")
    return parse(text, "default.yaml", registry, builtin=True)


def from_dict(data, origin: str, registry, *, known_devices=()) -> PolicyFile:
    """An in-memory policy with the schema of a policy file (`ops`, `devices`,
    `mixed_group`, `on_unsupported`, `verify`), checked as a file is. ORIGIN names it in
    every trace and error (it has no lines), e.g. "sglang --moe-runner-backend X"."""
    if not isinstance(data, dict):
        raise PolicyError(origin, None, f"expected a mapping, got {type(data).__name__}")
    try:
        text = yaml.safe_dump(data, sort_keys=False)
    except yaml.YAMLError as exc:
        raise PolicyError(origin, None, f"not plain data: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # e.g. an int too long to write (10**5000), or nesting past the recursion limit
        raise PolicyError(origin, None, f"not plain data: {type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0][:120] if str(exc) else ''}") from None
    try:
        pf = parse(text, origin, registry, known_devices=known_devices)
    except PolicyError as exc:    # the lines of a dump mean nothing to the caller
        raise PolicyError(origin, None, exc.bare) from None

    def unmark(m):
        if m is None:
            return None
        buckets = getattr(m, "buckets", ())
        if buckets:
            return attrs.evolve(m, line=0, buckets=tuple(attrs.evolve(b, line=0) for b in buckets))
        return attrs.evolve(m, line=0)
    return attrs.evolve(
        pf, mixed_group=unmark(pf.mixed_group), on_unsupported=unmark(pf.on_unsupported),
        verify=unmark(pf.verify),
        ops={op: unmark(m) for op, m in pf.ops.items()},
        devices=tuple(attrs.evolve(e, ops={op: unmark(m) for op, m in e.ops.items()}, line=0)
                      for e in pf.devices))
