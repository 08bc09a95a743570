"""One reader for capdispatch's YAML inputs: policy files, lock files, the SGLang knob map.

PyYAML's safe loader composes a document into nodes; this module builds the values from
those nodes itself, so every value can say where it stands (FILE:LINE), and it bounds
what a hostile file can make it do:

- tags: only YAML's core schema (str, int, float, bool, null, map, seq), written or
  implied; anything else (`!!python/...`, `!!binary`, a local `!tag`, an unquoted date)
  is refused at its line;
- depth: nesting deeper than the reader's bound is refused before anything walks it;
- aliases: anchors may be reused, but the values read (through aliases included) are
  bounded, so an alias of an alias cannot expand without end;
- keys: a key given twice is refused; merge keys (`<<: *base`) are YAML's: the merged
  entries first, the mapping's own entries override them.

A `Reader` holds one document. Its typed readers return plain values or raise the
caller's error class, built as ERROR(FILE, LINE, MESSAGE) and shown `FILE:LINE: MESSAGE`,
where MESSAGE names what was read (a key path such as `devices[0].match.cc`) and says
what was found and what is needed:

    WHAT must be a mapping, not a list          WHAT must be an integer, found 'x'
    WHAT: 'x' is not text (give NEED)           WHAT is empty (give NEED)
    WHAT: 'x' is not valid; did you mean 'y'? (valid: a, b)
    WHAT: unknown key 'x'; did you mean 'y'? (valid: a, b)      WHAT: missing 'x'

`fields` reads a mapping of declared keys: the required ones, the optional ones with
their declared defaults, and refuses any other key with a did-you-mean.

A leaf module: it imports nothing of capdispatch but safe_io.
"""
from __future__ import annotations

import difflib
import os
from typing import Callable, Optional

import yaml

MAX_DEPTH = 64               # nesting beyond any file capdispatch reads
MAX_VALUES = 100_000         # values read from one document, aliases expanded

_CORE = "tag:yaml.org,2002:"
PLAIN_TAGS = tuple(_CORE + t for t in ("str", "int", "float", "bool", "null", "map", "seq"))
_MERGE = _CORE + "merge"
_NULL = _CORE + "null"
_NULL_FORMS = ("", "~", "null", "Null", "NULL")
# What the text of each explicitly tagged scalar may be (YAML 1.1, as the safe loader reads it).
_TAG_FORMS = {"bool": "true, false, yes, no, on, off, in any case",
              "int": "a whole number such as 1, -2, 0x1f, 0o17",
              "float": "a number such as 1.5, -2e3, .inf, .nan",
              "str": "text such as abc",
              "null": "~, null or nothing",
              "seq": "a list such as [a, b]",
              "map": "a mapping such as {a: 1}"}
_KINDS = {yaml.ScalarNode: "single value", yaml.SequenceNode: "list", yaml.MappingNode: "mapping"}
# The core tags each kind of node may carry (`!!seq x` is a scalar tagged as a list).
_FITS = {yaml.ScalarNode: tuple(_CORE + t for t in ("str", "int", "float", "bool", "null")),
         yaml.SequenceNode: (_CORE + "seq",), yaml.MappingNode: (_CORE + "map",)}

# ERROR(FILE, LINE or None, MESSAGE): the caller's exception for a refused document.
ErrorClass = Callable[[str, Optional[int], str], Exception]


