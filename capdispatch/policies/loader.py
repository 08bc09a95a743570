"""Policy files: PyYAML's safe loader with line marks, schema checks, did-you-mean.

The loader builds Python values from YAML nodes itself so every value keeps the
line it came from; scalars are constructed by the safe constructor, so any tag
outside YAML's core schema (`!!python/object`, ...) is refused.
"""
from __future__ import annotations

import difflib
import os
import re
from typing import Optional

import attrs
import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from ..errors import CapdispatchError

MIXED_GROUP = ("allow", "warn", "uniform", "error")
ON_UNSUPPORTED = ("downgrade", "error")
VERIFY = ("off", "warn", "required")
SETTINGS = {"mixed_group": MIXED_GROUP, "on_unsupported": ON_UNSUPPORTED, "verify": VERIFY}
TOP_KEYS = ("schema", "mixed_group", "on_unsupported", "verify", "ops", "devices")
DEVICE_KEYS = ("match", "measured_with", "ops")
MATCH_KEYS = ("id", "name", "cc")
MAX_BYTES = 1 << 20          # a policy is a few dozen lines; refuse more than 1 MiB unread
MAX_VALUES = 100_000        # values of a load_marked document with its aliases expanded
MAX_DEPTH = 64               # nesting beyond any valid policy (whose deepest value is 5 levels in)

# A device id in a policy: cuda:N, cpu or sim:NAME; `@N` names the copy at group
# position N when a card is given twice; `rankN:` the rank of a distributed group.
_ID = re.compile(r"(rank\d+:)?(cuda:\d+|cpu|sim:[A-Za-z0-9_.-]+)(@\d+)?", re.ASCII)
# A compute capability ("8.6") or a range of them (">=8.9,<13.0", "!=9.0", "==12.*").
_CC_CLAUSE = re.compile(r"\s*(==|!=|<=|>=|<|>|~=)?\s*\d{1,3}(\.\d{1,3})?(\.\*)?\s*", re.ASCII)


class PolicyError(CapdispatchError, ValueError):
    """A policy that cannot be used, with where and why."""

    def __init__(self, file: str, line: Optional[int], message: str):
        self.file, self.line, self.bare = file, line, message
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: {message}")


