"""Policy files: every mistake is reported with file:line, the value and what is valid."""
import pytest

from capdispatch.backends import builtin
from capdispatch.dispatch.resolver import known_device_names
from capdispatch.policies import PolicyError, build, load_file, parse


def _parse(text):
    return parse(text, "p.yaml", builtin(), known_devices=known_device_names())


@pytest.mark.parametrize("text,line,needles", [
    ("mixed_grup: warn\n", 1, ["unknown key 'mixed_grup'", "did you mean 'mixed_group'"]),
    ("mixed_group: uniformly\n", 1, ["'uniformly'", "did you mean 'uniform'", "allow, warn, uniform, error"]),
    ("on_unsupported: fail\n", 1, ["'fail'", "downgrade, error"]),
    ("schema: 2\n", 1, ["schema 2 is not supported"]),
    ("ops:\n  kv_qaunt: [torch]\n", 2, ["unknown op 'kv_qaunt'", "did you mean 'kv_quant'"]),
    ("ops:\n  kv_quant: []\n", 2, ["list is empty"]),
    ("ops:\n  kv_quant: [torch, torch]\n", 2, ["listed twice"]),
    ("ops:\n  kv_quant: {a: 1}\n", 2, ["must be a list"]),
    ("ops: {kv_quant: [torch]}\nops: {kv_dequant: [torch]}\n", 2, ["given twice (first at line 1)"]),
    ("devices:\n  - match: {name: rtx-5909}\n    ops: {kv_quant: [torch]}\n", 2,
     ["unknown device 'rtx-5909'", "did you mean 'rtx-5090'"]),
    ("devices:\n  - match: {cc: eight}\n", 2, ["'eight' is not a compute capability"]),
    ("devices:\n  - match: {gpu: h200}\n", 2, ["unknown key 'gpu'", "id, name, cc"]),
    ("devices:\n  - match: {id: gpu0}\n", 2, ["'gpu0' is not a device id"]),
    ("devices:\n  - ops: {kv_quant: [torch]}\n", 2, ["needs a 'match'"]),
    ("devices:\n  - match: {cc: '8.6'}\n    opps: {}\n", 3, ["unknown key 'opps'", "did you mean 'ops'"]),
    ("ops:\n  kv_quant: !custom [torch]\n", 2, ["tag '!custom' is not allowed"]),
    ("- just\n- a list\n", 1, ["the policy must be a mapping"]),
    ("ops:\n  kv_quant: [torch\n", 3, ["malformed YAML"]),
    # size buckets (more in test_buckets.py)
    ("ops:\n  kv_quant:\n    - {rows: '<=8', prefer: [torch]}\n", 3, ["no catch-all bucket for rows above 8"]),
    ("ops:\n  kv_quant:\n    - {rows: '<=8', prefer: [trition_u8]}\n    - {prefer: [torch]}\n", 3,
     ["unknown backend 'trition_u8'", "did you mean 'triton_u8'"]),
    ("devices:\n  - match: {cc: '8.6'}\n    ops:\n      kv_quant:\n        - {rows: '<=8', prefer: [torch]}\n"
     "        - {rows: '<=4', prefer: [torch]}\n        - {prefer: [torch]}\n", 6, ['"<=4" is below']),
])
def test_policy_errors(text, line, needles):
    with pytest.raises(PolicyError) as ei:
        _parse(text)
    assert ei.value.line == line, str(ei.value)
    msg = str(ei.value)
    assert msg.startswith(f"p.yaml:{line}: ")
    for n in needles:
        assert n in msg


def test_single_name_is_a_list_and_cc_ranges_match():
    pf = _parse("ops:\n  kv_quant: torch\ndevices:\n  - match: {cc: '>=8.9'}\n    ops: {kv_dequant: triton_u8}\n")
    assert pf.ops["kv_quant"].value == ("torch",)
    import capdispatch as cd
    assert pf.devices[0].matches(cd.probe("sim:rtx-4090"))
    assert not pf.devices[0].matches(cd.probe("sim:rtx-3080"))
    assert not pf.devices[0].matches(cd.probe("cpu"))


def test_empty_file_is_an_empty_policy(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    assert load_file(p, builtin()).ops == {}


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_file(tmp_path / "nope.yaml", builtin())


def test_on_unsupported_error_makes_downgrades_refusals(tmp_path):
    import capdispatch as cd
    p = tmp_path / "strict.yaml"
    p.write_text("on_unsupported: error\nops:\n  kv_quant: [triton_fp8]\n")
    with pytest.raises(cd.Unsatisfiable, match="strict"):
        cd.resolve("kv_quant", "sim:rtx-3080", policy=str(p), assume_libs=["triton"], env={})


def test_later_files_win_and_selections_win_over_files(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("mixed_group: uniform\nops: {kv_quant: [torch]}\n")
    b.write_text("ops: {kv_quant: [triton_u8]}\n")
    stack = build(builtin(), policy=[str(a), str(b)], env={})
    assert stack.setting("mixed_group").value == "uniform"
    import capdispatch as cd
    spec = cd.probe("sim:h200")
    assert stack.preference("kv_quant", spec).backends == ("triton_u8",)
    stack = build(builtin(), policy=[str(a), str(b)], selections={"kv_quant": "torch"},
                  env={"CAPDISPATCH_SET": "kv_quant=triton_fp8"})
    pref = stack.preference("kv_quant", spec)
    assert pref.backends == ("torch",) and pref.origin == "selections="


def test_a_user_file_beats_the_defaults_device_entries(tmp_path):
    import capdispatch as cd
    p = tmp_path / "mine.yaml"
    p.write_text("ops: {indexer: [torch]}\n")
    spec = cd.probe("sim:rtx-3080")
    assert build(builtin(), env={}).preference("indexer", spec).origin.startswith("default.yaml:")
    assert "device cc <8.9" in build(builtin(), env={}).preference("indexer", spec).origin
    pref = build(builtin(), policy=str(p), env={}).preference("indexer", spec)
    assert pref.backends == ("torch",) and pref.user
