"""The SGLang adapter's own logic on simulated rigs: the knob map, the version
range, GPU enumeration, decisions, architecture facts, and `dispatch sglang plan`
without SGLang arguments. None of this needs SGLang installed."""
from __future__ import annotations

import json
import logging
import os

import pytest

import capdispatch as cd
from capdispatch.adapters.sglang import archfacts, decide, knobs, launch, rig, versions

HERE = os.path.dirname(os.path.abspath(__file__))
POL = os.path.join(HERE, "policies")
RIG = "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080"
VERSION = "0.5.23"


@pytest.fixture
def env(monkeypatch):
    """A clean decision environment: no capdispatch variables, no SGLang KV layout."""
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", rig.SIM_ENV,
              "SGLANG_DSV4_KV_LAYOUT"):
        monkeypatch.delenv(k, raising=False)
    e = {k: v for k, v in os.environ.items()}
    e[rig.SIM_ENV] = RIG
    return e


@pytest.fixture
def release():
    return knobs.load().release(VERSION)


def _decide(env, release, ids=(0, 1, 2), **kw):
    specs = rig.devices(list(ids), env=env)
    return decide.decide(specs, ("kv_quant", "kv_dequant"), release, env=env, **kw)


# --------------------------------------------------------------------------- knob map

def test_knob_map_loads_with_kv_rows(release):
    assert release is not None
    assert {r.op for r in release.routes} == {"kv_quant", "kv_dequant"}
    assert release.route("kv_dequant").native == "triton_fp8"
    assert release.route("kv_quant").native is None
    assert release.models["DeepseekV4ForCausalLM"].ops == ("kv_quant", "kv_dequant")
    assert {(s.kind, s.name) for s in release.settings} == {("field", "kv_cache_dtype"),
                                                            ("env", "SGLANG_DSV4_KV_LAYOUT")}
    k = knobs.load()
    assert k.release("0.5.22") is None and k.release("0.6.0") is None and k.release("junk") is None


