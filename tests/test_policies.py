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
    ("devices:\n  - match: {cc: '8.60'}\n", 2, ["minor number is one digit", 'did you mean "8.6"']),
    ("devices:\n  - match: {cc: '>=8.90,<13.0'}\n", 2, ["minor number is one digit", 'did you mean ">=8.9,<13.0"']),
    ("devices:\n  - match: {cc: '8.65'}\n", 2, ["minor number is one digit", "8.65"]),
    ("devices:\n  - match: {gpu: h200}\n", 2, ["unknown key 'gpu'", "id, name, cc"]),
    ("devices:\n  - match: {id: gpu0}\n", 2, ["'gpu0' is not a device id"]),
    ("devices:\n  - ops: {kv_quant: [torch]}\n", 2, ["needs a 'match'"]),
    ("devices:\n  - match: {cc: '8.6'}\n    opps: {}\n", 3, ["unknown key 'opps'", "did you mean 'ops'"]),
    ("ops:\n  kv_quant: !custom [torch]\n", 2, ["tag !custom is not allowed"]),
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


@pytest.mark.parametrize("text", ["", "# nothing\n", "\n\n", "---\n", "--- # x\n...\n"])
def test_a_file_without_a_policy_is_an_error_and_schema_1_is_the_empty_policy(tmp_path, text):
    p = tmp_path / "empty.yaml"
    p.write_text(text)
    with pytest.raises(PolicyError, match=r"empty.yaml: the file holds no policy .*write `schema: 1`"):
        load_file(p, builtin())
    p.write_text("# nothing to change\nschema: 1\n")
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


def _all_devices():
    import capdispatch as cd
    from capdispatch.capabilities import catalog
    from capdispatch.dispatch.group import unique_ids
    specs = [cd.probe(f"sim:{n}") for n in catalog.names()] + [cd.probe("cpu")]
    return specs + unique_ids([cd.probe("sim:rtx-3080"), cd.probe("sim:rtx-3080")])


@pytest.mark.parametrize("texts", [
    [],
    ["ops: {indexer: [torch]}\n"],
    ["verify: off\n", "verify: required\n"],
    ["mixed_group: uniform\ndevices:\n  - match: {name: geforce-rtx-3080}\n    ops: {moe: [torch]}\n",
     "on_unsupported: error\nops: {kv_quant: [torch]}\ndevices:\n"
     "  - match: {cc: '>=12.0,<13.0'}\n    ops: {indexer: [triton], kv_dequant: [torch, triton_u8]}\n"
     "  - match: {id: 'sim:rtx-3080@1'}\n    ops: {kv_quant: [triton_u8]}\n"
     "  - match: {name: NVIDIA GeForce RTX 5090, cc: '12.0'}\n    ops: {decode_mla: [torch]}\n"],
    ["ops:\n  decode_mla:\n    - {tokens: '<=16', prefer: [triton_fp8, flashmla]}\n"
     "    - {prefer: [flashmla, triton]}\n"
     "devices:\n  - match: {cc: '8.6'}\n    ops:\n      kv_dequant:\n"
     "        - {rows: '<=4096', prefer: [triton_u8]}\n        - {prefer: [torch]}\n"],
])
def test_policy_show_round_trips(tmp_path, texts):
    """`policy show` is a policy file: loaded alone it gives the same effective policy."""
    from capdispatch.policies.show import merged
    paths = []
    for i, t in enumerate(texts):
        p = tmp_path / f"p{i}.yaml"
        p.write_text(t)
        paths.append(str(p))
    reg = builtin()
    known = known_device_names()
    stack = build(reg, policy=paths, env={}, known_devices=known)
    _, text = merged(stack, reg)
    shown = tmp_path / "shown.yaml"
    shown.write_text(text)
    again = build(reg, policy=str(shown), env={}, known_devices=known)
    for key in ("mixed_group", "on_unsupported", "verify"):
        assert again.setting(key).value == stack.setting(key).value
    for spec in _all_devices():
        for op in reg.ops:
            a, b = stack.preference(op, spec), again.preference(op, spec)
            assert a.backends == b.backends, (op, spec.id, a.origin, b.origin)
            assert [(x.upper, x.backends) for x in a.buckets] == \
                [(x.upper, x.backends) for x in b.buckets], (op, spec.id)
    # Shown twice is the same text, but for the origins in comments.
    _, text2 = merged(again, reg)
    strip = lambda t: [ln.split("    #")[0] for ln in t.splitlines() if not ln.startswith("#")]
    assert strip(text2) == strip(text)