def did_you_mean(value, valid) -> str:
    """"; did you mean 'x'?" for the closest of VALID, or ""."""
    close = difflib.get_close_matches(str(value)[:200], [str(v) for v in valid], n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def show(value, limit: int = 80) -> str:
    """VALUE as an error message quotes it: repr, cut to LIMIT characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-4:]} ({len(text)} characters)"


def display(path) -> str:
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


def short_tag(tag: str) -> str:
    """tag:yaml.org,2002:bool -> !!bool; a local tag stays as written."""
    return "!!" + tag[len(_CORE):] if tag.startswith(_CORE) else tag


def kind_of(node) -> str:
    """'single value', 'list' or 'mapping'."""
    return _KINDS[type(node)]


def _char(c) -> str:
    """A character YAML refused, as a message shows it ('\\x00', U+FFFE)."""
    c = chr(c) if isinstance(c, int) else str(c)
    return repr(c) if c.isprintable() else f"{ascii(c)} (U+{ord(c[:1] or chr(0)):04X})"


def read_text(path, *, limit: int, kind: str, error: ErrorClass, hint: str = "") -> str:
    """The UTF-8 text of the regular file PATH, at most LIMIT bytes; every way of failing
    is ERROR(PATH, LINE or None, why) naming KIND ("policy file"). HINT is added to the
    message of a file over the limit."""
    from .safe_io import FileError, read_bytes
    shown = display(path)
    try:
        if isinstance(path, str) and "\0" not in path:
            os.fsencode(path)
    except UnicodeError:
        raise error(shown, None, f"cannot read {kind}: the path is not valid in this file system's "
                                 f"encoding") from None
    try:    # never blocks on a FIFO, never reads a device, never more than the bound
        data = read_bytes(path, limit=limit, what=kind)
    except FileError as exc:
        more = f"; {hint}" if hint and "larger than" in exc.reason else ""
        raise error(shown, None, exc.reason + more) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(shown, line, f"not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
                                 f"a {kind} is UTF-8 YAML") from None


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


def line_of(node) -> int:
    """The 1-based line NODE starts on."""
    return node.start_mark.line + 1


class Reader:
    """One YAML document of PATH (TEXT), read node by node with its lines.

    ERROR builds the exception of every refusal; KIND names the file in messages
    ("policy file", "lock file", "knob map"); MAX_DEPTH bounds the nesting (DEPTH_HINT
    says what the deepest valid document holds); MAX_VALUES bounds the values read."""

    def __init__(self, path: str, text: str, *, error: ErrorClass, kind: str = "YAML file",
                 max_depth: int = MAX_DEPTH, depth_hint: str = "", max_values: int = MAX_VALUES):
        self.path, self.source, self.kind, self.error = path, text, kind, error
        self.max_depth, self.depth_hint, self.max_values = max_depth, depth_hint, max_values
        self._left = max_values
        self._loader = None
        self._own = {}      # id(mapping node) -> its own key nodes, once merge keys are flattened

    @classmethod
    def from_file(cls, path, *, limit: int, error: ErrorClass, kind: str = "YAML file", hint: str = "",
                  **kw) -> "Reader":
        """The reader of the file PATH (at most LIMIT bytes of UTF-8; see read_text)."""
        text = read_text(path, limit=limit, kind=kind, error=error, hint=hint)
        return cls(display(path), text, error=error, kind=kind, **kw)

    line = staticmethod(line_of)

    def err(self, at, message: str) -> Exception:
        """The error at AT (a node, a line number or None) saying MESSAGE."""
        line = at if isinstance(at, int) or at is None else line_of(at)
        return self.error(self.path, line, message)

    # ------------------------------------------------------------------ the document
    def root(self):
        """The document's root node (None for an empty document), its depth checked."""
        try:
            loader = yaml.SafeLoader(self.source)
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            raise self.err(mark.line + 1 if mark else None,
                           f"malformed YAML: {exc.problem or exc.context}") from None
        except yaml.reader.ReaderError as exc:
            raise self.err(self.source.count("\n", 0, exc.position) + 1,
                           f"character {_char(exc.character)} is not allowed in YAML (a {self.kind} "
                           f"is UTF-8 text without control characters)") from None
        except yaml.YAMLError as exc:
            raise self.err(None, f"malformed YAML: {exc}") from None
        except RecursionError:
            raise self.err(None, f"malformed {self.kind}: nested too deeply to read (a {self.kind} "
                                 f"is at most {self.max_depth} levels deep)") from None
        self._loader = loader
        if node is not None:
            self._check_depth(node)
        return node

    def _check_depth(self, root) -> None:
        stack, seen = [(root, 1)], set()
        while stack:
            node, depth = stack.pop()
            if depth > self.max_depth:
                hint = f"; {self.depth_hint}" if self.depth_hint else ""
                raise self.err(node, f"nested {self.max_depth} levels deep{hint}")
            if isinstance(node, yaml.ScalarNode) or id(node) in seen:
                continue
            seen.add(id(node))   # an alias repeats a node already walked
            children = node.value if isinstance(node, yaml.SequenceNode) else \
                [n for kv in node.value for n in kv]
            stack.extend((c, depth + 1) for c in children)

    def _shape(self, node, what: str, cls) -> None:
        """Count NODE against the bound, check its tag, refuse it unless it is a CLS node."""
        self._spend(node)
        self.check_tag(node, what)
        if not isinstance(node, cls):
            raise self.err(node, f"{what} must be a {_KINDS[cls]}, not a {kind_of(node)}")

    def _spend(self, node, n: int = 1) -> None:
        self._left -= n
        if self._left < 0:
            raise self.err(node, f"more than {self.max_values} values once aliases are expanded "
                                 f"(an alias of an alias repeats a subtree many times)")

    def explicit_tag(self, node) -> Optional[str]:
        """The tag NODE was written with (`!!bool`, `!foo`), or None when it has none."""
        text, i = self.source, node.start_mark.index
        if text.startswith("&", i):        # an anchor comes before the tag
            i += 1
            while i < len(text) and not text[i].isspace():
                i += 1
            while i < len(text) and text[i] in " \t":
                i += 1
        return short_tag(node.tag) if text.startswith("!", i) else None

    def check_tag(self, node, what: str) -> None:
        """Refuse a tag outside YAML's core schema, written or implied, and a core tag on
        the wrong kind of node (`!!seq x`, `!!str [a]`)."""
        if node.tag in PLAIN_TAGS:
            if node.tag not in _FITS[type(node)]:
                self._misfit(node, what)
            return
        holds = "strings, numbers, booleans, lists and mappings"
        implicit = tuple(_CORE + t for t in ("timestamp", "merge", "value"))
        if isinstance(node, yaml.ScalarNode) and node.style is None and node.tag in implicit \
                and self.explicit_tag(node) is None:
            kind = node.tag.rpartition(":")[2]
            raise self.err(node, f"{what}: {show(node.value)} reads as a YAML {kind}; quote it "
                                 f"to give text (a {self.kind} holds {holds})")
        tag = short_tag(node.tag)
        tag = tag if len(tag) <= 80 and tag.isprintable() else show(tag)
        raise self.err(node, f"{what}: tag {tag} is not allowed (a {self.kind} is plain YAML: "
                             f"{holds}; valid tags: {', '.join(short_tag(t) for t in PLAIN_TAGS)}, or none)")

    def _misfit(self, node, what: str) -> None:
        tag, kind = short_tag(node.tag), node.tag.rpartition(":")[2]
        fits = ", ".join(short_tag(t) for t in _FITS[type(node)])
        found = show(node.value) if isinstance(node, yaml.ScalarNode) else f"on a {kind_of(node)}"
        raise self.err(node, f"{what}: {tag} {found} is not a YAML {kind} (valid for {tag}: "
                             f"{_TAG_FORMS[kind]}; a {kind_of(node)} takes {fits} or no tag)")

    # ------------------------------------------------------------------ shapes
    def scalar(self, node, what: str, valid: str = ""):
        """The value of scalar NODE at WHAT (str, int, float, bool or None); VALID, when
        given, says what WHAT takes."""
        self._shape(node, what, yaml.ScalarNode)
        tag = self.explicit_tag(node)
        kind = node.tag.rpartition(":")[2]
        takes = f"; {what} takes {valid}" if valid else ""
        if tag is not None and kind == "null" and node.value.strip() not in _NULL_FORMS:
            raise self.err(node, f"{what}: {tag} {show(node.value)} is not a null (valid for {tag}: "
                                 f"~, null or nothing){takes}")
        try:
            return self._loader.construct_object(node, deep=True)
        except yaml.YAMLError as exc:
            raise self.err(node, f"{what}: {exc}") from None
        except (ValueError, TypeError, LookupError, OverflowError, ArithmeticError) as exc:
            if tag is not None:
                # An explicit tag on text that is not of its kind (`!!bool maybe`, `!!int x`).
                raise self.err(node, f"{what}: {tag} {show(node.value)} is not a YAML {kind} "
                                     f"(valid for {tag}: {_TAG_FORMS.get(kind, kind)}){takes}") from None
            # Implicit int/float resolution accepts text that int()/float() then refuse
            # ("0x_", "._", a 5,000-digit number).
            raise self.err(node, f"{what}: {show(node.value)} reads as a YAML {kind} but is not "
                                 f"one ({type(exc).__name__}); quote it to give text") from None

    def is_scalar(self, node) -> bool:
        """Is NODE a single value (not a list or a mapping)?"""
        return isinstance(node, yaml.ScalarNode)

    def is_null(self, node) -> bool:
        """Is NODE an empty value or a null (`key:`, `key: ~`)?"""
        return isinstance(node, yaml.ScalarNode) and node.tag == _NULL

    def mapping(self, node, what: str, valid=()) -> list:
        """(key, key node, value node) of mapping NODE, keys strings, none twice; VALID: the
        keys it takes, for messages. Merge keys (`<<: *base`) are YAML's: the merged
        entries first, the mapping's own entries after them override."""
        self._shape(node, what, yaml.MappingNode)
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
                raise self.err(k, f"{what}: key {show(key)} must be a string"
                                  f"{f' (valid: {takes})' if takes else ''}")
            if key in seen:
                first, i = seen[key]
                if out[i][1] not in own and k in own:   # the mapping's own entry overrides a merged one
                    out[i] = (key, k, v)
                    seen[key] = (line_of(k), i)
                    continue
                raise self.err(k, f"{what}: key {key!r} given twice (first at line {first})")
            seen[key] = (line_of(k), len(out))
            out.append((key, k, v))
        return out

    def _merge(self, node, what: str) -> None:
        for k, v in node.value:
            if k.tag == _MERGE:
                self.check_tag(v, f"{what}: the merge key <<")
                values = v.value if isinstance(v, yaml.SequenceNode) else [v]
                for m in values:
                    if not isinstance(m, yaml.MappingNode):
                        raise self.err(m, f"{what}: the merge key << takes a mapping or a list of "
                                          f"mappings (e.g. <<: *base), not a {kind_of(m)}")
                    self.check_tag(m, f"{what}: the merge key <<")
        try:
            self._loader.flatten_mapping(node)
        except yaml.YAMLError as exc:
            raise self.err(node, f"{what}: bad merge key <<: {getattr(exc, 'problem', None) or exc}") from None

    def sequence(self, node, what: str, *, one_is_list: bool = False) -> list:
        """The item nodes of list NODE (ONE_IS_LIST: a single value is a list of one)."""
        if one_is_list and isinstance(node, yaml.ScalarNode):
            return [node]
        self._shape(node, what, yaml.SequenceNode)
        return list(node.value)

    def rows(self, node, what: str):
        """(WHAT[i], item node) of list NODE; none for an absent or empty value (None, null)."""
        if node is None or self.is_null(node):
            return ()
        return [(f"{what}[{i}]", item) for i, item in enumerate(self.sequence(node, what))]

    def fields(self, node, what: str, *, required=(), optional=(), hint=None, top: bool = False) -> "Fields":
        """Mapping NODE of declared keys: every REQUIRED one present, OPTIONAL ones (names,
        or a mapping of name -> default) may be, any other refused. HINT(key), when given,
        says more about an unknown key than the did-you-mean. TOP: the document's own
        keys, which messages name without a path (`unknown key 'x'`, `missing 'x'`)."""
        defaults = dict(optional) if isinstance(optional, dict) else {}
        valid = tuple(required) + tuple(optional)
        at = "" if top else f"{what}: "
        found = {}
        for key, knode, vnode in self.mapping(node, what, valid=valid):
            if key not in valid:
                more = hint(key) if hint else ""
                raise self.err(knode, f"{at}unknown key {show(key)}{more or did_you_mean(key, valid)} "
                                      f"(valid: {', '.join(valid)})")
            found[key] = (knode, vnode)
        missing = [k for k in required if k not in found]
        if missing:
            raise self.err(node, f"{at}missing {', '.join(repr(m) for m in missing)}")
        return Fields(self, node, "" if top else what, found, defaults)

    # ------------------------------------------------------------------ typed values
    def text(self, node, what: str, *, need: str = "text", null: bool = False,
             nonempty: bool = False) -> Optional[str]:
        """Text as written (a number keeps its digits: `2.10` is '2.10'); NULL: None for
        an empty value; NONEMPTY: blank text refused. NEED says what WHAT takes."""
        value = self.scalar(node, what)
        if value is None and null:
            return None
        if isinstance(value, bool) or value is None:
            raise self.err(node, f"{what}: {show(node.value if value is not None else value)} is "
                                 f"not text (give {need})")
        out = node.value if isinstance(value, (int, float)) else str(value)
        if nonempty and not out.strip():
            raise self.err(node, f"{what} is empty (give {need})")
        return out

    def integer(self, node, what: str, *, null: bool = False) -> Optional[int]:
        """A whole number (not a boolean); NULL: None for an empty value."""
        value = self.scalar(node, what)
        if value is None and null:
            return None
        if type(value) is not int:
            raise self.err(node, f"{what} must be an integer{' or null' if null else ''}, "
                                 f"found {show(value)}")
        return value

    def number(self, node, what: str) -> float:
        """An int or a float (not a boolean)."""
        value = self.scalar(node, what)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.err(node, f"{what} must be a number, found {show(value)}")
        return value

    def boolean(self, node, what: str) -> bool:
        """true or false (YAML 1.1's yes/no/on/off too)."""
        value = self.scalar(node, what)
        if not isinstance(value, bool):
            raise self.err(node, f"{what} must be true or false, found {show(value)}")
        return value

    def choice(self, node, what: str, choices, *, false_is: Optional[str] = None) -> str:
        """One of CHOICES (text). FALSE_IS: the choice a bare `off`/`no`/`false` means
        (YAML 1.1 reads those as false)."""
        value = self.scalar(node, what, valid=", ".join(choices))
        if value is False and false_is is not None:
            value = false_is
        if not isinstance(value, str) or value not in choices:
            shown = show(node.value) if value is not None else "empty"
            raise self.err(node, f"{what}: {shown} is not valid{did_you_mean(node.value, choices)} "
                                 f"(valid: {', '.join(choices)})")
        return value

    def name(self, node, what: str, valid, *, noun: str = "name", of: str = "") -> str:
        """One of the names VALID; OF follows the name in the message (" for kv_quant")."""
        name = self.text(node, what, need=f"a {noun}")
        if name not in valid:
            raise self.err(node, f"{what}: unknown {noun} {show(name)}{of}{did_you_mean(name, valid)} "
                                 f"(valid: {', '.join(valid)})")
        return name

    def names(self, node, what: str, valid=None, *, noun: str = "name", of: str = "") -> tuple:
        """A list of names (or a single one), none twice; VALID: the names it takes."""
        out = []
        for item in self.sequence(node, what, one_is_list=True):
            name = self.text(item, what, need=f"a {noun}") if valid is None else \
                self.name(item, what, valid, noun=noun, of=of)
            if name in out:
                raise self.err(item, f"{what}: {name!r} listed twice")
            out.append(name)
        return tuple(out)

    # ------------------------------------------------------------------ whole values
    def plain(self, node, what: str):
        """NODE as plain dicts, lists and scalars (checked as everywhere)."""
        return self._build(node, what, dict, list)

    def marked(self, node, what: str):
        """NODE as MarkedMap, MarkedList and scalars: containers that know their lines."""
        return self._build(node, what, MarkedMap, MarkedList)

    def _build(self, node, what: str, mapping, sequence):
        line = line_of(node)
        if isinstance(node, yaml.MappingNode):
            out = mapping()
            for key, _, vnode in self.mapping(node, what or "the document"):
                out[key] = self._build(vnode, f"{what}.{key}" if what else key, mapping, sequence)
                if hasattr(out, "lines"):
                    out.lines[key] = line_of(vnode)
        elif isinstance(node, yaml.SequenceNode):
            out = sequence()
            for i, item in enumerate(self.sequence(node, what or "the document")):
                out.append(self._build(item, f"{what}[{i}]", mapping, sequence))
                if hasattr(out, "lines"):
                    out.lines.append(line_of(item))
        else:
            return self.scalar(node, what or "the document")
        if hasattr(out, "lines"):
            out.line = line
        return out


class Fields:
    """The declared keys of one mapping (Reader.fields): `key in f`, `f[key]` (the value
    node), `f.get(key, read, ...)` (the value read, or the key's declared default)."""

    def __init__(self, reader: Reader, node, what: str, found: dict, defaults: dict):
        self.reader, self.node, self.what = reader, node, what
        self._found, self._defaults = found, defaults

    def __contains__(self, key) -> bool:
        return key in self._found

    def __getitem__(self, key):
        return self._found[key][1]

    def __iter__(self):
        return iter(self._found)

    def key_node(self, key):
        return self._found[key][0]

    def where(self, key) -> str:
        """How messages name KEY: WHAT.KEY (KEY at the top of the document)."""
        return f"{self.what}.{key}" if self.what else key

    def get(self, key: str, read=None, *, what: Optional[str] = None, **kw):
        """KEY's value read by READ (a Reader method such as Reader.text, called with the
        node, WHAT (default WHAT.KEY) and KW); without READ, the value node. An absent
        key gives its declared default; a null value of a key with a default, too."""
        if key not in self._found or key in self._defaults and self.reader.is_null(self[key]):
            if key not in self._defaults:
                raise KeyError(f"{self.what}: {key!r} is neither given nor declared with a default")
            return self._defaults[key]
        node = self[key]
        return node if read is None else read(node, what or self.where(key), **kw)


def load_marked(text: str, path: str, *, error: ErrorClass, kind: str = "YAML file"):
    """Plain YAML as MarkedMap / MarkedList / scalars (None for an empty document), so a
    checker can say file:line; refusals as ERROR(path, line, message)."""
    r = Reader(path, text, error=error, kind=kind)
    root = r.root()
    return None if root is None else r.marked(root, "")
