"""The hard-input layer: generated policy files, device lists, op lists and CAPDISPATCH_*
values, driven through the command line (in-process), the environment, the Python API
and the SGLang plugin's loading path. Each example has an expected outcome computed
from the input's own model (which value is valid where), and the property is the same
everywhere: a valid input is accepted as written; an invalid one is refused with exit 2
and one line naming the source (flag, variable or file:line), the value and what is
valid, or PolicyError / BadInput from the API; never a traceback, an exit 1 or a
silent default.

Budgets (max_examples) add up to more than 10,000 generated cases per run; they are
explicit so that the CI profile's default does not shrink them (see BUDGETS).
"""
import collections
import json
import os
import re
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import capdispatch as cd
from capdispatch import extend
from capdispatch.backends import builtin
from capdispatch.dispatch.cli import main
from capdispatch.dispatch.resolver import known_device_names
from capdispatch.policies import PolicyError, PolicyFile, parse
from cli_checks import assert_no_crash

REG = builtin()
KNOWN = known_device_names()
OPS = list(REG.ops)
BUDGETS = {"policy": 6500, "lists": 2000, "cli_devices": 700, "cli_ops": 500, "env": 600,
           "env_text": 400, "api": 400, "sglang": 300}
RAN = collections.Counter()     # test -> examples run (the env test enumerates its whole space)


# --------------------------------------------------------------------------------------------
# Policy files: every position of the schema, every scalar form, every tag, anchors and merges
# --------------------------------------------------------------------------------------------

FORMS = ("plain", "single", "double", "literal", "folded")
TEXT_TAGS = (None, "!!str")
# Explicit tags whose text is not of their kind: (tag, text, what the message must name).
TAG_MISMATCH = [("!!bool", "maybe"), ("!!bool", "1"), ("!!int", "x"), ("!!int", "1.5"),
                ("!!float", "x"), ("!!null", "x"), ("!!bool", "warn"), ("!!int", "sm_86")]
# Tags a policy never takes, each with a text it could carry.
REFUSED_TAGS = [("!!binary", "aGk="), ("!!timestamp", "2001-01-01"), ("!!python/name:os.system", "''"),
                ("!!python/object/apply:os.system", "x"), ("!custom", "x"), ("!!set", "x"),
                ("!!omap", "x"), ("!!pairs", "x"), ("!!value", "x"), ("!!merge", "x")]


def _scalar(text: str, form: str, tag, indent: int) -> list:
    """TEXT written in FORM with TAG, as the lines of a value that starts after `key: `."""
    head = "" if tag is None else tag + " "
    if form == "plain":
        return [head + text]
    if form == "single":
        return [head + "'" + text.replace("'", "''") + "'"]
    if form == "double":
        return [head + json.dumps(text)]
    mark = "|-" if form == "literal" else ">-"
    return [head + mark, " " * (indent + 2) + text]


def _good(c, position: str, op=None):
    """(text, form, tag): a valid value for POSITION, in any form that keeps it valid."""
    if position == "schema":
        return c.pick([("1", "plain", None), ("1", "plain", "!!int"), ("0x1", "plain", None),
                                     ("+1", "plain", None), ("01", "plain", "!!int")])
    values = {"mixed_group": ["allow", "warn", "uniform", "error"],
              "on_unsupported": ["downgrade", "error"], "verify": ["warn", "required"],
              "cc": ["8.6", "12.0", ">=8.9", "sm_86", ">=8.9,<13.0", "!=9.0", "SM_120"],
              "name": ["rtx-3080", "rtx-5090", "h200", "RTX-4090"],
              "id": ["sim:rtx-3080", "cuda:0", "cpu", "sim:rtx-3080@1", "rank1:cuda:1"]}
    if position == "backend":
        values["backend"] = [b.name for b in REG.backends(op)]
    text = c.pick(values[position])
    form = c.pick(FORMS)
    if form == "plain" and text[0] in "!&*|>%@`'\"{[#,?:-":
        form = "double"    # plain, an indicator would start another YAML construct
    numeric = re.fullmatch(r"[0-9.]+", text) is not None
    # A number at a text position is read as written; a tag on it says str.
    tag = c.pick(TEXT_TAGS)
    if numeric and form == "plain" and tag is None and position != "cc":
        tag = "!!str"
    return text, form, tag