def did_you_mean(value: str, valid) -> str:
    """"; did you mean 'x'?" for the closest of VALID, or ""."""
    close = difflib.get_close_matches(str(value)[:200], list(valid), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""




def _show(value, limit: int = 80) -> str:
    """VALUE as an error message quotes it: repr, cut to LIMIT characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-4:]} ({len(text)} characters)"


def _char(c) -> str:
    """A character YAML refused, as a message shows it ('\\x00', U+FFFE)."""
    c = chr(c) if isinstance(c, int) else str(c)
    return repr(c) if c.isprintable() else f"{ascii(c)} (U+{ord(c[:1] or chr(0)):04X})"


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


class _Reader:
    def __init__(self, path: str, text: str):
        self.path = path
        self.text = text
        self._own = {}      # id(mapping node) -> its own key nodes, once merge keys are flattened

    def err(self, node_or_line, message: str) -> PolicyError:
        line = node_or_line if isinstance(node_or_line, int) or node_or_line is None \
            else node_or_line.start_mark.line + 1
        return PolicyError(self.path, line, message)

    def root(self):
        try:
            loader = yaml.SafeLoader(self.text)
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark else None
            raise PolicyError(self.path, line, f"malformed YAML: {exc.problem or exc.context}") from None
        except yaml.reader.ReaderError as exc:
            line = self.text.count("\n", 0, exc.position) + 1
            raise PolicyError(self.path, line,
                              f"character {_char(exc.character)} is not allowed in YAML (policy files "
                              f"are UTF-8 text without control characters)") from None
        except yaml.YAMLError as exc:
            raise PolicyError(self.path, None, f"malformed YAML: {exc}") from None
        except RecursionError:
            raise PolicyError(self.path, None, f"malformed policy: nested too deeply to read "
                                               f"(a policy is at most {MAX_DEPTH} levels deep)") from None
        self._loader = loader
        if node is not None:
            _check_depth(self, node)
        return node

    def explicit_tag(self, node) -> Optional[str]:
        """The tag NODE was written with (`!!bool`, `!foo`), or None when it has none."""
        text, i = self.text, node.start_mark.index
        if text.startswith("&", i):        # an anchor comes before the tag
            i += 1
            while i < len(text) and not text[i].isspace():
                i += 1
            while i < len(text) and text[i] in " \t":
                i += 1
        return _short_tag(node.tag) if text.startswith("!", i) else None

    def scalar(self, node, what: str, valid: str = ""):
        """The value of scalar NODE at WHAT; VALID, when given, says what WHAT takes."""
        self._check_tag(node, what)
        if not isinstance(node, yaml.ScalarNode):
            raise self.err(node, f"{what} must be a single value, not a {_kind(node)}")
        tag = self.explicit_tag(node)
        kind = node.tag.rpartition(":")[2]
        takes = f"; {what} takes {valid}" if valid else ""
        if tag is not None and kind == "null" and node.value.strip() not in _NULL_FORMS:
            raise self.err(node, f"{what}: {tag} {_show(node.value)} is not a null (valid for {tag}: "
                                 f"~, null or nothing){takes}")
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise self.err(node, f"{what}: {exc}") from None
        except (ValueError, TypeError, LookupError, OverflowError, ArithmeticError) as exc:
            if tag is not None:
                # An explicit tag on text that is not of its kind (`!!bool maybe`, `!!int x`).
                raise self.err(node, f"{what}: {tag} {_show(node.value)} is not a YAML {kind} "
                                     f"(valid for {tag}: {_TAG_FORMS.get(kind, kind)}){takes}") from None
            # Implicit int/float resolution accepts text that int()/float() then refuse
            # ("0x_", "._", a 5,000-digit number).
            raise self.err(node, f"{what}: {_show(node.value)} reads as a YAML {kind} but is not "
                                 f"one ({type(exc).__name__}); quote it to give text") from None

    def nonempty_text(self, node, what: str, example: str) -> str:
        """A scalar that must be non-empty text (a number is taken as written)."""
        value = self.scalar(node, what)
        if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
            raise self.err(node, f"{what}: {_show(node.value if value is not None else value)} is "
                                 f"not text (give {example})")
        out = node.value if isinstance(value, (int, float)) else str(value)
        if not out.strip():
            raise self.err(node, f"{what} is empty (give {example})")
        return out

    def mapping(self, node, what: str, valid=()) -> list:
        """(key, key node, value node) of mapping NODE; VALID: the keys it takes, for messages.
        Merge keys (`<<: *base`) are YAML's: the merged entries first, the mapping's own
        entries after them override."""
        self._check_tag(node, what)
        if not isinstance(node, yaml.MappingNode):
            raise self.err(node, f"{what} must be a mapping, not a {_kind(node)}")
        # A mapping reached again through an alias is already flattened: its own keys
        # are those it had before.
        own = self._own[id(node)] if id(node) in self._own else \
            [k for k, _ in node.value if k.tag != _MERGE]
        if len(own) != len(node.value) and id(node) not in self._own:
            self._own[id(node)] = own
            self._merge(node, what)
        takes = ", ".join(valid) if valid else ""
        out, seen = [], {}
        for k, v in node.value:
            key = self.scalar(k, f"a key in {what}", valid=takes)
            if not isinstance(key, str):
                raise self.err(k, f"{what}: key {_show(key)} must be a string"
                                  f"{f' (valid: {takes})' if takes else ''}")
            if key in seen:
                first, i = seen[key]
                if out[i][1] not in own and k in own:   # the mapping's own entry overrides a merged one
                    out[i] = (key, k, v)
                    seen[key] = (k.start_mark.line + 1, i)
                    continue
                raise self.err(k, f"{what}: key {key!r} given twice (first at line {first})")
            seen[key] = (k.start_mark.line + 1, len(out))
            out.append((key, k, v))
        return out

    def _merge(self, node, what: str) -> None:
        for k, v in node.value:
            if k.tag == _MERGE:
                self._check_tag(v, f"{what}: the merge key <<")
                values = v.value if isinstance(v, yaml.SequenceNode) else [v]
                for m in values:
                    if not isinstance(m, yaml.MappingNode):
                        raise self.err(m, f"{what}: the merge key << takes a mapping or a list of "
                                          f"mappings (e.g. <<: *base), not a {_kind(m)}")
                    self._check_tag(m, f"{what}: the merge key <<")
        try:
            self._loader.flatten_mapping(node)
        except yaml.YAMLError as exc:
            raise self.err(node, f"{what}: bad merge key <<: {getattr(exc, 'problem', None) or exc}") from None

    def sequence(self, node, what: str) -> list:
        if isinstance(node, yaml.ScalarNode):   # `op: torch` is a list of one
            return [node]
        self._check_tag(node, what)
        if not isinstance(node, yaml.SequenceNode):
            raise self.err(node, f"{what} must be a list, not a {_kind(node)}")
        return list(node.value)

    def _check_tag(self, node, what):
        if node.tag in _PLAIN_TAGS:
            return
        implicit = tuple(f"tag:yaml.org,2002:{t}" for t in ("timestamp", "merge", "value"))
        if isinstance(node, yaml.ScalarNode) and node.style is None and node.tag in implicit \
                and self.explicit_tag(node) is None:
            kind = node.tag.rpartition(":")[2]
            raise self.err(node, f"{what}: {_show(node.value)} reads as a YAML {kind}; quote it "
                                 f"to give text (policy files hold strings, numbers, booleans, "
                                 f"lists and mappings)")
        raise self.err(node, f"{what}: tag {_show_tag(node.tag)} is not allowed (policy files are "
                             f"plain YAML: strings, numbers, booleans, lists and mappings; valid "
                             f"tags: {', '.join(_short_tag(t) for t in _PLAIN_TAGS)}, or none)")


def _check_depth(r: _Reader, root) -> None:
    """Refuse nesting deeper than any policy needs, before anything walks the tree."""
    stack, seen = [(root, 1)], set()
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise r.err(node, f"nested {MAX_DEPTH} levels deep; a policy is at most 5 "
                              f"(ops -> op -> list, devices -> entry -> ops -> op -> list)")
        if isinstance(node, yaml.ScalarNode) or id(node) in seen:
            continue
        seen.add(id(node))   # an alias repeats a node already walked
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for kv in node.value for n in kv]
        stack.extend((c, depth + 1) for c in children)


_PLAIN_TAGS = tuple(f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq"))
_MERGE = "tag:yaml.org,2002:merge"
_NULL_FORMS = ("", "~", "null", "Null", "NULL")
# What the text of each explicitly tagged scalar may be (YAML 1.1, as the safe loader reads it).
_TAG_FORMS = {"bool": "true, false, yes, no, on, off, in any case",
              "int": "a whole number such as 1, -2, 0x1f, 0o17",
              "float": "a number such as 1.5, -2e3, .inf, .nan"}


def _short_tag(tag: str) -> str:
    """tag:yaml.org,2002:bool -> !!bool; a local tag stays as written."""
    prefix = "tag:yaml.org,2002:"
    return "!!" + tag[len(prefix):] if tag.startswith(prefix) else tag


def _show_tag(tag: str) -> str:
    text = _short_tag(tag)
    return text if len(text) <= 80 and text.isprintable() else _show(text)


def _kind(node) -> str:
    return {"ScalarNode": "single value", "SequenceNode": "list", "MappingNode": "mapping"}[type(node).__name__]


class MarkedMap(dict):
    """A YAML mapping as a dict that knows its lines: `.line` (the mapping's own)
    and `.lines[key]` (where each value starts)."""
    line: int = 0

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lines = {}

    def line_of(self, key) -> int:
        return self.lines.get(key, self.line)


class MarkedList(list):
    """A YAML sequence as a list that knows its lines: `.line`, `.lines[i]`."""
    line: int = 0

    def __init__(self, *args):
        super().__init__(*args)
        self.lines = []

    def line_of(self, i: int) -> int:
        return self.lines[i] if 0 <= i < len(self.lines) else self.line


def load_marked(text: str, path: str):
    """Plain YAML (strings, numbers, booleans, null, lists, mappings; anchors and
    aliases allowed) through the safe loader, as MarkedMap / MarkedList / scalars,
    so a checker can say file:line. Duplicate keys and other tags are refused
    with PolicyError(path, line, ...)."""
    r = _Reader(path, text)
    root = r.root()
    budget = [MAX_VALUES]      # aliases repeat subtrees: bound what they expand to

    def build(node, what):
        budget[0] -= 1
        if budget[0] < 0:
            raise r.err(node, f"more than {MAX_VALUES} values once aliases are expanded "
                              f"(an alias of an alias repeats a subtree many times)")
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            out = MarkedMap()
            out.line = line
            for key, _, vnode in r.mapping(node, what or "the document"):
                out[key] = build(vnode, f"{what}.{key}" if what else key)
                out.lines[key] = vnode.start_mark.line + 1
            return out
        if isinstance(node, yaml.SequenceNode):
            r._check_tag(node, what or "the document")
            out = MarkedList()
            out.line = line
            for i, item in enumerate(node.value):
                out.append(build(item, f"{what}[{i}]"))
                out.lines.append(item.start_mark.line + 1)
            return out
        return r.scalar(node, what or "the document")
    return None if root is None else build(root, "")


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
    r = _Reader(path, text)
    root = r.root()
    if root is None or isinstance(root, yaml.ScalarNode) and root.tag == _PLAIN_TAGS[4] \
            and not root.value.strip() and r.explicit_tag(root) is None:
        # A file that says nothing is a mistake more often than a choice (a truncated write,
        # the wrong path in CAPDISPATCH_POLICY); a policy that changes nothing says `schema: 1`.
        raise PolicyError(path, None, "the file holds no policy (it is empty or only comments); "
                                      "write `schema: 1` for a policy that changes nothing")
    fields = {}
    for key, knode, vnode in r.mapping(root, "the policy", valid=TOP_KEYS):
        if key not in TOP_KEYS:
            raise r.err(knode, f"unknown key {key!r}{did_you_mean(key, TOP_KEYS)} "
                               f"(valid: {', '.join(TOP_KEYS)})")
        if key == "schema":
            v = r.scalar(vnode, "schema", valid="1")
            if type(v) is not int or v != 1:   # bool is an int subclass: `schema: true` is not 1
                raise r.err(vnode, f"schema {_show(vnode.value)[1:-1] if v is not None else '(empty)'} "
                                   f"is not supported (valid: 1)")
        elif key in SETTINGS:
            valid = SETTINGS[key]
            v = r.scalar(vnode, key, valid=", ".join(valid))
            if key == "verify" and v is False:   # YAML 1.1 reads a bare `off` as false
                v = "off"
            if not isinstance(v, str) or v not in valid:
                shown = _show(vnode.value) if v is not None else "empty"
                raise r.err(vnode, f"{key}: {shown} is not valid{did_you_mean(vnode.value, valid)} "
                                   f"(valid: {', '.join(valid)})")
            fields[key] = Marked(v, vnode.start_mark.line + 1)
        elif key == "ops":
            fields["ops"] = _ops(r, vnode, registry, "ops")
        elif key == "devices":
            fields["devices"] = tuple(_devices(r, vnode, registry, known_devices))
    return PolicyFile(path=path, builtin=builtin, **fields)


def _ops(r: _Reader, node, registry, what: str) -> dict:
    out = {}
    for op, knode, vnode in r.mapping(node, what, valid=tuple(registry.ops)):
        if op not in registry.ops:
            raise r.err(knode, f"unknown op {_show(op)}{did_you_mean(op, registry.ops)} "
                               f"(valid: {', '.join(registry.ops)})")
        if isinstance(vnode, yaml.ScalarNode) and vnode.tag.endswith(":null"):
            valid = [b.name for b in registry.backends(op)]
            raise r.err(vnode, f"{what}.{op} is empty; name at least one backend "
                               f"(valid: {', '.join(valid)})")
        items = r.sequence(vnode, f"{what}.{op}")
        if any(isinstance(i, yaml.MappingNode) for i in items):
            out[op] = _buckets(r, vnode, items, registry, op, f"{what}.{op}")
        else:
            out[op] = OpPreference(_names(r, vnode, items, registry, op, f"{what}.{op}"),
                                   vnode.start_mark.line + 1)
    return out


def _names(r: _Reader, node, items, registry, op: str, what: str) -> tuple:
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


def _buckets(r: _Reader, node, items, registry, op: str, what: str) -> OpPreference:
    """`- {tokens: "<=16", prefer: [...]}` ... `- {prefer: [...]}`: ascending bounds, one
    catch-all, last."""
    size = registry.ops[op].size
    if size is None:
        raise r.err(node, f"{what}: op {op} takes no size buckets; give a plain list of backends")
    key = size.key
    valid_keys = (key, "prefer", "unmeasured")
    buckets = []
    for i, item in enumerate(items):
        where = f"{what}[{i}]"
        if not isinstance(item, yaml.MappingNode):
            raise r.err(item, f"{where}: {_show(r.scalar(item, where))} is a backend name in a list of "
                              f"buckets; write every entry as a bucket, e.g. {{{key}: \"<=16\", "
                              f"prefer: [...]}}, the last one {{prefer: [...]}}")
        body = {}
        for k, kn, vn in r.mapping(item, where, valid=valid_keys):
            if k not in valid_keys:
                other = "tokens" if key == "rows" else "rows"
                hint = (f"; {op} buckets on {key} (the leading dimension of its argument "
                        f"{size.name!r})" if k == other else did_you_mean(k, valid_keys))
                raise r.err(kn, f"{where}: unknown key {k!r}{hint} (valid: {', '.join(valid_keys)})")
            body[k] = vn
        if "prefer" not in body:
            raise r.err(item, f"{where}: needs 'prefer', the backends for this bucket in order")
        prefer = _names(r, body["prefer"], r.sequence(body["prefer"], f"{where}.prefer"),
                        registry, op, f"{where}.prefer")
        unmeasured = ()
        if "unmeasured" in body:
            unmeasured = _names(r, body["unmeasured"], r.sequence(body["unmeasured"], f"{where}.unmeasured"),
                                registry, op, f"{where}.unmeasured")
            both = [n for n in unmeasured if n in prefer]
            if both:
                raise r.err(body["unmeasured"], f"{where}.unmeasured: {both[0]!r} is also in 'prefer'; a "
                                                f"backend is either measured (prefer) or not (unmeasured)")
        upper = None
        if key in body:
            vn = body[key]
            raw = r.scalar(vn, f"{where}.{key}", valid='"<=N" with N a whole number >= 1')
            m = _BOUND.fullmatch(str(raw).strip()) if isinstance(raw, str) else None
            if m is None or int(m.group(1)) < 1:
                raise r.err(vn, f"{where}.{key}: {_show(raw)} is not a bucket bound (valid: \"<=N\" with N a "
                                f"whole number >= 1, e.g. \"<=16\"; leave {key} out for the catch-all)")
            upper = int(m.group(1))
        line = item.start_mark.line + 1
        if buckets and buckets[-1].upper is None:
            raise r.err(item, f"{where}: comes after the catch-all bucket (line {buckets[-1].line}), "
                              f"so it would never apply; the catch-all (no {key}) goes last")
        if upper is not None and buckets and upper <= buckets[-1].upper:
            prev = buckets[-1]
            how = "repeats" if upper == prev.upper else "is below"
            raise r.err(vn, f"{where}.{key}: \"<={upper}\" {how} the bound of the bucket before it "
                            f"(\"<={prev.upper}\", line {prev.line}); buckets go in increasing order of "
                            f"their bounds, each taking the sizes above the previous bound")
        buckets.append(Bucket(upper, prefer, line, unmeasured))
    if not buckets:
        raise r.err(node, f"{what}: the list is empty; name at least one backend")
    if buckets[-1].upper is not None:
        raise r.err(node, f"{what}: no catch-all bucket for {key} above {buckets[-1].upper}; "
                          f"end the list with {{prefer: [...]}} (a bucket without {key})")
    return OpPreference(buckets[-1].backends, buckets[-1].line,
                        buckets=tuple(buckets) if len(buckets) > 1 else (), unmeasured=buckets[-1].unmeasured)


def _devices(r: _Reader, node, registry, known_devices):
    for i, item in enumerate(r.sequence(node, "devices")):
        where = f"devices[{i}]"
        body = {k: (kn, vn) for k, kn, vn in r.mapping(item, where, valid=DEVICE_KEYS)}
        for key, (kn, _) in body.items():
            if key not in DEVICE_KEYS:
                raise r.err(kn, f"{where}: unknown key {key!r}{did_you_mean(key, DEVICE_KEYS)} "
                                f"(valid: {', '.join(DEVICE_KEYS)})")
        if "match" not in body:
            raise r.err(item, f"{where}: needs a 'match' (by id, name or cc)")
        match, catalog_key = {}, None
        for key, kn, vn in r.mapping(body["match"][1], f"{where}.match", valid=MATCH_KEYS):
            if key not in MATCH_KEYS:
                raise r.err(kn, f"{where}.match: unknown key {_show(key)}{did_you_mean(key, MATCH_KEYS)} "
                                f"(valid: {', '.join(MATCH_KEYS)})")
            example = {"cc": 'a compute capability or range, e.g. "8.6", "sm_86", ">=8.9", ">=12.0,<13.0"',
                       "name": "a catalog key such as rtx-5090, or the name the driver reports",
                       "id": "a device id: cuda:N, cpu or sim:NAME"}[key]
            value = r.nonempty_text(vn, f"{where}.match.{key}", example).strip()
            if key == "cc" and cc_spec(value) is None:
                raise r.err(vn, f"{where}.match.cc: {_show(value)} is not a compute capability "
                                f"or range (e.g. \"8.6\", \"sm_86\", \">=8.9\", \">=12.0,<13.0\")")
            if key == "name" and known_devices:
                if value.lower() not in known_devices:
                    raise r.err(vn, f"{where}.match.name: unknown device {_show(value)}"
                                    f"{did_you_mean(value.lower(), known_devices)} "
                                    f"(a catalog key such as rtx-5090, or the name the driver reports)")
                if isinstance(known_devices, dict):
                    catalog_key = known_devices[value.lower()]
            if key == "id" and not _ID.fullmatch(value):
                hint = ""
                if "#" in value:
                    hint = "; a card given twice is named by its group position, sim:NAME@N"
                raise r.err(vn, f"{where}.match.id: {_show(value)} is not a device id{hint} "
                                f"(valid: cuda:N, cpu, sim:NAME, each optionally with @N, the "
                                f"position of a card given more than once)")
            match[key] = value
        if not match:
            raise r.err(body["match"][1], f"{where}.match is empty; match by id, name or cc")
        ops = _ops(r, body["ops"][1], registry, f"{where}.ops") if "ops" in body else {}
        measured = None
        if "measured_with" in body:
            measured = {}
            for lib, kn, vn in r.mapping(body["measured_with"][1], f"{where}.measured_with"):
                measured[str(lib)] = r.nonempty_text(vn, f"{where}.measured_with.{lib}",
                                                     'a version such as "2.11.0", or "absent"').strip()
        yield DeviceEntry(match=match, ops=ops, line=item.start_mark.line + 1,
                          catalog_key=catalog_key, measured_with=measured)


def load_file(path, registry, *, known_devices=()) -> PolicyFile:
    """Read and check one policy file: at most MAX_BYTES of UTF-8 YAML."""
    return parse(read_text(path), _display(path), registry, known_devices=known_devices)


def _display(path) -> str:
    """PATH as messages print it: undecodable bytes and control characters escaped."""
    try:
        text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else repr(path)
    except (TypeError, ValueError):
        text = repr(path)
    if len(text) > 300:        # a message names the file; it need not repeat a page of it
        text = f"{text[:150]}...{text[-100:]} ({len(text)} characters)"
    if text.isprintable():
        try:
            text.encode("utf-8")
            return text
        except UnicodeEncodeError:
            pass
    return ascii(text)[1:-1]


def read_text(path) -> str:
    """The text of policy file PATH; every way of failing is a PolicyError naming it."""
    shown = _display(path)
    try:
        path = os.fspath(path)
    except TypeError:
        raise PolicyError(shown, None, f"a policy is a file path, not a {type(path).__name__}") from None
    if isinstance(path, str) and "\0" in path or isinstance(path, bytes) and b"\0" in path:
        raise PolicyError(shown, None, "cannot read policy file: the path contains a NUL byte")
    try:
        if isinstance(path, str):
            os.fsencode(path)
    except UnicodeError:
        raise PolicyError(shown, None, "cannot read policy file: the path is not valid in "
                                       "this file system's encoding") from None
    if os.path.isdir(path):
        raise PolicyError(shown, None, "cannot read policy file: it is a directory (give a .yaml file)")
    from ..safe_io import FileError, read_bytes
    try:    # never blocks on a FIFO, never reads a device, never more than the bound
        data = read_bytes(path, limit=MAX_BYTES, what="policy file")
    except FileError as exc:
        more = "; a policy is a short YAML file" if "larger than" in exc.reason else ""
        raise PolicyError(shown, None, exc.reason + more) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PolicyError(shown, line, f"not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                                       f"{exc.start}); policy files are UTF-8 YAML") from None


def load_default(registry) -> PolicyFile:
    from importlib import resources
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
