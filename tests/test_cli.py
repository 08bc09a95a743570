"""The `dispatch` command on simulated devices: the decisions DESIGN.md promises."""
import json
import os

import pytest

POL = os.path.join(os.path.dirname(__file__), "policies")
KV = ("--op", "kv_quant", "--op", "kv_dequant")


def explain_json(run_cli, *args, env=None):
    rc, out, err = run_cli("explain", "--format", "json", *args, env=env)
    return rc, (json.loads(out) if rc == 0 else None), err


def test_sm86_takes_u8_and_shows_why_not_fp8(run_cli):
    rc, doc, err = explain_json(run_cli, "--device", "sim:rtx-3080", "--assume-lib", "triton")
    assert rc == 0, err
    for op in ("kv_quant", "kv_dequant"):
        r = doc["ops"][op]["per_device"]["sim:rtx-3080"]
        assert r["backend"] == "triton_u8"
        fp8 = next(c for c in r["candidates"] if c["backend"] == "triton_fp8")
        assert fp8["ok"] is False
        bad = [c for c in fp8["checks"] if not c["ok"]]
        assert [c["code"] for c in bad] == ["feature:fp8_e4m3"]
        assert "8.9" in bad[0]["need"] and "8.6" in bad[0]["found"]
    assert doc["devices"][0]["cc"] == "8.6"
    assert "fp8_e4m3" not in doc["devices"][0]["features"]
    # The text view names the reason too.
    rc, out, _ = run_cli("explain", "--device", "sim:rtx-3080", "--assume-lib", "triton")
    assert rc == 0 and "✗ triton_fp8" in out and "found cc 8.6" in out and "-> triton_u8" in out


@pytest.mark.parametrize("dev,want", [("sim:rtx-5090", "triton_fp8"), ("sim:h200", "triton_fp8"),
                                      ("sim:sm_120", "triton_fp8"), ("sim:sm_86", "triton_u8"),
                                      ("cpu", "torch")])
def test_choice_per_device(run_cli, dev, want):
    rc, doc, err = explain_json(run_cli, "--device", dev, "--assume-lib", "triton", *KV)
    assert rc == 0, err
    assert {g["per_device"][doc["devices"][0]["id"]]["backend"] for g in doc["ops"].values()} == {want}


def test_without_triton_everything_falls_to_torch(run_cli):
    # Plan for a machine without Triton: assume it away by giving an impossible version.
    rc, doc, err = explain_json(run_cli, "--device", "sim:rtx-5090", "--assume-lib", "triton==1.0")
    assert rc == 0, err
    r = doc["ops"]["kv_quant"]["per_device"]["sim:rtx-5090"]
    assert r["backend"] == "torch"
    fp8 = r["candidates"][0]
    lib = next(c for c in fp8["checks"] if c["code"] == "library:triton")
    assert lib["ok"] is False and lib["found"].startswith("1.0")


def test_mixed_rig_diverges_with_one_warning(run_cli):
    rc, doc, err = explain_json(run_cli, "--device", "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080",
                                "--assume-lib", "triton", "--op", "kv_dequant")
    assert rc == 0, err
    g = doc["ops"]["kv_dequant"]
    assert g["uniform"] is False
    assert list(g["per_device"]) == ["sim:rtx-5090", "sim:rtx-3080@1", "sim:rtx-3080@2"]
    assert [r["backend"] for r in g["per_device"].values()] == ["triton_fp8", "triton_u8", "triton_u8"]
    warnings = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "kv_dequant" in warnings[0], err
    assert len(doc["warnings"]) == 1


def test_mixed_rig_uniform_runs_one_kernel(run_cli):
    rc, doc, err = explain_json(run_cli, "--device", "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080",
                                "--assume-lib", "triton", "--policy", os.path.join(POL, "uniform.yaml"), *KV)
    assert rc == 0, err
    for g in doc["ops"].values():
        assert g["uniform"] is True
        assert {r["backend"] for r in g["per_device"].values()} == {"triton_u8"}
        assert "mixed_group: uniform" in g["per_device"]["sim:rtx-5090"]["source"]
    assert "WARNING" not in err