def _unknown(position: str):
    return {"schema": ["2", "0", "true"], "mixed_group": ["maybe", "Warn", "uniformly"],
            "on_unsupported": ["fallback", "strict"], "verify": ["always", "on"],
            "cc": ["sm_x", "8.6.1.2", ">>8", "nope"], "name": ["rtx-9999", "nope"],
            "id": ["gpu0", "sim:", "cuda:x"], "backend": ["nope", "trition"]}[position]


def _bad(c, position: str):
    """(text, form, tag, needles): an invalid value for POSITION and what its error names."""
    kind = c.pick(["mismatch", "refused", "unknown", "list"])
    if kind == "mismatch":
        tag, text = c.pick(TAG_MISMATCH)
        if position == "verify" and (tag, text) == ("!!bool", "1"):
            text = "2"     # !!bool 1 is not a bool anyway; keep the example of its kind
        return text, "plain", tag, [tag, repr(text)]
    if kind == "refused":
        tag, text = c.pick(REFUSED_TAGS)
        return text, "plain", tag, [f"tag {tag} is not allowed"]
    if kind == "list":
        return "[x]", "plain", None, ["must be a single value"]
    text = c.pick(_unknown(position))
    if position == "schema":
        return text, "plain", None, ["schema", "valid: 1"]
    form = c.pick(["plain", "double"])
    if text.endswith(":") or text[0] in "!&*|>%@`'\"{[#,?:-":
        form = "double"
    return text, form, None, [text]


class _Doc:
    def __init__(self):
        self.lines = []

    def put(self, prefix: str, value, indent: int) -> int:
        """Write `PREFIX VALUE`; the 1-based line of the value."""
        text, form, tag = value[:3]
        rows = _scalar(text, form, tag, indent)
        self.lines.append(prefix + rows[0])
        self.lines += rows[1:]
        return len(self.lines) - len(rows) + 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _policy(c):
    """(text, expected): a policy document and None when it is valid, else (line, needles)."""
    positions = ["schema", "mixed_group", "on_unsupported", "verify", "backend", "cc", "name", "id"]
    bad_at = c.pick(positions + [None, "key", "dup", "merge"])
    doc, expected = _Doc(), None

    def value(position, op=None):
        nonlocal expected
        if position == bad_at and expected is None:
            v = (_bad(c, position))
            return v, True
        return (_good(c, position, op)), False

    for key in ("schema", "mixed_group", "on_unsupported", "verify"):
        if c.pick((False, True)) or bad_at == key:
            v, bad = value(key)
            line = doc.put(f"{key}: ", v, 0)
            if bad:
                expected = (line, v[3])
    if bad_at == "key":
        tag, text = c.pick([(None, "mixed_grup"), ("!!bool", "maybe"), ("!!int", "1"),
                                          ("!!python/name:os.system", "x")])
        line = doc.put("", (f"{'' if tag is None else tag + ' '}{text}: warn", "plain", None), 0)
        expected = (line, [text] if tag is None or tag == "!!int" else [tag])
    op = c.pick(OPS)
    anchor = c.pick((False, True))
    doc.lines.append(f"ops: {'&o ' if anchor else ''}")
    doc.lines.append(f"  {op}:")
    valid = [b.name for b in REG.backends(op)]
    names = list(dict.fromkeys([c.pick(valid), c.pick(valid)][:c.pick((1, 2))]))
    for i, name in enumerate(names):
        good = (_good(c, "backend", op))
        v, bad = ((_bad(c, "backend")), True) if bad_at == "backend" and i == 0 and expected is None \
            else ((name,) + good[1:], False)
        line = doc.put("    - ", v, 4)
        if bad:
            expected = (line, v[3])
    if bad_at == "dup" and expected is None:
        doc.lines.append(f"  {op}: [torch]")
        expected = (len(doc.lines), ["given twice"])
    doc.lines.append("devices:")
    doc.lines.append("  - match: &m")
    for key in ("cc", "name", "id"):
        if key == bad_at or c.pick((False, True)) or key == "cc":
            v, bad = value(key)
            line = doc.put(f"      {key}: ", v, 6)
            if bad and expected is None:
                expected = (line, v[3])
    doc.lines.append(f"    ops: {'*o' if anchor else '{}'}")
    if c.pick((False, True)) or bad_at == "merge":
        doc.lines.append("  - match:")
        if bad_at == "merge" and expected is None:
            doc.lines.append("      <<: 3")
            expected = (len(doc.lines), ["merge key <<"])
        else:
            doc.lines.append("      <<: *m")
            doc.lines.append("      id: cpu")
    return doc.text(), expected


