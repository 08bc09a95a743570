"""The marked YAML reader every YAML input goes through (capdispatch.marked_yaml): values
keep their lines, hostile documents are bounded, and every refusal is FILE:LINE: what."""
import os

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from capdispatch.errors import CapdispatchError
from capdispatch.marked_yaml import Reader, load_marked, read_text


class Refused(CapdispatchError, ValueError):
    def __init__(self, path, line, message):
        self.path, self.line, self.bare = path, line, message
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


def _reader(text, **kw):
    return Reader("f.yaml", text, error=Refused, kind="test file", **kw)


def _root(text, **kw):
    r = _reader(text, **kw)
    return r, r.root()


def _refused(read, text, **kw):
    r, root = _root(text, **kw)
    with pytest.raises(Refused) as ei:
        read(r, root)
    return ei.value


# --------------------------------------------------------------------------- values and lines

_scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
            | st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12))
_keys = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8)
_trees = st.recursive(_scalars, lambda k: st.lists(k, max_size=4) | st.dictionaries(_keys, k, max_size=4),
                      max_leaves=24)


@settings(max_examples=300)
@given(st.dictionaries(_keys, _trees, max_size=6), st.booleans())
def test_any_mapping_round_trips(data, flow):
    text = yaml.safe_dump(data, default_flow_style=flow, sort_keys=False)
    r, root = _root(text)
    assert r.plain(root, "") == data
    assert load_marked(text, "f.yaml", error=Refused) == data


@settings(max_examples=200)
@given(st.lists(st.sampled_from(["a", "bb", "c_1", "long-key"]), min_size=1, max_size=6, unique=True),
       st.data())
def test_every_value_knows_its_line(keys, data):
    """Keys one a line, values scalars, lists or mappings written on the lines below: the
    marked value of each key says the line its value starts on, each list item its own."""
    lines, want, items = [], {}, {}
    for k in keys:
        shape = data.draw(st.sampled_from(["scalar", "list", "map"]))
        if shape == "scalar":
            lines.append(f"{k}: 1")
            want[k] = len(lines)
        else:
            lines.append(f"{k}:")
            want[k] = len(lines) + 1
            n = data.draw(st.integers(1, 3))
            items[k] = list(range(len(lines) + 1, len(lines) + 1 + n))
            lines += [f"  - {i}" if shape == "list" else f"  x{i}: {i}" for i in range(n)]
    d = load_marked("\n".join(lines) + "\n", "f.yaml", error=Refused)
    assert {k: d.line_of(k) for k in keys} == want
    for k, rows in items.items():
        assert [d[k].line_of(i if isinstance(d[k], list) else f"x{i}") for i in range(len(rows))] == rows


# Each way of spoiling one line of a document of `kI: I` lines, and what the message names.
_SPOILS = {
    "tag": (lambda k: f"{k}: !!python/name:os.system ''", "tag !!python/name:os.system is not allowed"),
    "local tag": (lambda k: f"{k}: !mine 1", "tag !mine is not allowed"),
    "date": (lambda k: f"{k}: 2001-02-03", "reads as a YAML timestamp; quote it"),
    "twice": (lambda k: "k0: 9", "key 'k0' given twice (first at line 1)"),
    "list": (lambda k: f"{k}: [1]", "must be a single value, not a list"),
    "text": (lambda k: f"{k}: one", "must be an integer, found 'one'"),
    "unknown": (lambda k: f"{k}x: 1", "unknown key"),
    "bad int": (lambda k: f"{k}: 0x_", "reads as a YAML int but is not one"),
    "bad bool": (lambda k: f"{k}: !!bool maybe", "!!bool 'maybe' is not a YAML bool"),
    "seq tag": (lambda k: f"{k}: !!seq x", "!!seq 'x' is not a YAML seq (valid for !!seq: a list"),
    "map tag": (lambda k: f"{k}: !!map x", "!!map 'x' is not a YAML map (valid for !!map: a mapping"),
    "str tag on a list": (lambda k: f"{k}: !!str [1]", "!!str on a list is not a YAML str"),
}