def test_mixed_rig_error_exits_3(run_cli):
    rc, out, err = run_cli("explain", "--device", "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080",
                           "--assume-lib", "triton", "--policy", os.path.join(POL, "error.yaml"))
    assert rc == 3
    assert "mixed_group is error" in err and "error.yaml:2" in err
    assert "Traceback" not in err


def test_explicit_selection_downgrades_loudly(run_cli):
    rc, doc, err = explain_json(run_cli, "--device", "sim:rtx-3080", "--assume-lib", "triton",
                                "--set", "kv_dequant=triton_fp8")
    assert rc == 0, err
    r = doc["ops"]["kv_dequant"]["per_device"]["sim:rtx-3080"]
    assert r["backend"] == "triton_u8" and r["downgraded_from"] == "triton_fp8" and r["fallback"]
    assert "--set" in r["source"]
    assert "WARNING" in err and "kv_dequant=triton_fp8" in err and "fp8_e4m3" in err
    # The op that was not selected is untouched.
    assert doc["ops"]["kv_quant"]["per_device"]["sim:rtx-3080"]["downgraded_from"] is None


def test_explicit_selection_strict_exits_3_with_reason(run_cli):
    rc, out, err = run_cli("explain", "--device", "sim:rtx-3080", "--assume-lib", "triton",
                           "--set", "kv_dequant=triton_fp8", "--strict")
    assert rc == 3
    assert "triton_fp8" in err and "fp8_e4m3" in err and "8.6" in err and "Traceback" not in err


def test_env_selection_and_strict(run_cli):
    rc, out, err = run_cli("explain", "--device", "sim:rtx-3080", "--assume-lib", "triton",
                           env={"CAPDISPATCH_SET": "kv_dequant=triton_fp8", "CAPDISPATCH_STRICT": "1"})
    assert rc == 3 and "CAPDISPATCH_SET" in err


@pytest.mark.parametrize("args,needle", [
    (("--device", "sim:rtx-3008"), "'rtx-3080'"),
    (("--device", "cuda:x"), "cuda:N"),
    (("--op", "kv_dequnt"), "did you mean 'kv_dequant'"),
    (("--set", "kv_dequant=triton_fp9"), "did you mean 'triton_fp8'"),
    (("--set", "kv_dequant"), "OP=BACKEND"),
    (("--assume-lib", "triton>=3"), "NAME==VERSION"),
])
def test_bad_input_exits_2(run_cli, args, needle):
    rc, out, err = run_cli("explain", "--device", "sim:h200", *args)
    assert rc == 2, (out, err)
    assert needle in err and "Traceback" not in err


def test_policy_unknown_backend_exits_2_with_file_line_and_suggestion(run_cli):
    path = os.path.join(POL, "typo_backend.yaml")
    for args in (("policy", "validate", path), ("explain", "--device", "sim:h200", "--policy", path)):
        rc, out, err = run_cli(*args)
        assert rc == 2
        assert "typo_backend.yaml:4" in err and "did you mean 'triton_fp8'" in err
        assert "Traceback" not in err


@pytest.mark.parametrize("name,needle", [("malformed.yaml", "malformed YAML"),
                                         ("unsafe.yaml", "is not allowed")])
def test_policy_malformed_and_unsafe_exit_2(run_cli, name, needle, tmp_path):
    marker = tmp_path / "pwned"
    rc, out, err = run_cli("policy", "validate", os.path.join(POL, name))
    assert rc == 2 and needle in err and f"{name}:" in err and "Traceback" not in err, err
    assert "pwned" not in out