class _Choices:
    """Choices read from a byte string: one hypothesis draw per document (a draw per choice
    costs ten times the parse), still shrinking towards the first of every choice."""

    def __init__(self, data: bytes):
        self.data, self.i = data, 0

    def pick(self, options):
        options = list(options)
        b = self.data[self.i] if self.i < len(self.data) else 0
        self.i += 1
        return options[b % len(options)]


policies = st.binary(min_size=64, max_size=64).map(lambda b: _policy(_Choices(b)))


def _loads_or_refuses(text, expected):
    try:
        pf = parse(text, "fuzz.yaml", REG, known_devices=KNOWN)
    except PolicyError as exc:
        msg = str(exc)
        assert "\n" not in msg and len(msg) < 2000, msg
        assert expected is not None, f"a valid policy was refused: {msg}\n{text}"
        line, needles = expected
        assert exc.line == line and msg.startswith(f"fuzz.yaml:{line}: "), (msg, text)
        for n in needles:
            assert n in msg, (n, msg, text)
        return None
    assert expected is None, f"accepted, but line {expected[0]} is invalid ({expected[1]}):\n{text}"
    assert isinstance(pf, PolicyFile)
    return pf


@settings(max_examples=BUDGETS["policy"])
@given(policies)
def test_generated_policies_load_as_written_or_name_file_line_value(doc):
    RAN["test_generated_policies_load_as_written_or_name_file_line_value"] += 1
    _loads_or_refuses(*doc)


# --------------------------------------------------------------------------------------------
# Device lists and op lists: one reading for every flag, variable and the API
# --------------------------------------------------------------------------------------------

GOOD_DEVICES = ["sim:rtx-3080", "sim:sm_86", "cpu", "sim:h200", "sim:RTX-5090"]
BAD_DEVICES = ["sim:nope", "cuda:x", "sim:", "gpu", "sim:rtx-3080#1"]
SEPARATORS = [",", ", ", " ,", " , "]


def _comma_list(c, good, bad):
    n = c.pick((1, 2, 3))
    items = [c.pick(good + bad if c.pick((False, True)) else good) for _ in range(n)]
    seps = [c.pick(SEPARATORS + [",,", ", ,"]) for _ in range(n - 1)]
    text = items[0] + "".join(s + i for s, i in zip(seps, items[1:]))
    lead = c.pick(["", "", "", ",", " , "])
    trail = c.pick(["", "", "", ",", ", "])
    text = lead + text + trail
    if c.pick(range(20)) == 0:
        text = c.pick(["", " ", ",", ",,"])
    empty = any(not p.strip() for p in text.split(","))
    valid = not empty and all(p.strip() in good for p in text.split(","))
    return text, valid, empty


def comma_lists(good, bad):
    """(text, valid, empty_entry): a comma list with optional empty entries and bad names."""
    return st.binary(min_size=12, max_size=12).map(lambda b: _comma_list(_Choices(b), good, bad))


@settings(max_examples=BUDGETS["lists"])
@given(comma_lists(GOOD_DEVICES, BAD_DEVICES), st.sampled_from(["--device", "CAPDISPATCH_SGLANG_DEVICES"]),
       comma_lists(OPS, ["kv_qaunt", "nope", "MOE"]))
def test_the_list_readers(devs, source, ops):
    RAN["test_the_list_readers"] += 1
    text, _, empty = devs
    if empty:
        with pytest.raises(cd.BadInput) as ei:
            extend.device_list(text, source)
        assert source in str(ei.value) and "empty" in str(ei.value) and "DEV[,DEV...]" in str(ei.value)
    else:
        assert extend.device_list(text, source) == [p.strip() for p in text.split(",")]
    text, valid, empty = ops
    if valid:
        assert extend.op_list(text, "--op", REG) == list(dict.fromkeys(p.strip() for p in text.split(",")))
    else:
        with pytest.raises(cd.BadInput) as ei:
            extend.op_list(text, "--op", REG)
        msg = str(ei.value)
        assert msg.startswith("--op") and ("empty" in msg if empty else "unknown op" in msg), msg


