"""One reading of each kind of input (issue: a newcomer's hard inputs): the same value is
accepted or refused the same way by every command, the environment, the API and the
SGLang plugin, and each refusal names its source, the value and what is valid."""
import json
import os

import pytest

import capdispatch as cd
from capdispatch import extend
from capdispatch.adapters.sglang.cli import main as sglang_main
from capdispatch.dispatch.cli import main


@pytest.fixture
def run(capsys, clean_env):
    for k in ("CAPDISPATCH_SGLANG_DEVICES", "CAPDISPATCH_DEBUG", "CAPDISPATCH_VERIFY"):
        clean_env.delenv(k, raising=False)

    def go(*args, env=None, entry=main):
        for k, v in (env or {}).items():
            clean_env.setenv(k, v)
        try:
            rc = entry(list(args))
        finally:
            for k in env or {}:
                clean_env.delenv(k, raising=False)
        out, err = capsys.readouterr()
        assert "Traceback" not in err and "internal error" not in err, err
        return rc, out, err
    return go


BAD_TAGS = {"a.yaml": ("mixed_group: !!bool maybe\n", "a.yaml:1: mixed_group: !!bool 'maybe' is not a YAML bool"),
            "b.yaml": ("verify: !!bool maybe\n", "b.yaml:1: verify: !!bool 'maybe'"),
            "c.yaml": ("ops:\n  moe: [!!bool maybe]\n", "c.yaml:2: a backend of moe: !!bool 'maybe'"),
            "d.yaml": ("schema: !!bool 1\n", "d.yaml:1: schema: !!bool '1' is not a YAML bool"),
            "e.yaml": ("ops: !!python/object/apply:os.system [ls]\n",
                       "e.yaml:1: ops: tag !!python/object/apply:os.system is not allowed"),
            "f.yaml": ("", "f.yaml: the file holds no policy"),
            "g.yaml": ("ops:\n  kv_quant: !!seq x\n", "g.yaml:2: a backend of kv_quant: !!seq 'x' is not a YAML seq"),
            "h.yaml": ("ops: !!map x\n", "h.yaml:1: ops: !!map 'x' is not a YAML map")}


@pytest.mark.parametrize("name", sorted(BAD_TAGS))
def test_bad_policy_files_are_one_line_on_every_surface(run, tmp_path, name):
    text, needle = BAD_TAGS[name]
    path = tmp_path / name
    path.write_text(text)
    p = str(path)
    surfaces = [(("explain", "--device", "sim:rtx-3080", "--policy", p), None, main),
                (("policy", "validate", p), None, main),
                (("policy", "show", "--policy", p), None, main),
                (("lock", "--device", "sim:rtx-3080", "--policy", p), None, main),
                (("verify", "--device", "cpu", "--op", "kv_quant", "--policy", p), None, main),
                (("explain", "--device", "sim:rtx-3080"), {"CAPDISPATCH_POLICY": p}, main),
                (("plan", "--device", "sim:rtx-3080", "--policy", p), None, sglang_main),
                (("plan", "--device", "sim:rtx-3080"), {"CAPDISPATCH_POLICY": p}, sglang_main)]
    for args, env, entry in surfaces:
        rc, out, err = run(*args, env=env, entry=entry)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and needle in err, (args, env, err)
        # The source: the variable only when the path came from it.
        assert ("CAPDISPATCH_POLICY" in err) == bool(env), (args, err)
    with pytest.raises(cd.PolicyError, match=needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("!!", "!!").replace("'", "'")):
        cd.resolve("kv_quant", "sim:rtx-3080", policy=p, env={})


@pytest.mark.parametrize("value", ["", " ", "sim:rtx-3080,", ",sim:rtx-3080", "sim:rtx-3080,,sim:h200"])
def test_device_lists_with_empty_entries_are_refused_everywhere(run, value):
    for args, env, entry, source in [
            (("explain", "--device", value), None, main, "--device"),
            (("devices", "--device", value), None, main, "--device"),
            (("lock", "--device", value), None, main, "--device"),
            (("verify", "--device", value), None, main, "--device"),
            (("plan", "--device", value), None, sglang_main, "--device"),
            (("plan",), {"CAPDISPATCH_SGLANG_DEVICES": value}, sglang_main, "CAPDISPATCH_SGLANG_DEVICES")]:
        if env and not value.strip():
            continue      # an empty variable is an unset one
        rc, out, err = run(*args, env=env, entry=entry)
        assert rc == 2 and err.count("\n") == 1, (args, err)
        assert source in err and "DEV[,DEV...]" in err, (args, err)
    with pytest.raises(cd.BadInput):
        extend.device_list(value, "devices=")


