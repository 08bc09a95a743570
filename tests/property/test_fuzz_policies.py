"""Fuzzing the policy loader: any input either loads or raises PolicyError with
file and a message -- never another exception, never a hang."""
import string

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from capdispatch.backends import builtin
from capdispatch.dispatch.resolver import known_device_names
from capdispatch.policies import PolicyError, PolicyFile, build, parse

REG = builtin()
KNOWN = known_device_names()

# Scalars at the edges of YAML's implicit resolution and of the loader's checks, tried every run.
ODD = ["", " ", "-", "~", "0x", "0x_", "0b_", "0o", "._", "+.", "1_", "0_", ":", "maybe", "yes",
       "no", "on", "off", "null", "NaN", ".inf", "-.inf", "1e400", "9" * 5000, "1:2:3", "0:_",
       "2001-02-30", "2001-02-03", "12:30:00", "[]", "{}", "!!binary aGk=", "<<", "=", "==",
       "!=8.6", "===foo", ">=", "8.", ".6", "8.6.", "8..6", "²", "١", "cuda:²", "sim:", "sim:#",
       "sim:rtx-3080#2", "sim:rtx-3080@1", "cuda:-1", "rtx\u00a05090", "\u212b", "\u0130",
       "é", "\U0001F600", "\\x00", "a\tb", "'", '"', "*a", "&a", "%YAML", "---", "...", "? a",
       "true", "True", "1", "1.0", "-1", "8.6", "<=", "<=0", "<=16", "<=" + "9" * 5000, "<=\u0661", ">=8.9", "torch", "kv_quant", "rtx-5090",
       "geforce-rtx-3080", "NVIDIA GeForce RTX 5090", "cpu", "cuda:0"]


def _must_load_or_refuse(text, *, known=KNOWN):
    try:
        pf = parse(text, "fuzz.yaml", REG, known_devices=known)
    except PolicyError as exc:
        msg = str(exc)
        assert msg.startswith("fuzz.yaml"), msg
        assert exc.bare and len(msg) < 2000, msg
        return None
    assert isinstance(pf, PolicyFile)
    # A loaded policy also layers and answers for every op on a device without raising.
    import capdispatch as cd
    stack = build(REG, policy=pf, env={})
    for dev in ("sim:rtx-3080", "sim:rtx-5090", "cpu"):
        spec = cd.probe(dev)
        for op in REG.ops:
            stack.preference(op, spec)
    return pf


@given(st.binary(max_size=400))
def test_random_bytes(data):
    _must_load_or_refuse(data)


_tokens = st.sampled_from(list(":-[]{},#&*!|>'\"%@`?\n \t") + ["ops", "devices", "match", "cc",
                                                                  "0x", "kv_quant", "torch", "  "])


@given(st.lists(_tokens, max_size=60).map("".join))
def test_yaml_punctuation(text):
    _must_load_or_refuse(text)


@given(st.text(max_size=200))
def test_random_unicode(text):
    _must_load_or_refuse(text)


_scalars = st.one_of(st.sampled_from(ODD), st.none(), st.booleans(), st.integers(),
                     st.floats(allow_nan=True), st.text(max_size=20))
_keys = st.sampled_from(["schema", "mixed_group", "on_unsupported", "ops", "devices", "match",
                         "id", "name", "cc", "kv_quant", "indexer", "moe", "torch", ""]) | st.text(max_size=8)
_trees = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4)
                      | st.dictionaries(_keys, kids, max_size=4), max_leaves=20)


@given(st.dictionaries(_keys, _trees, max_size=5))
def test_random_yaml_trees(tree):
    _must_load_or_refuse(yaml.safe_dump(tree, allow_unicode=True))


# Valid templates with one hole, filled with an odd scalar written as it comes
# (plain) or quoted: the classes the generator found through scalar resolution.
TEMPLATES = [
    "schema: {v}\n", "mixed_group: {v}\n", "on_unsupported: {v}\n", "verify: {v}\n",
    "ops:\n  kv_quant: {v}\n", "ops:\n  kv_quant: [{v}]\n", "ops:\n  {v}: [torch]\n",
    "ops:\n  kv_quant: [torch, {v}]\n",
    "devices:\n  - match: {{cc: {v}}}\n    ops: {{kv_quant: [torch]}}\n",
    "devices:\n  - match: {{name: {v}}}\n    ops: {{kv_quant: [torch]}}\n",
    "devices:\n  - match: {{id: {v}}}\n    ops: {{kv_quant: [torch]}}\n",
    "devices:\n  - match: {{{v}: x}}\n", "devices:\n  - {v}\n", "devices: {v}\n",
    "devices:\n  - match:\n      cc: {v}\n    ops:\n      indexer: {v}\n",
    "ops:\n  decode_mla:\n    - {{tokens: {v}, prefer: [triton]}}\n    - {{prefer: [torch]}}\n",
    "ops:\n  decode_mla:\n    - {{tokens: '<=16', prefer: {v}}}\n    - {{prefer: [torch]}}\n",
    "ops:\n  kv_quant:\n    - {{{v}: '<=16', prefer: [torch]}}\n    - {v}\n",
]