def _run(argv, env=None, entry=main):
    clear = {k: "" for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT",
                             "CAPDISPATCH_VERIFY", "CAPDISPATCH_LOCK", "CAPDISPATCH_SGLANG_DEVICES",
                             "CAPDISPATCH_DEBUG")}
    with mock.patch.dict(os.environ, {**clear, **(env or {})}):
        try:
            return entry(argv)
        except SystemExit as exc:     # argparse's own usage errors
            return exc.code
        except BaseException as exc:  # the property: nothing escapes main()
            pytest.fail(f"{argv!r} raised {type(exc).__name__}: {exc}")


def _refused(capsys, rc, *needles):
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert_no_crash(err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@settings(max_examples=BUDGETS["cli_devices"])
@given(comma_lists(GOOD_DEVICES, BAD_DEVICES),
       st.sampled_from(["explain", "devices", "lock", "sglang-flag", "sglang-env"]))
def test_device_lists_read_one_way_by_every_command(capsys, devs, command):
    RAN["test_device_lists_read_one_way_by_every_command"] += 1
    text, valid, empty = devs
    env, entry = None, main
    if command == "explain":
        argv, source = ["explain", "--device", text, "--op", "kv_quant", "--brief"], "--device"
    elif command == "devices":
        argv, source = ["devices", "--device", text, "--format", "json"], "--device"
    elif command == "lock":
        argv, source = ["lock", "--device", text, "--op", "kv_quant"], "--device"
    else:
        from capdispatch.adapters.sglang.cli import main as entry
        if command == "sglang-flag":
            argv, source = ["plan", "--device", text, "--brief"], "--device"
        else:
            if not text.strip():
                return        # an empty variable is an unset one: the local GPUs, not this test's
            argv, source, env = ["plan", "--brief"], "CAPDISPATCH_SGLANG_DEVICES", \
                {"CAPDISPATCH_SGLANG_DEVICES": text}
    rc = _run(argv, env, entry)
    if valid:
        out, err = capsys.readouterr()
        assert rc == 0, err
        return
    bad = next((p.strip() for p in text.split(",") if p.strip() and p.strip() not in GOOD_DEVICES), None)
    _refused(capsys, rc, source, *([] if empty or bad is None else [bad.split(":", 1)[-1]]))


@settings(max_examples=BUDGETS["cli_ops"])
@given(comma_lists(OPS, ["kv_qaunt", "nope", "MOE"]), st.sampled_from(["explain", "lock", "verify"]))
def test_op_lists_read_one_way_by_every_command(capsys, ops, command):
    RAN["test_op_lists_read_one_way_by_every_command"] += 1
    text, valid, empty = ops
    if valid and command == "verify":
        return       # running canaries is verify's own test; here only the reading
    argv = {"explain": ["explain", "--device", "sim:rtx-3080", "--op", text, "--brief"],
            "lock": ["lock", "--device", "sim:rtx-3080", "--op", text],
            "verify": ["verify", "--device", "cpu", "--op", text]}[command]
    rc = _run(argv)
    if valid:
        out, err = capsys.readouterr()
        assert rc == 0, err
        return
    _refused(capsys, rc, "--op", "empty entry" if empty and text.strip() else "")


# --------------------------------------------------------------------------------------------
# CAPDISPATCH_* values: every variable, through the command line and the API
# --------------------------------------------------------------------------------------------

FLAG_VALUES = ["1", "0", "true", "FALSE", "Yes", "no", "on", "OFF", "", " ", "maybe", "2", "y", "enable", "\u00e9"]
ENV_CASES = {
    "CAPDISPATCH_STRICT": (FLAG_VALUES, lambda v: v.strip().lower() in cd.dispatch.resolver.FLAG_ON
                           + cd.dispatch.resolver.FLAG_OFF),
    "CAPDISPATCH_DEBUG": (FLAG_VALUES, lambda v: v.strip().lower() in cd.dispatch.resolver.FLAG_ON
                          + cd.dispatch.resolver.FLAG_OFF),
    "CAPDISPATCH_VERIFY": (["off", "warn", "required", "", "maybe", "Warn", "on"],
                           lambda v: v in ("", "off", "warn", "required")),
    "CAPDISPATCH_SET": (["kv_quant=torch", "kv_quant=torch,moe=torch", "kv_quant", "=torch", "kv_qaunt=torch",
                         "kv_quant=nope", ""], lambda v: v in ("", "kv_quant=torch", "kv_quant=torch,moe=torch")),
    "CAPDISPATCH_POLICY": (["{good}", "{good}" + os.pathsep + "{good}", "{good},{good}", "{good}" + os.pathsep,
                            os.pathsep + "{good}", "{empty}", "{bad}", "{missing}", "{dir}", ""],
                           lambda v: v in ("", "{good}", "{good}" + os.pathsep + "{good}")),
    "CAPDISPATCH_CACHE_DIR": (["{dir}", "{good}", "{missing}"], lambda v: v in ("{dir}", "{missing}")),
    "CAPDISPATCH_IMPORT_TIMEOUT": (["1", "60", "0", "-1", "nan", "x", "", "3601"],
                                   lambda v: v in ("1", "60", "")),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hard-env")
    (d / "good.yaml").write_text("schema: 1\nmixed_group: allow\n")
    (d / "empty.yaml").write_text("# nothing\n")
    (d / "bad.yaml").write_text("mixed_group: !!bool maybe\n")
    return {"good": str(d / "good.yaml"), "empty": str(d / "empty.yaml"), "bad": str(d / "bad.yaml"),
            "missing": str(d / "missing" / "x"), "dir": str(d)}


@settings(max_examples=BUDGETS["env"])
@given(st.sampled_from(sorted(ENV_CASES)), st.data(),
       st.sampled_from(["explain", "api", "sglang"]))
def test_every_variable_is_read_one_way(capsys, files, name, data, surface):
    RAN["test_every_variable_is_read_one_way"] += 1
    values, ok = ENV_CASES[name]
    template = data.draw(st.sampled_from(values))
    valid = ok(template)
    value = template.format(**files)
    env = {name: value}
    if name == "CAPDISPATCH_IMPORT_TIMEOUT":
        surface = "api-import"
    if surface == "explain":
        rc = _run(["explain", "--device", "sim:rtx-3080", "--op", "kv_quant", "--brief"], env)
        if valid:
            assert rc == 0, capsys.readouterr().err
            capsys.readouterr()
        else:
            _refused(capsys, rc, name if name != "CAPDISPATCH_POLICY" or "{" + "bad}" not in template
                     else "bad.yaml:1")
        return
    if surface == "sglang":
        from capdispatch.adapters.sglang.cli import main as entry
        rc = _run(["plan", "--device", "sim:rtx-3080", "--brief"], env, entry)
        if valid:
            assert rc == 0, capsys.readouterr().err
            capsys.readouterr()
        else:
            _refused(capsys, rc)
        return
    with mock.patch.dict(os.environ, env):
        if surface == "api-import":
            from capdispatch.capabilities.libraries import import_timeout
            call = lambda: import_timeout(os.environ)   # noqa: E731
        elif name == "CAPDISPATCH_DEBUG":
            from capdispatch.dispatch.errors import run_guarded
            call = lambda: run_guarded("t", lambda: 0) == 0 or (_ for _ in ()).throw(  # noqa: E731
                cd.BadInput(capsys.readouterr().err))
        else:
            call = lambda: cd.resolve("kv_quant", "sim:rtx-3080")   # noqa: E731
        if valid:
            call()
        else:
            with pytest.raises(cd.CapdispatchError) as ei:
                call()
            assert "\n" not in str(ei.value).strip() and not isinstance(ei.value, cd.Unsatisfiable)
    capsys.readouterr()


ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30) \
    | st.sampled_from(["1", "0", "yes", "off", "warn", "required", "kv_quant=torch", "sim:rtx-3080",
                       "sim:rtx-3080,", ",", os.pathsep, "60", "-1", "nan", " "])


@settings(max_examples=BUDGETS["env_text"])
@given(st.sampled_from(sorted(ENV_CASES) + ["CAPDISPATCH_SGLANG_DEVICES"]), ANY_TEXT,
       st.sampled_from(["explain", "sglang"]))
def test_any_variable_value_is_accepted_or_named(capsys, name, value, surface):
    """Arbitrary text in any variable: exit 0, or exit 2 with one line naming the variable
    (a policy file's own error names the file); never a traceback or an exit 1."""
    RAN["test_any_variable_value_is_accepted_or_named"] += 1
    if name in ("CAPDISPATCH_POLICY", "CAPDISPATCH_CACHE_DIR") and value.strip() and \
            os.path.exists(os.path.expanduser(value.split(os.pathsep)[0].strip() or ".")):
        return         # an existing path is the file tests' business, not arbitrary text's
    if name == "CAPDISPATCH_SGLANG_DEVICES" and not value.strip():
        return         # unset: the local GPUs, whose absence is the probe's tests' business
    if surface == "explain":
        rc = _run(["explain", "--device", "sim:rtx-3080", "--op", "kv_quant", "--brief"], {name: value})
    else:
        from capdispatch.adapters.sglang.cli import main as entry
        env = {name: value}
        if name != "CAPDISPATCH_SGLANG_DEVICES":
            env["CAPDISPATCH_SGLANG_DEVICES"] = "sim:rtx-3080"
        rc = _run(["plan", "--brief"], env, entry)
    out, err = capsys.readouterr()
    assert_no_crash(err)
    if name == "CAPDISPATCH_SGLANG_DEVICES" and surface == "explain":
        assert rc == 0, err        # explain does not read the plugin's variable
        return
    assert rc in (0, 2, 3), (rc, err)
    if rc == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and name in lines[0], (name, value, err)


# --------------------------------------------------------------------------------------------
# The Python API and the SGLang plugin's loading path read generated policy files too
# --------------------------------------------------------------------------------------------

@settings(max_examples=BUDGETS["api"])
@given(policies)
def test_generated_policies_through_the_api(tmp_path_factory, doc):
    RAN["test_generated_policies_through_the_api"] += 1
    text, expected = doc
    path = tmp_path_factory.mktemp("api") / "p.yaml"
    path.write_text(text)
    try:
        cd.resolve("kv_quant", "sim:rtx-3080", policy=str(path), env={})
    except cd.PolicyError as exc:
        assert expected is not None and exc.line == expected[0], (str(exc), text)
        return
    except cd.Unsatisfiable:
        pass     # a valid policy may still ask for what cannot run (mixed_group: error, strict)
    assert expected is None, (expected, text)


@settings(max_examples=BUDGETS["sglang"])
@given(policies, st.sampled_from(["CAPDISPATCH_POLICY", "--policy"]))
def test_generated_policies_through_the_sglang_loading_path(capsys, tmp_path_factory, doc, how):
    RAN["test_generated_policies_through_the_sglang_loading_path"] += 1
    from capdispatch.adapters.sglang import decide, knobs
    text, expected = doc
    path = str(tmp_path_factory.mktemp("sg") / "p.yaml")
    with open(path, "w") as fh:
        fh.write(text)
    release = knobs.load().releases[0]
    env = {"CAPDISPATCH_POLICY": path} if how == "CAPDISPATCH_POLICY" else {}
    try:
        decide.context_for(release, policy=(path,) if how == "--policy" else (), env=env)
    except cd.PolicyError as exc:
        assert expected is not None and exc.line == expected[0], (str(exc), text)
        assert ("from CAPDISPATCH_POLICY" in str(exc)) == (how == "CAPDISPATCH_POLICY"), str(exc)
        return
    assert expected is None, (expected, text)


def test_the_layer_ran_ten_thousand_cases():
    """Last in the module: the generated cases of this run, counted (not the budgets)."""
    tests = [n for n in globals() if n.startswith("test_") and n != "test_the_layer_ran_ten_thousand_cases"]
    if any(RAN[n] == 0 for n in tests):
        pytest.skip("only part of the layer ran (-k)")
    assert sum(RAN.values()) >= 10_000, dict(RAN)