def test_alias_and_driver_names_match_what_they_validate():
    import capdispatch as cd
    for name in ("geforce-rtx-3080", "rtx-3080", "NVIDIA GeForce RTX 3080", "RTX-3080"):
        pf = _parse(f"devices:\n  - match: {{name: {name}}}\n    ops: {{kv_quant: [torch]}}\n")
        assert pf.devices[0].matches(cd.probe("sim:rtx-3080")), name
        assert pf.devices[0].matches(cd.probe("sim:geforce-rtx-3080")), name
        assert pf.devices[0].matches(cd.probe("sim:NVIDIA GeForce RTX 3080")), name
        assert not pf.devices[0].matches(cd.probe("sim:rtx-3090")), name
    # A real card's facts: matched through its driver name to the catalog key.
    real = cd.DeviceSpec(id="cuda:0", name="NVIDIA GeForce RTX 3080", platform="cuda", cc="8.6",
                         probe="nvml", catalog_key="rtx-3080")
    assert _parse("devices:\n  - match: {name: geforce-rtx-3080}\n").devices[0].matches(real)
    assert cd.probe("sim:NVIDIA GeForce RTX 5090").id == "sim:rtx-5090"


def test_repeated_cards_are_named_by_position_and_matched_consistently():
    import capdispatch as cd
    from capdispatch.dispatch.group import unique_ids
    specs = unique_ids([cd.probe(d) for d in ("sim:rtx-5090", "sim:rtx-3080", "sim:rtx-3080")])
    assert [s.id for s in specs] == ["sim:rtx-5090", "sim:rtx-3080@1", "sim:rtx-3080@2"]
    every = _parse("devices:\n  - match: {id: 'sim:rtx-3080'}\n    ops: {kv_quant: [torch]}\n")
    one = _parse("devices:\n  - match: {id: 'sim:rtx-3080@2'}\n    ops: {kv_quant: [torch]}\n")
    assert [every.devices[0].matches(s) for s in specs] == [False, True, True]
    assert [one.devices[0].matches(s) for s in specs] == [False, False, True]
    # The same card in another group position is another copy; ids of unique cards never change.
    assert [s.id for s in unique_ids([cd.probe("sim:rtx-3080"), cd.probe("sim:h200")])] == \
        ["sim:rtx-3080", "sim:h200"]
    # A distributed group names ranks: `cuda:1` still matches rank 1's card.
    ranked = cd.DeviceSpec(id="rank1:cuda:1", name="x", platform="cuda", cc="9.0", probe="nvml")
    assert _parse("devices:\n  - match: {id: 'cuda:1'}\n").devices[0].matches(ranked)
    assert _parse("devices:\n  - match: {id: 'rank1:cuda:1'}\n").devices[0].matches(ranked)
    assert not _parse("devices:\n  - match: {id: 'rank0:cuda:1'}\n").devices[0].matches(ranked)


@pytest.mark.parametrize("value,on", [("1", True), ("true", True), ("YES", True), (" on ", True),
                                      ("0", False), ("false", False), ("No", False), ("off", False),
                                      ("", False)])
def test_strict_variable_words(value, on):
    import capdispatch as cd
    env = {"CAPDISPATCH_STRICT": value, "CAPDISPATCH_SET": "kv_quant=triton_fp8"}
    if on:
        with pytest.raises(cd.StrictFallbackError):
            cd.resolve("kv_quant", "sim:rtx-3080", assume_libs=["triton"], env=env)
    else:
        assert cd.resolve("kv_quant", "sim:rtx-3080", assume_libs=["triton"], env=env).backend == "triton_u8"


def test_strict_variable_junk_is_refused():
    import capdispatch as cd
    with pytest.raises(cd.BadInput, match=r"CAPDISPATCH_STRICT='maybe' is not a yes/no value.*true"):
        cd.resolve("kv_quant", "sim:rtx-3080", env={"CAPDISPATCH_STRICT": "maybe"})


@pytest.mark.parametrize("make,needle", [
    (lambda d: d, "it is a directory"),
    (lambda d: d / "absent.yaml", "No such file"),
    (lambda d: str(d / "a\0b.yaml"), "NUL byte"),
    (lambda d: str(d) + "/\ud800.yaml", "not valid in this file system's encoding"),
    (lambda d: "/proc/self/environ", "is not allowed in YAML"),
])
def test_paths_that_are_not_policy_files(tmp_path, make, needle):
    with pytest.raises(PolicyError, match=needle):
        load_file(make(tmp_path), builtin())


def test_undecodable_and_huge_files(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"ops:\n  kv_quant: [torch]\n\xff\xfe\x00\n")
    with pytest.raises(PolicyError) as ei:
        load_file(p, builtin())
    assert ei.value.line == 3 and "not UTF-8" in str(ei.value) and "0xff" in str(ei.value)
    big = tmp_path / "big.yaml"
    big.write_text("# x\n" * 300_000)
    with pytest.raises(PolicyError, match="larger than 1024 KiB"):
        load_file(big, builtin())