def test_policy_validate_ok_and_show(run_cli):
    path = os.path.join(POL, "device_scoped.yaml")
    rc, out, err = run_cli("policy", "validate", path)
    assert rc == 0 and "ok" in out
    rc, out, err = run_cli("policy", "show", "--policy", path, "--format", "json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["settings"]["mixed_group"] == {"value": "warn", "from": "default.yaml:7"}
    assert doc["ops"]["kv_quant"]["from"].endswith("device_scoped.yaml:4")
    assert doc["ops"]["kv_dequant"]["from"].startswith("default.yaml:")
    assert doc["devices"][-2]["match"] == {"cc": "8.6"}
    assert doc["devices"][-2]["from"].endswith("device_scoped.yaml:6")


def test_device_scoped_entries_beat_file_entries(run_cli):
    path = os.path.join(POL, "device_scoped.yaml")
    rc, doc, err = explain_json(run_cli, "--device", "sim:rtx-3080,sim:rtx-5090", "--assume-lib", "triton",
                                "--policy", path, "--format", "json")
    assert rc == 0, err
    dq = doc["ops"]["kv_dequant"]["per_device"]
    assert dq["sim:rtx-3080"]["backend"] == "torch"
    assert "device cc 8.6" in dq["sim:rtx-3080"]["source"]
    assert dq["sim:rtx-5090"]["backend"] == "triton_u8"
    q = doc["ops"]["kv_quant"]["per_device"]
    assert q["sim:rtx-5090"]["backend"] == "triton_u8" and "device_scoped.yaml:4" in q["sim:rtx-5090"]["source"]


def test_json_schema_shape(run_cli):
    rc, doc, err = explain_json(run_cli, "--device", "sim:h200", "--assume-lib", "triton")
    assert rc == 0
    assert doc["schema"] == 1 and isinstance(doc["warnings"], list)
    d = doc["devices"][0]
    assert {"id", "name", "cc", "features", "libraries"} <= set(d)
    assert d["libraries"]["triton"].startswith("assumed")
    for g in doc["ops"].values():
        assert set(g) == {"per_device", "uniform"}
        for r in g["per_device"].values():
            assert {"backend", "source", "fallback", "downgraded_from", "candidates"} <= set(r)
            for c in r["candidates"]:
                assert set(c) == {"backend", "ok", "checks"}
                for ch in c["checks"]:
                    assert set(ch) == {"code", "need", "found", "ok", "message"}


def test_ops_and_devices_commands(run_cli):
    rc, out, err = run_cli("ops", "--format", "json")
    assert rc == 0
    doc = json.loads(out)
    assert [b["name"] for b in doc["ops"]["kv_dequant"]["backends"]] == ["triton_fp8", "triton_u8", "torch"]
    rc, out, err = run_cli("devices", "--device", "sim:h200", "--format", "json")
    assert rc == 0
    d = json.loads(out)["devices"][0]
    assert d["cc"] == "9.0" and d["sm_count"] == 132 and d["smem_optin_per_block"] == 232448
    assert {"wgmma", "tma", "fp8_e4m3", "bf16"} <= set(d["features"]) and "tcgen05" not in d["features"]


def test_policy_show_output_validates(run_cli, tmp_path):
    rc, out, err = run_cli("policy", "show", "--policy", os.path.join(POL, "device_scoped.yaml"))
    assert rc == 0, err
    shown = tmp_path / "shown.yaml"
    shown.write_text(out)
    rc, out, err = run_cli("policy", "validate", str(shown))
    assert rc == 0 and out.strip().endswith("shown.yaml: ok"), err


@pytest.mark.parametrize("args,needle", [
    (("explain", "--device", "cuda:\u00b2"), "a CUDA device is cuda:N"),
    (("explain", "--device", "sim:\udcff"), "unknown simulated device"),
    (("explain", "--device", "sim:rtx-3080", "--policy", "/proc/self/environ"), "(U+0000) is not allowed"),
    (("explain", "--device", "sim:rtx-3080", "--assume-cuda", "cuda13"), "expected a CUDA toolkit version"),
])
def test_bad_values_exit_2_in_a_real_process(run_cli, args, needle):
    rc, out, err = run_cli(*args)
    assert rc == 2 and needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_strict_variable_words_through_the_cli(run_cli):
    args = ("explain", "--device", "sim:rtx-3080", "--assume-lib", "triton", "--op", "kv_dequant")
    env = {"CAPDISPATCH_SET": "kv_dequant=triton_fp8"}
    assert run_cli(*args, env={**env, "CAPDISPATCH_STRICT": "false"})[0] == 0
    assert run_cli(*args, env={**env, "CAPDISPATCH_STRICT": "yes"})[0] == 3
    rc, _, err = run_cli(*args, env={**env, "CAPDISPATCH_STRICT": "maybe"})
    assert rc == 2 and "CAPDISPATCH_STRICT='maybe'" in err