@settings(max_examples=300)
@given(st.integers(2, 12), st.data(), st.sampled_from(sorted(_SPOILS)))
def test_every_refusal_names_file_and_line(n, data, spoil):
    bad = data.draw(st.integers(1, n - 1))
    make, needle = _SPOILS[spoil]
    lines = [f"k{i}: {i}" for i in range(n)]
    lines[bad] = make(f"k{bad}")
    keys = [f"k{i}" for i in range(n)]

    def read(r, root):
        f = r.fields(root, "doc", optional=keys)
        return {k: f.get(k, r.integer) for k in keys if k in f}
    err = _refused(read, "\n".join(lines) + "\n")
    assert err.line == bad + 1 and str(err).startswith(f"f.yaml:{bad + 1}: "), str(err)
    assert needle in str(err) and "\n" not in str(err), str(err)


# --------------------------------------------------------------------------- bounds

def test_depth_is_bounded_before_anything_walks():
    with pytest.raises(Refused) as ei:
        _reader("{a: " * 10 + "b" + "}" * 10, max_depth=5, depth_hint="a test file is flat").root()
    assert ei.value.line == 1 and "nested 5 levels deep; a test file is flat" in str(ei.value)
    for deep in ("[" * 3000 + "]" * 3000, "- " * 100 + "x\n"):   # past the composer's recursion, or the bound
        with pytest.raises(Refused, match="nested"):
            _reader(deep).root()


def test_an_alias_of_an_alias_is_bounded():
    text = "a: &a [x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join(['*a' + (str(i - 1) if i > 1 else '')] * 8)}]\n" for i in range(1, 9))
    err = _refused(lambda r, root: r.plain(root, ""), text, max_values=10_000)
    assert "more than 10000 values once aliases are expanded" in str(err)
    r, root = _root("a: &x [1, 2]\nb: *x\n")
    assert r.plain(root, "") == {"a": [1, 2], "b": [1, 2]}


def test_merge_keys_merge_and_own_entries_override():
    r, root = _root("base: &b {x: 1, y: 2}\nmine:\n  <<: *b\n  y: 3\n")
    assert r.plain(root, "") == {"base": {"x": 1, "y": 2}, "mine": {"x": 1, "y": 3}}
    err = _refused(lambda r, root: r.plain(root, ""), "m:\n  <<: 3\n")
    assert err.line == 2 and "the merge key << takes a mapping" in str(err)


@pytest.mark.parametrize("text,needle", [
    ("a: [1\n", "malformed YAML"),
    ("a: 1\n\x00\n", "(U+0000) is not allowed in YAML (a test file is UTF-8 text"),
])
def test_malformed_documents_are_named(text, needle):
    with pytest.raises(Refused) as ei:
        _reader(text).root()
    assert needle in str(ei.value) and str(ei.value).startswith("f.yaml")


# --------------------------------------------------------------------------- typed readers

def _value(read, text, **kw):
    r, root = _root(text)
    return read(r, r.fields(root, "doc", optional=("v",))["v"], "doc.v", **kw)


@pytest.mark.parametrize("read,text,kw,want", [
    (Reader.text, "v: 2.10\n", {}, "2.10"),          # a number read as text keeps its digits
    (Reader.text, "v:\n", {"null": True}, None),
    (Reader.integer, "v: 0x10\n", {}, 16),
    (Reader.integer, "v: ~\n", {"null": True}, None),
    (Reader.number, "v: 1.5\n", {}, 1.5),
    (Reader.boolean, "v: yes\n", {}, True),
    (Reader.choice, "v: warn\n", {"choices": ("warn", "error")}, "warn"),
    (Reader.choice, "v: off\n", {"choices": ("off", "on"), "false_is": "off"}, "off"),
    (Reader.names, "v: torch\n", {"valid": ("torch", "triton")}, ("torch",)),
    (Reader.names, "v: [torch, triton]\n", {}, ("torch", "triton")),
])
def test_typed_readers_read(read, text, kw, want):
    assert _value(read, text, **kw) == want