def _edited(tmp_path, old, new):
    text = open(knobs.DEFAULT_PATH).read()
    assert old in text
    path = tmp_path / "knobs.yaml"
    path.write_text(text.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize("old,new,message", [
    ("- op: kv_dequant\n        target", "- op: kv_dequnt\n        target", "unknown op 'kv_dequnt'"),
    ("native: triton_fp8", "native: triton_fp9", "unknown backend 'triton_fp9' for kv_dequant"),
    ("value: v4", "value: v41\n      - ops: [kv_dequant]\n        env: SGLANG_DSV4_KV_LAYOUT\n        value: v4",
     "SGLANG_DSV4_KV_LAYOUT is set to 'v4' here and 'v41' in another row"),
    ('tested: ">=0.5.23,<0.5.24"', 'tested: "at least 0.5"', "'at least 0.5' is not a version range"),
    ("field: kv_cache_dtype\n", "field: kv_cache_dtype\n        env: X\n", "exactly one of 'field' or 'env'"),
])
def test_knob_map_errors_name_the_problem(tmp_path, old, new, message):
    with pytest.raises(knobs.KnobsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        knobs.load(_edited(tmp_path, old, new))


# --------------------------------------------------------------------------- versions

@pytest.mark.parametrize("version,ok", [("0.5.23", True), ("0.5.23.post1", True), ("0.5.24", False),
                                        ("0.5.22", False), ("0.4.0", False), ("1.0.0", False)])
def test_version_range(version, ok):
    v = versions.check(version)
    assert v.ok is ok
    if not ok:
        assert "outside the tested range >=0.5.23,<0.5.24" in v.message
        assert "changes nothing" in v.message


def test_version_unreadable():
    v = versions.check("not-a-version")
    assert not v.ok and "cannot read the SGLang version 'not-a-version'" in v.message


def test_register_outside_range_warns_once_and_registers_nothing(monkeypatch, caplog):
    import sys

    import capdispatch.adapters.sglang as plugin
    monkeypatch.setattr(plugin, "_done", {})
    before = set(sys.modules)
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert plugin.register(sglang_version="0.5.22") is False
        assert plugin.register() is False          # idempotent: no second warning
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "SGLang 0.5.22 is outside the tested range" in warnings[0].getMessage()
    # Nothing of SGLang was even imported to register hooks.
    assert not any(m.startswith("sglang.srt.plugins") for m in set(sys.modules) - before)


# --------------------------------------------------------------------------- the rig

@pytest.mark.parametrize("kw,ids", [
    (dict(tp_size=3), [0, 1, 2]),
    (dict(tp_size=2, base_gpu_id=2, gpu_id_step=2), [2, 4]),
    (dict(tp_size=2, pp_size=2), [0, 1, 2, 3]),
    (dict(tp_size=2, dp_size=2), [0, 1, 2, 3]),
    (dict(tp_size=2, dp_size=2, dp_attention=True), [0, 1]),
    (dict(tp_size=4, nnodes=2, node_rank=1), [0, 1]),
])
def test_gpu_ids_follow_sglangs_launcher(kw, ids):
    assert rig.gpu_ids(**kw) == ids


@pytest.mark.parametrize("kw,message", [(dict(tp_size=0), "tp_size=0"),
                                        (dict(tp_size=2, gpu_id_step=0), "gpu_id_step=0"),
                                        (dict(tp_size="2"), "tp_size='2'")])
def test_gpu_ids_bad_input(kw, message):
    with pytest.raises(cd.BadInput, match=message):
        rig.gpu_ids(**kw)


def test_simulated_rig_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv(rig.SIM_ENV, "sim:h200,sim:rtx-3080")
    d = rig.device(1)
    assert (d.id, d.name, d.cc, d.simulated) == ("cuda:1", "NVIDIA GeForce RTX 3080", (8, 6), True)
    monkeypatch.setenv(rig.SIM_ENV, "sim:rtx-5090")
    assert rig.device(0).cc == (12, 0)


@pytest.mark.parametrize("value,index,message", [
    (RIG, 3, "lists 3 device\\(s\\) \\(cuda:0..cuda:2\\) but the launch uses cuda:3"),
    ("sim:rtx-5090,,sim:rtx-3080", 0, "an empty entry"),
    ("sim:rtx-9999", 0, "entry 0: .*rtx-9999"),
])
def test_simulated_rig_bad_input(value, index, message):
    with pytest.raises(cd.BadInput, match=message):
        rig.device(index, env={rig.SIM_ENV: value})


# --------------------------------------------------------------------------- decisions

def test_applicable_ops(release):
    assert decide.applicable_ops(release, "DeepseekV4ForCausalLM", "auto")[0] == ("kv_quant", "kv_dequant")
    assert decide.applicable_ops(release, "DeepseekV4ForCausalLM", "fp8_e4m3")[0] == ("kv_quant", "kv_dequant")
    ops, why = decide.applicable_ops(release, "DeepseekV4ForCausalLM", "bfloat16")
    assert ops == () and "kv_cache_dtype=bfloat16" in why
    assert decide.applicable_ops(release, "LlamaForCausalLM", "auto")[0] == ()
    assert decide.applicable_ops(release, None, "auto")[0] == ()


def test_mixed_rig_routes_only_where_sglangs_kernel_cannot_run(env, release):
    d = _decide(env, release)
    dq = d.choices["kv_dequant"]
    assert {k: (c.backend, c.routed) for k, c in dq.items()} == {
        "cuda:0": ("triton_fp8", False), "cuda:1": ("triton_u8", True), "cuda:2": ("triton_u8", True)}
    assert "needs fp8_e4m3 (cc >=8.9), has cc 8.6" in dq["cuda:1"].why
    # SGLang's JIT store runs everywhere; nobody asked for a capdispatch store.
    assert d.resolved == ("kv_dequant",)
    assert all(c.backend is None and not c.routed for c in d.choices["kv_quant"].values())
    settings = {s.setting.name: (s.action, s.value, s.devices) for s in d.settings}
    assert settings == {"kv_cache_dtype": ("set", "fp8_e4m3", ("cuda:0", "cuda:1", "cuda:2")),
                        "SGLANG_DSV4_KV_LAYOUT": ("set", "v4", ("cuda:1", "cuda:2"))}
    assert len(d.warnings) == 1 and "kv_dequant: the group's devices choose different backends" in d.warnings[0]


def test_same_generation_rig_changes_nothing_at_the_call_sites(env, release):
    env[rig.SIM_ENV] = "sim:rtx-5090,sim:h200"
    d = _decide(env, release, ids=(0, 1))
    assert not any(c.routed for row in d.choices.values() for c in row.values())
    assert [s.setting.name for s in d.settings] == ["kv_cache_dtype"]
    assert d.warnings == ()


def test_explicit_choice_that_cannot_run_is_downgraded_loudly_per_device(env, release):
    env["CAPDISPATCH_SET"] = "kv_dequant=triton_fp8"
    d = _decide(env, release)
    dq = d.choices["kv_dequant"]
    assert [c.routed for c in dq.values()] == [True, True, True]     # an explicit choice is honoured
    assert dq["cuda:1"].resolution.downgraded_from == "triton_fp8" and dq["cuda:1"].backend == "triton_u8"
    downgrades = [w for w in d.warnings if "was asked for (CAPDISPATCH_SET) but cannot run" in w]
    assert [w.split(" ")[0] for w in downgrades] == ["cuda:1", "cuda:2"]


def test_explicit_choice_that_cannot_run_is_refused_under_strict(env, release):
    env.update(CAPDISPATCH_SET="kv_dequant=triton_fp8", CAPDISPATCH_STRICT="1")
    with pytest.raises(cd.Unsatisfiable, match=r"strict: cuda:1 \(NVIDIA GeForce RTX 3080\): kv_dequant=triton_fp8"):
        _decide(env, release)


def test_explicit_store_choice_routes_the_store(env, release):
    env["CAPDISPATCH_SET"] = "kv_quant=torch"
    d = _decide(env, release)
    assert d.resolved == ("kv_quant", "kv_dequant")
    assert {(c.backend, c.routed) for c in d.choices["kv_quant"].values()} == {("torch", True)}


def test_user_settings_are_kept_and_conflicts_said(env, release):
    env["SGLANG_DSV4_KV_LAYOUT"] = "v41"
    d = _decide(env, release, explicit_fields={"kv_cache_dtype"},
                field_values={"kv_cache_dtype": "fp8_e4m3"})
    settings = {s.setting.name: (s.action, s.value) for s in d.settings}
    assert settings == {"kv_cache_dtype": ("kept", "fp8_e4m3"), "SGLANG_DSV4_KV_LAYOUT": ("kept", "v41")}
    conflict = [w for w in d.warnings if w.startswith("SGLANG_DSV4_KV_LAYOUT=v41 was set by the user")]
    assert len(conflict) == 1 and "cuda:1, cuda:2 need SGLANG_DSV4_KV_LAYOUT=v4" in conflict[0]


def test_mixed_group_uniform_routes_the_fast_card_too(env, release):
    d = _decide(env, release, policy=os.path.join(POL, "uniform.yaml"))
    dq = d.choices["kv_dequant"]
    assert {(c.backend, c.routed) for c in dq.values()} == {("triton_u8", True)}
    assert "mixed_group: uniform" in dq["cuda:0"].why


def test_mixed_group_error_refuses(env, release):
    with pytest.raises(cd.Unsatisfiable, match="kv_dequant: the group's devices choose different backends"):
        _decide(env, release, policy=os.path.join(POL, "error.yaml"))


def test_sglang_flag_naming_a_backend_is_an_explicit_selection(tmp_path, env):
    # No SGLang flag names a KV backend; a test row shows the mechanism later ops use.
    path = _edited(tmp_path, "selects: []",
                   "selects:\n      - {field: kv_cache_dtype, value: fp8_e4m3, op: kv_dequant, backend: triton_fp8}")
    rel = knobs.load(path).release(VERSION)
    sels, origin = decide.flag_selections(rel, {"kv_cache_dtype": "fp8_e4m3"})
    assert (sels, origin) == (["kv_dequant=triton_fp8"], "sglang --kv-cache-dtype fp8_e4m3")
    assert decide.flag_selections(rel, {"kv_cache_dtype": "bfloat16"})[0] == []
    d = _decide(env, rel, selections=sels, selection_origin=origin)
    assert any("was asked for (sglang --kv-cache-dtype fp8_e4m3) but cannot run" in w for w in d.warnings)
    env["CAPDISPATCH_STRICT"] = "1"
    with pytest.raises(cd.Unsatisfiable, match=r"sglang --kv-cache-dtype fp8_e4m3"):
        _decide(env, rel, selections=sels, selection_origin=origin)


def test_summary_names_devices_and_reasons(env, release):
    text = decide.summary(_decide(env, release))
    assert "kv_dequant: SGLang's own kernel on cuda:0; capdispatch triton_u8 on cuda:1, cuda:2" in text
    assert "set env SGLANG_DSV4_KV_LAYOUT=v4 for cuda:1, cuda:2" in text


# --------------------------------------------------------------------------- facts, launch command

def test_architecture_facts_are_the_cards_own(release):
    arch = release.arch
    f86 = archfacts.facts(cd.probe("sim:rtx-3080"), arch)
    assert (f86["sm"], f86["cc"], f86["get_device_sm"]) == (86, (8, 6), 86)
    assert f86["is_sm80_supported"] and not f86["is_sm90_supported"] and not f86["is_sm120_supported"]
    f120 = archfacts.facts(cd.probe("sim:rtx-5090"), arch)
    assert f120["is_sm120_supported"] and f120["is_blackwell_supported"] and f120["is_sm120"]
    assert not f120["is_sm100_supported"]
    assert archfacts.facts(cd.probe("sim:h200"), arch)["is_sm90_supported"]
    fcpu = archfacts.facts(cd.probe("cpu"), arch)
    assert fcpu["sm"] == 0 and not any(v for k, v in fcpu.items() if k.startswith("is_"))
    # A known CUDA toolkit counts, as SGLang's probes check it.
    old_toolkit = cd.probe("sim:rtx-5090", assume_cuda="12.4")
    assert not archfacts.facts(old_toolkit, arch)["is_sm120_supported"]


def test_explicit_fields_of_an_engine_call():
    assert launch.explicit_fields("Engine(model_path='/m', tp_size=2, kv_cache_dtype='fp8_e4m3')") == {
        "model_path", "tp_size", "kv_cache_dtype"}
    assert launch.explicit_fields("Engine(model_path=<object at 0x1>, tp_size=2)") == {"model_path", "tp_size"}
    assert launch.explicit_fields(None) == set()


# --------------------------------------------------------------------------- dispatch sglang plan

def _plan(capsys, *argv):
    from capdispatch.adapters.sglang import cli
    rc = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_text_for_the_mixed_rig(env, capsys, monkeypatch):
    monkeypatch.delenv(rig.SIM_ENV, raising=False)
    rc, out, err = _plan(capsys, "--device", RIG)
    assert rc == 0, err
    assert "GPUs: cuda:0, cuda:1, cuda:2" in out
    assert "set   env SGLANG_DSV4_KV_LAYOUT=v4" in out
    assert "rank 1: cuda:1 NVIDIA GeForce RTX 3080, cc 8.6 (simulated)" in out
    assert "kv_dequant  triton_u8   routed  SGLang's own dequantize_k_cache_paged_dsv4 cannot run there" in out
    assert "architecture facts set for this rank: is_sm90=False is_sm100=False is_sm120=False" in out


def test_plan_json(env, capsys, monkeypatch):
    monkeypatch.setenv(rig.SIM_ENV, RIG)
    rc, out, err = _plan(capsys, "--tp", "2", "--format", "json")
    assert rc == 0, err
    p = json.loads(out)
    assert p["schema"] == 1 and p["gpu_ids"] == [0, 1] and p["sglang"]["in_range"]
    assert [r["device"]["name"] for r in p["ranks"]] == ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 3080"]
    dq = p["ranks"][1]["ops"]["kv_dequant"]
    assert dq.pop("source").startswith("default.yaml:")
    assert dq == {
        "backend": "triton_u8", "routed": True, "downgraded_from": None,
        "why": "SGLang's own dequantize_k_cache_paged_dsv4 cannot run there: needs fp8_e4m3 (cc >=8.9), has cc 8.6"}
    assert p["ranks"][1]["arch"]["device_sm"] == 86
    assert {x["name"]: x["action"] for x in p["launch"]} == {"kv_cache_dtype": "set", "SGLANG_DSV4_KV_LAYOUT": "set"}


@pytest.mark.parametrize("argv,rc,message", [
    (["--device", "sim:rtx-9999"], 2, "rtx-9999"),
    (["--device", RIG, "--tp", "4"], 2, "lists 3 device(s) (cuda:0..cuda:2) but the launch uses cuda:3"),
    (["--device", RIG, "--tp", "0"], 2, "--tp 0: expected an integer >= 1"),
    (["--device", RIG, "--set", "kv_dequant=triton_fp9"], 2, "unknown backend 'triton_fp9'"),
    (["--device", RIG, "--set", "kv_dequant=triton_fp8", "--strict"], 3, "strict: cuda:1"),
    (["--device", RIG, "--policy", os.path.join(POL, "error.yaml")], 3, "mixed_group is error"),
])
def test_plan_bad_input_and_unsatisfiable(env, capsys, argv, rc, message):
    got, out, err = _plan(capsys, *argv)
    assert got == rc and message in err and "Traceback" not in err


def test_plan_through_the_dispatch_command(run_cli):
    rc, out, err = run_cli("sglang", "plan", "--device", "sim:rtx-3080", "--format", "json")
    assert rc == 0, err
    assert json.loads(out)["ranks"][0]["ops"]["kv_dequant"]["routed"] is True
    rc, out, err = run_cli("sglang", "plan", "--frobnicate")
    assert rc == 2 and "unrecognized arguments: --frobnicate" in err