@given(st.sampled_from(TEMPLATES), st.sampled_from(ODD) | st.text(max_size=12),
       st.sampled_from(["plain", "single", "double"]))
def test_odd_scalars_in_valid_templates(template, value, style):
    if style == "single":
        value = "'" + value.replace("'", "''") + "'"
    elif style == "double":
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    _must_load_or_refuse(template.format(v=value))


@pytest.mark.parametrize("depth", [50, 65, 300, 1000])
def test_deep_nesting_is_refused_not_a_recursion_error(depth):
    for text in ("[" * depth + "]" * depth, "a: " * depth + "b", "ops:\n" + "- " * depth + "x\n"):
        _must_load_or_refuse(text)


def test_billion_laughs_is_bounded():
    text = "a: &a [x, x, x, x, x, x, x, x]\n"
    for i in range(1, 12):
        text += f"a{i}: &a{i} [{', '.join(['*a' + (str(i - 1) if i > 1 else '')] * 8)}]\n"
    text += "ops:\n  kv_quant: *a11\n"
    _must_load_or_refuse(text)


@pytest.mark.parametrize("text,needle", [
    ("schema: true\n", "schema true is not supported"),
    ("schema: 1.0\n", "schema 1.0 is not supported"),
    ("schema: 0x_\n", "reads as a YAML int"),
    ("ops:\n  kv_quant: [-0x_]\n", "'-0x_' reads as a YAML int"),
    ("devices:\n  - match: {cc: 0b_}\n", "reads as a YAML int"),
    ("schema: " + "9" * 5000 + "\n", "reads as a YAML int"),
    ("devices:\n  - match: {cc: ''}\n", "match.cc is empty"),
    ("devices:\n  - match: {cc: '==8.6,'}\n", "is not a compute capability"),
    ("devices:\n  - match: {cc: '===foo'}\n", "is not a compute capability"),
    ("devices:\n  - match: {cc: ~}\n", "is not text"),
    ("devices:\n  - match: {name: ''}\n", "match.name is empty"),
    ("devices:\n  - match: {name: [a]}\n", "must be a single value"),
    ("devices:\n  - match: {id: 'cuda:\u0661'}\n", "is not a device id"),
    ("devices:\n  - match: {id: 'sim:rtx-3080#2'}\n", "sim:NAME@N"),
    ("ops:\n  kv_quant:\n", "is empty; name at least one backend"),
    ("ops:\n  kv_quant: [~]\n", "unknown backend an empty entry"),
    ("ops:\n  kv_quant: [1]\n", "unknown backend '1'"),
    ("mixed_group: yes\n", "'yes' is not valid"),
    ("mixed_group:\n", "empty is not valid"),
    ("ops: {kv_quant: 2001-02-03}\n", "reads as a YAML timestamp; quote it"),
    ("ops: {kv_quant: [torch]}\n\x00\n", "(U+0000) is not allowed"),
])
def test_odd_values_name_the_problem(text, needle):
    with pytest.raises(PolicyError) as ei:
        parse(text, "p.yaml", REG, known_devices=KNOWN)
    assert needle in str(ei.value), str(ei.value)


@settings(max_examples=50)
@given(st.sampled_from(ODD) | st.text(max_size=10))
def test_a_valid_match_never_crashes_matching(value):
    """Whatever validates as a match value is also safe to match against any device."""
    import capdispatch as cd
    for key in ("cc", "name", "id"):
        pf = _must_load_or_refuse(f"devices:\n  - match: {{{key}: {yaml.safe_dump(value).split(chr(10))[0]}}}\n"
                                  f"    ops: {{kv_quant: [torch]}}\n")
        if pf is None:
            continue
        for dev in ("sim:rtx-3080", "sim:h200", "cpu", "sim:sm_120"):
            pf.devices[0].matches(cd.probe(dev))