def test_sglang_plan_names_the_flag_for_flag_values(run):
    rc, _, err = run("plan", "--device", "sim:rtx-9999", entry=sglang_main)
    assert rc == 2 and "--device: unknown simulated device 'rtx-9999'" in err
    assert "CAPDISPATCH_SGLANG_DEVICES" not in err
    rc, _, err = run("plan", env={"CAPDISPATCH_SGLANG_DEVICES": "sim:rtx-9999"}, entry=sglang_main)
    assert rc == 2 and "CAPDISPATCH_SGLANG_DEVICES entry 0" in err


def test_op_lists_take_commas_in_every_command(run):
    rc, out, err = run("lock", "--device", "sim:rtx-3080", "--op", "kv_quant,kv_dequant")
    assert rc == 0, err
    assert "kv_quant:" in out and "kv_dequant:" in out and "moe:" not in out
    for args in (("lock", "--device", "sim:rtx-3080"), ("verify", "--device", "cpu"),
                 ("explain", "--device", "sim:rtx-3080"), ("bench", "--device", "cpu")):
        rc, _, err = run(*args, "--op", "kv_quant,kv_deqant")
        assert rc == 2 and "--op: unknown op 'kv_deqant'; did you mean 'kv_dequant'?" in err, (args, err)


def test_lock_takes_libs_and_records_it(run):
    rc, out, err = run("lock", "--device", "sim:rtx-5090", "--op", "decode_mla", "--libs", "local")
    assert rc == 0, err
    assert "libs: []" in out
    rc, out, err = run("lock", "--device", "sim:rtx-5090", "--op", "decode_mla", "--libs", "sglang-0.5.23")
    assert rc == 0 and "- sglang-0.5.23" in out and "backend: flashinfer_sparse_mla" in out


def test_policy_cc_takes_the_architecture_names_devices_take(run, tmp_path):
    p = tmp_path / "sm.yaml"
    p.write_text("devices:\n  - match: {cc: sm_86}\n    ops: {kv_quant: [torch]}\n"
                 "  - match: {cc: '>=sm_120'}\n    ops: {kv_dequant: [torch]}\n")
    rc, out, err = run("explain", "--device", "sim:sm_86,sim:rtx-5090", "--op", "kv_quant,kv_dequant",
                       "--policy", str(p), "--format", "json")
    assert rc == 0, err
    per = json.loads(out)["ops"]
    assert per["kv_quant"]["per_device"]["sim:sm_86"]["backend"] == "torch"
    assert per["kv_dequant"]["per_device"]["sim:rtx-5090"]["backend"] == "torch"


@pytest.mark.parametrize("name,value,needle", [
    ("CAPDISPATCH_DEBUG", "maybe", "CAPDISPATCH_DEBUG='maybe' is not a yes/no value"),
    ("CAPDISPATCH_STRICT", "maybe", "CAPDISPATCH_STRICT='maybe' is not a yes/no value"),
    ("CAPDISPATCH_VERIFY", "requird", "did you mean 'required'"),
    ("CAPDISPATCH_CACHE_DIR", __file__, "is not a directory"),
])
def test_variables_are_read_one_way_by_both_commands(run, name, value, needle):
    for args, entry in ((("explain", "--device", "sim:rtx-3080", "--op", "kv_quant"), main),
                        (("plan", "--device", "sim:rtx-3080", "--brief"), sglang_main)):
        rc, _, err = run(*args, env={name: value}, entry=entry)
        assert rc == 2 and needle in err and err.count("\n") == 1, (args, err)


def test_policy_variable_is_a_path_list(run, tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("mixed_group: allow\n")
    b.write_text("mixed_group: uniform\n")
    rc, out, err = run("policy", "show", "--format", "json",
                       env={"CAPDISPATCH_POLICY": os.pathsep.join([str(a), str(b)])})
    assert rc == 0, err
    rc, _, err = run("explain", "--device", "sim:rtx-3080", env={"CAPDISPATCH_POLICY": f"{a},{b}"})
    assert rc == 2 and f"separates files with {os.pathsep!r}" in err and "not ','" in err
    rc, _, err = run("explain", "--device", "sim:rtx-3080", env={"CAPDISPATCH_POLICY": f"{a}{os.pathsep}"})
    assert rc == 2 and "CAPDISPATCH_POLICY" in err and "empty entry" in err


def test_the_api_reads_a_device_string_as_the_flag_does_and_refuses_an_empty_group(clean_env):
    p = cd.plan("sim:rtx-3080, sim:h200", ["kv_quant"], log_warnings=False)
    assert [d.id for d in p.devices] == ["sim:rtx-3080", "sim:h200"]
    g = cd.resolve_group("kv_quant", "sim:rtx-3080,sim:rtx-3080")
    assert list(g.per_device) == ["sim:rtx-3080@0", "sim:rtx-3080@1"]
    for devices in ([], "", "sim:rtx-3080,", 3):
        with pytest.raises(cd.BadInput, match="devices="):
            cd.plan(devices, ["kv_quant"], log_warnings=False)