@pytest.mark.parametrize("read,text,kw,needle", [
    (Reader.text, "v: true\n", {"need": "a name"}, "doc.v: 'true' is not text (give a name)"),
    (Reader.text, "v: ' '\n", {"nonempty": True}, "doc.v is empty (give text)"),
    (Reader.integer, "v: true\n", {}, "doc.v must be an integer, found True"),
    (Reader.integer, "v: '16'\n", {"null": True}, "doc.v must be an integer or null, found '16'"),
    (Reader.number, "v: x\n", {}, "doc.v must be a number, found 'x'"),
    (Reader.boolean, "v: 1\n", {}, "doc.v must be true or false, found 1"),
    (Reader.choice, "v: wran\n", {"choices": ("warn", "error")},
     "doc.v: 'wran' is not valid; did you mean 'warn'? (valid: warn, error)"),
    (Reader.name, "v: tirton\n", {"valid": ("torch", "triton"), "noun": "backend", "of": " for moe"},
     "doc.v: unknown backend 'tirton' for moe; did you mean 'triton'? (valid: torch, triton)"),
    (Reader.names, "v: [a, a]\n", {}, "doc.v: 'a' listed twice"),
    (Reader.mapping, "v: [a]\n", {}, "doc.v must be a mapping, not a list"),
    (Reader.sequence, "v: {a: 1}\n", {}, "doc.v must be a list, not a mapping"),
    (Reader.scalar, "v: {a: 1}\n", {}, "doc.v must be a single value, not a mapping"),
])
def test_typed_readers_refuse_with_file_line_what_found_and_need(read, text, kw, needle):
    with pytest.raises(Refused) as ei:
        _value(read, text, **kw)
    assert str(ei.value) == f"f.yaml:1: {needle}"


def test_fields_declare_required_optional_defaults_and_refuse_the_rest():
    r, root = _root("name: x\ncolour: red\n")
    f = r.fields(root, "doc", required=("name",), optional={"colour": "blue", "size": 3, "why": ""})
    assert (f.get("name", r.text), f.get("colour", r.text), f.get("size", r.integer)) == ("x", "red", 3)
    assert "size" not in f and f.where("size") == "doc.size"
    r, root = _root("name: x\ncolor: red\n")
    with pytest.raises(Refused, match=r"^f.yaml:2: doc: unknown key 'color'; did you mean 'colour'\? "
                                      r"\(valid: name, colour\)$"):
        r.fields(root, "doc", required=("name",), optional=("colour",))
    r, root = _root("colour: red\n")
    with pytest.raises(Refused, match=r"^f.yaml:1: missing 'name'$"):
        r.fields(root, "doc", required=("name",), optional=("colour",), top=True)
    r, root = _root("name: x\nwhy:\n")       # a null value of a key with a default: the default
    assert r.fields(root, "doc", required=("name",), optional={"why": ""}).get("why", r.text) == ""


def test_read_text_bounds_and_names_the_file(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_bytes(b"a: 1\n\xff\n")
    with pytest.raises(Refused) as ei:
        read_text(p, limit=100, kind="test file", error=Refused)
    assert ei.value.line == 2 and "not UTF-8 text (byte 0xff" in str(ei.value)
    p.write_text("a: 1\n" * 100)
    with pytest.raises(Refused, match="larger than 100 bytes.*; keep it short"):
        read_text(p, limit=100, kind="test file", error=Refused, hint="keep it short")
    with pytest.raises(Refused, match="it is a directory"):
        read_text(tmp_path, limit=100, kind="test file", error=Refused)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(Refused, match="FIFO"):
        read_text(fifo, limit=100, kind="test file", error=Refused)
    p.write_text("a: 1\n")
    r = Reader.from_file(p, limit=100, error=Refused, kind="test file")
    assert r.path == str(p) and r.plain(r.root(), "") == {"a": 1}