def test_every_error_is_a_capdispatch_error():
    import capdispatch as cd
    from capdispatch import extend
    from capdispatch.adapters.sglang.knobs import KnobsError
    from capdispatch.backends.moe import LayoutError
    from capdispatch.backends.registry import RegistryError
    from capdispatch.calibrate.ladder import SizesError
    from capdispatch.capabilities import AssumeCudaError
    from capdispatch.capabilities.libraries import AssumeLibError
    from capdispatch.dispatch.agreement import AgreementError
    from capdispatch.dispatch.binding import BackendLoadError
    for cls, base in [(cd.BadInput, ValueError), (PolicyError, ValueError), (cd.SelectionError, ValueError),
                      (cd.UnknownDeviceError, ValueError), (AssumeLibError, ValueError),
                      (AssumeCudaError, ValueError), (RegistryError, ValueError),
                      (LayoutError, ValueError), (KnobsError, ValueError),
                      (cd.ProbeError, RuntimeError), (cd.Unsatisfiable, RuntimeError),
                      (cd.NoBackendError, cd.Unsatisfiable), (cd.StrictFallbackError, cd.Unsatisfiable),
                      (cd.GroupDivergenceError, cd.Unsatisfiable), (AgreementError, cd.Unsatisfiable),
                      (BackendLoadError, cd.Unsatisfiable), (SizesError, ValueError),
                      (extend.ArgumentError, ValueError), (extend.ArgumentTypeError, TypeError),
                      (cd.UnsupportedDeviceError, RuntimeError)]:
        assert issubclass(cls, cd.CapdispatchError) and issubclass(cls, base), cls
    # A kernel's own argument check raises under the root too.
    from capdispatch.backends.v4_layout import bytes_per_page
    with pytest.raises(extend.ArgumentError):
        bytes_per_page(0)


def test_the_h200_example_policy_loads_and_buckets_decode_by_tokens():
    """The calibrated H200 example (capdispatch/policies/examples/h200.yaml, written by
    `dispatch bench --write-policy` on the card in the served form) is a valid policy: on a
    simulated H200 with the libraries it was measured with, decode_mla takes FlashMLA at
    every size (its schedule shared by the layers of a forward), the indexer TileLang or
    Triton by size, as measured; DeepGEMM, which did not run there, keeps its default place."""
    import os

    import capdispatch as cd
    path = os.path.join(os.path.dirname(cd.__file__), "policies", "examples", "h200.yaml")
    from capdispatch.capabilities.lib_profiles import Profile, ProfileLib
    measured = Profile("h200-run", "the libraries the calibration had", "-", tuple(
        ProfileLib(n, v) for n, v in (("sgl-flash-mla", "1.0.0"), ("tilelang", "0.1.12"), ("torch", "2.11.0"),
                                      ("triton", "3.6.0"))))
    res = cd.resolve("decode_mla", "sim:h200", policy=path, libs=measured)
    assert [res.backend_for(n) for n in (1, 64, 65, 4096)] == ["flashmla"] * 4
    assert not res.warnings                  # the libraries it was measured with: no warning
    idx = cd.resolve("indexer", "sim:h200", policy=path, libs=measured)
    assert [c.backend for c in idx.candidates][0] == "deepgemm" and not idx.fallback
    assert [idx.backend_for(n) for n in (1, 8, 64, 512, 4096)] == ["tilelang", "triton", "tilelang", "triton",
                                                                   "triton"]
    assert cd.resolve("moe", "sim:h200", policy=path, libs=measured).backend_for(512) == "triton_w4a16"
    libs = ["sgl-flash-mla==1.0.0", "tilelang==0.1.12", "torch==2.11.0", "triton==3.6.0"]
    # Another card is not matched by it: the built-in order decides there.
    assert cd.resolve("decode_mla", "sim:rtx-3080", policy=path, assume_libs=libs).backend_for(1) == \
        cd.resolve("decode_mla", "sim:rtx-3080", assume_libs=libs).backend_for(1)


# --- explicit tags with values not of their kind ---------------------------------------------

@pytest.mark.parametrize("text,line,needles", [
    ("mixed_group: !!bool maybe\n", 1, ["mixed_group: !!bool 'maybe' is not a YAML bool",
                                         "true, false, yes, no, on, off", "takes allow, warn, uniform, error"]),
    ("verify: !!bool maybe\n", 1, ["verify: !!bool 'maybe'", "takes off, warn, required"]),
    ("schema: !!bool 1\n", 1, ["schema: !!bool '1' is not a YAML bool", "schema takes 1"]),
    ("schema: !!int x\n", 1, ["schema: !!int 'x' is not a YAML int", "a whole number"]),
    ("schema: !!float x\n", 1, ["!!float 'x' is not a YAML float"]),
    ("schema: !!null x\n", 1, ["!!null 'x' is not a null", "schema takes 1"]),
    ("ops:\n  moe: [!!bool maybe]\n", 2, ["a backend of moe: !!bool 'maybe'", "triton_w4a16"]),
    ("ops:\n  !!bool maybe: [torch]\n", 2, ["a key in ops: !!bool 'maybe'", "kv_quant"]),
    ("devices:\n  - match: {cc: !!int 8.6}\n", 2, ["!!int '8.6' is not a YAML int"]),
    ("ops: !!python/object/apply:os.system [ls]\n", 1, ["tag !!python/object/apply:os.system is not allowed"]),
    ("ops: !!python/name:os.system\n", 1, ["tag !!python/name:os.system is not allowed"]),
    ("ops:\n  kv_quant: !!set {torch}\n", 2, ["tag !!set is not allowed"]),
    ("schema: !!timestamp 2001-01-01\n", 1, ["tag !!timestamp is not allowed"]),
    ("schema: !!binary aGk=\n", 1, ["tag !!binary is not allowed"]),
    ("schema: &a !!bool maybe\n", 1, ["schema: !!bool 'maybe'"]),
    # A list or mapping tag on a single value, a value tag on a list or mapping.
    ("ops:\n  kv_quant: !!seq x\n", 2, ["a backend of kv_quant: !!seq 'x' is not a YAML seq",
                                        "a list such as [a, b]", "a single value takes !!str"]),
    ("ops: !!map x\n", 1, ["ops: !!map 'x' is not a YAML map", "a mapping such as {a: 1}"]),
    ("ops:\n  kv_quant: !!seq\n", 2, ["!!seq '' is not a YAML seq"]),
    ("ops:\n  moe: [!!map x]\n", 2, ["!!map 'x' is not a YAML map"]),
    ("ops:\n  kv_quant: !!str [torch]\n", 2, ["!!str on a list is not a YAML str",
                                              "a list takes !!seq or no tag"]),
    ("ops: !!seq {kv_quant: [torch]}\n", 1, ["ops: !!seq on a mapping", "a mapping takes !!map"]),
])
def test_explicit_tags_with_bad_values_name_line_tag_value_and_valid(text, line, needles):
    with pytest.raises(PolicyError) as ei:
        _parse(text)
    msg = str(ei.value)
    assert ei.value.line == line and msg.startswith(f"p.yaml:{line}: "), msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("text", [
    "schema: !!int 1\n", "mixed_group: !!str warn\n", "verify: !!str off\n",
    "ops: !!map {kv_quant: !!seq [!!str torch]}\n", "ops:\n  kv_quant: ! torch\n",
])
def test_explicit_tags_with_good_values_load(text):
    _parse(text)


def test_merge_keys_merge_and_own_entries_override():
    pf = _parse("devices:\n  - match: &m {cc: '8.6'}\n    ops: &o {kv_quant: [torch], kv_dequant: [torch]}\n"
                "  - match: {<<: *m, name: rtx-3080}\n    ops:\n      <<: *o\n      kv_quant: [triton_u8]\n")
    second = pf.devices[1]
    assert second.match == {"cc": "8.6", "name": "rtx-3080"}
    assert second.ops["kv_quant"].value == ("triton_u8",) and second.ops["kv_quant"].line == 7
    assert second.ops["kv_dequant"].value == ("torch",) and second.ops["kv_dequant"].line == 3
    with pytest.raises(PolicyError, match=r"p.yaml:2: ops: the merge key << takes a mapping"):
        _parse("ops:\n  <<: 3\n")
    with pytest.raises(PolicyError, match=r"given twice"):
        _parse("ops:\n  kv_quant: [torch]\n  kv_quant: [torch]\n")


def test_a_merged_mapping_reached_again_through_an_alias_reads_the_same():
    pf = _parse("ops: &o\n  <<: {kv_quant: [torch]}\n  kv_quant: [triton_u8]\n  kv_dequant: [torch]\n"
                "devices:\n  - match: {cc: '8.6'}\n    ops: *o\n")
    assert pf.ops["kv_quant"].value == ("triton_u8",)
    assert pf.devices[0].ops["kv_quant"].value == ("triton_u8",)
    assert pf.devices[0].ops["kv_dequant"].value == ("torch",)
