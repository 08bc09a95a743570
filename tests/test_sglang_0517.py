"""The SGLang adapter inside the real SGLang 0.5.17 (tests/.releases/, installed by the
README's test command): its plugin loader, its dataclass ServerArgs whose __post_init__
runs the wrapped resolution step, its configure_scheduler_process and TP group, and its
DeepSeek-V4 call targets (sgl_kernel's FlashMLA entries are the prelude's stand-ins
with sglang-kernel 0.4.5's parameters). Every scenario runs in fresh processes whose path
puts 0.5.17 first (tests/sglang_releases.py), so the two releases never meet in one
interpreter. The group's devices are simulated with CAPDISPATCH_SGLANG_DEVICES."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import sglang_releases  # noqa: E402

from capdispatch.models import model_calls  # noqa: E402
from rank_routes import assert_installs, assert_routes  # noqa: E402

from test_sglang_integration import _env, _free_port, _messages  # noqa: E402

SCENARIOS = os.path.join(HERE, "sglang_scenarios_0517.py")
RIG = "sim:rtx-5090,sim:rtx-3080"
TIMEOUT = 300
RELEASE = "0.5.17"
EMU_3080 = "emu:rtx-3080@sim:h100"       # decided as an RTX 3080, SGLang's facts an H100's
EMU_5090 = "emu:rtx-5090@sim:h100"

pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(sglang_releases.FOLDERS[RELEASE], "sglang")),
                                reason="needs SGLang 0.5.17 in tests/.releases (the README's test command)")


def _start(*args, env=None):
    e = sglang_releases.env(RELEASE, _env(env))
    # The adapter under test: this checkout's, ahead of any installed copy.
    e["PYTHONPATH"] = os.pathsep.join([e["PYTHONPATH"], os.path.dirname(HERE)])
    return subprocess.Popen([sys.executable, SCENARIOS, *map(str, args)], env=e, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import sglang_fake_models as fake
    root = tmp_path_factory.mktemp("sglang0517")
    return {"root": root, "dsv4": fake.write(str(root / "dsv4"), fake.DSV4),
            "llama": fake.write(str(root / "llama"), fake.LLAMA)}


def _argv(model_path, *more):
    return ["--model-path", model_path, "--skip-tokenizer-init", "--device", "cuda", *more]


@pytest.fixture(scope="module")
def launcher(model):
    root, dsv4 = model["root"], model["dsv4"]
    sim = {"CAPDISPATCH_SGLANG_DEVICES": RIG}
    cases = {
        "mixed": {"argv": _argv(dsv4, "--tp-size", "2"), "env": sim, "pickle": str(root / "mixed.pkl")},
        "user_set": {"argv": _argv(dsv4, "--tp-size", "2", "--kv-cache-dtype=fp8_e4m3"), "env": sim},
        # As Engine(**kwargs) builds it: ServerArgs(**kwargs), no launch command anywhere.
        "engine": {"kwargs": {"model_path": dsv4, "skip_tokenizer_init": True, "device": "cuda", "tp_size": 2,
                              "kv_cache_dtype": "fp8_e4m3", "moe_runner_backend": "flashinfer_mxfp4"},
                   "env": sim},
        "bf16": {"argv": _argv(dsv4, "--tp-size", "2", "--kv-cache-dtype", "bfloat16"), "env": sim},
        "llama": {"argv": _argv(model["llama"], "--tp-size", "2"), "env": sim},
        # One H100: SGLang 0.5.17's own FlashMLA and DeepGEMM indexer are judged by its pins.
        "h100": {"argv": _argv(dsv4, "--tp-size", "1"), "env": {"CAPDISPATCH_SGLANG_DEVICES": "sim:h100"},
                 "pickle": str(root / "h100.pkl")},
        # Expert parallelism under a launch-wide value whose dispatcher keeps global expert ids.
        "ep_global": {"argv": _argv(dsv4, "--tp-size", "2", "--ep-size", "2", "--moe-runner-backend",
                                    "flashinfer_mxfp4"), "env": sim},
        "ep_auto": {"argv": _argv(dsv4, "--tp-size", "2", "--ep-size", "2"), "env": sim},
        # The same without NVML: the launch decides nothing, the ranks refuse.
        "ep_ranks": {"argv": _argv(dsv4, "--tp-size", "2", "--ep-size", "2", "--moe-runner-backend",
                                   "flashinfer_mxfp4"), "env": {}, "pickle": str(root / "ep.pkl")},
        "emu": {"argv": _argv(dsv4, "--tp-size", "1"), "env": {"CAPDISPATCH_SGLANG_DEVICES": EMU_3080},
                "pickle": str(root / "emu.pkl")},
        "emu_refused": {"argv": _argv(dsv4, "--tp-size", "1"), "env": {"CAPDISPATCH_SGLANG_DEVICES": EMU_5090}},
    }
    path = root / "cases.json"
    path.write_text(json.dumps(list(cases.values())))
    r = _result(_start("launcher", path))
    r["by_name"] = dict(zip(cases, r["cases"]))
    r["record"] = cases["mixed"]["pickle"]
    r["h100_record"] = cases["h100"]["pickle"]
    r["record_emu"] = cases["emu"]["pickle"]
    r["record_ep"] = cases["ep_ranks"]["pickle"]
    return r


def test_the_plugin_is_loaded_by_sglang_0517_and_wraps_its_resolution_method(launcher):
    assert launcher["sglang"] == "0.5.17"
    assert launcher["capdispatch"].startswith(os.path.dirname(HERE))
    assert launcher["registered"] is True and launcher["again"] is True
    assert launcher["hook_targets"] == ["sglang.srt.distributed.bootstrap.init_torch_distributed",
                                        "sglang.srt.managers.scheduler.configure_scheduler_process",
                                        "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments"]
    assert "resolution_hooks" not in launcher        # 0.5.17 has no register_resolution_hook
    assert launcher["step_patched"] and launcher["step_ours"]
    assert launcher["configure_patched"] and launcher["group_patched"]
    assert launcher["load_logs"] == []


def test_knob_map_names_exist_in_sglang_0517(launcher):
    assert launcher["knob_name_problems"] == []


def test_launch_declares_into_0517s_stash_and_sets_no_kv_layout(launcher):
    c = launcher["by_name"]["mixed"]
    assert "error" not in c, c
    # Declared after the step, materialized at the end of __post_init__.
    assert c["declared"] == [{"kv_cache_dtype": "fp8_e4m3"}] and c["materialized"]
    assert c["fields"]["kv_cache_dtype"] == "fp8_e4m3" and c["fields"]["tp_size"] == 2
    # 0.5.17 has only the V4 layout: no SGLANG_DSV4_KV_LAYOUT; nothing else set at launch.
    assert set(c["env"].values()) == {None}
    st = c["stash"]
    assert st["ops"] == list(model_calls().ops)
    # SGLang's /server_info dumps vars(server_args) as JSON: the plugin's attribute is text there.
    assert c["stash_json"].startswith('"capdispatch launch inputs: '), c["stash_json"]
    assert st["applied"] == {"kv_cache_dtype": "fp8_e4m3"} and st["user_env"] == {}
    assert "kv_cache_dtype" not in st["explicit_fields"] and "tp_size" in st["explicit_fields"]
    (info,) = [m for m in _messages(c["logs"], "INFO") if "SGLang launch" in m]
    assert "kv_dequant: SGLang's own kernel on cuda:0; capdispatch triton_u8 on cuda:1" in info


def test_launch_keeps_what_the_user_set_on_the_command_line_or_through_engine(launcher):
    c = launcher["by_name"]["user_set"]
    assert c["declared"] == [] and "kv_cache_dtype" in c["stash"]["explicit_fields"]
    assert c["stash"]["applied"] == {}
    e = launcher["by_name"]["engine"]
    assert "error" not in e, e
    assert e["declared"] == [] and {"kv_cache_dtype", "moe_runner_backend"} <= set(e["stash"]["explicit_fields"])
    assert e["fields"]["moe_runner_backend"] == "flashinfer_mxfp4"
    assert e["stash"]["field_values"]["moe_runner_backend"] == "flashinfer_mxfp4"
    # The user's flashinfer_mxfp4 is an explicit selection: downgraded loudly on the 3080.
    assert any(w.startswith("capdispatch: cuda:1 (NVIDIA GeForce RTX 3080): moe=flashinfer_cutlass_w4a8 was asked "
                            "for (sglang --moe-runner-backend flashinfer_mxfp4) but cannot run")
               for w in _messages(e["logs"], "WARNING"))


def test_launch_other_dtypes_and_models(launcher):
    b = launcher["by_name"]["bf16"]
    # bfloat16: the ops the model declaration does not put on the KV pool (the experts among them).
    assert b["stash"]["ops"] == list(model_calls().any_kv_cache_dtype) and "moe" in b["stash"]["ops"]
    assert "kv_quant" not in b["stash"]["ops"] and b["declared"] == []
    ll = launcher["by_name"]["llama"]
    assert ll["stash"]["ops"] == [] and ll["declared"] == []
    assert ll["logs"] == [["INFO", "capdispatch: LlamaForCausalLM runs no capdispatch op; nothing to decide at launch"]]


@pytest.fixture(scope="module")
def ranks(launcher):
    """Two scheduler processes as 0.5.17's run_scheduler_process runs them; then SGLang's TP
    group over gloo and the plugin's hook as init_torch_distributed calls it. The 3080's rank
    then calls SGLang 0.5.17's own call targets (TRITON_INTERPRET: capdispatch's Triton kernels)."""
    port = _free_port()
    env = {"CAPDISPATCH_SGLANG_DEVICES": RIG, "TRITON_INTERPRET": "1"}
    procs = [_start("rank", launcher["record"], 0, 0, port, env=env),
             _start("rank", launcher["record"], 1, 1, port, env={**env, "SCENARIO_CALLS": "1"})]
    return [_result(p) for p in procs]


def test_ranks_install_routes_at_0517s_targets(ranks):
    r0, r1 = (r["state"] for r in ranks)
    # The routes these cards get at 0.5.17's sites; any other op of the model is held to
    # the one rule (tests/rank_routes.py).
    assert_routes(r1, {"kv_quant": None, "kv_dequant": "kv_dequant_triton_u8", "indexer": "indexer_triton",
                       "sparse_prefill": "sparse_prefill_triton", "decode_mla": "decode_mla_triton",
                       "moe": "moe_triton_w4a16"})
    # SGLang 0.5.17's defaults: moe_runner_backend stays auto off a real SM120 device 0.
    assert_routes(r0, {"kv_quant": None, "kv_dequant": None, "indexer": "indexer_tilelang",
                       "sparse_prefill": None, "decode_mla": None, "moe": "moe_flashinfer_cutlass_w4a8"})
    assert_installs(r1, {
        "kv_quant": None,
        "kv_dequant": "installed at sglang.kernels.ops.attention.dsv4.dequant_k_cache.dequantize_k_cache_paged",
        "indexer": "installed at sglang.srt.layers.attention.dsv4.indexer.fp8_paged_mqa_logits_torch",
        "sparse_prefill": "installed at sgl_kernel.flash_mla.flash_mla_sparse_fwd",
        "decode_mla": "installed at sgl_kernel.flash_mla.flash_mla_with_kvcache",
        "moe": "installed at sglang.srt.layers.quantization.fp8.Fp8Config.get_quant_method"})
    assert r0["choices"]["indexer"]["install"].endswith("fp8_paged_mqa_logits_torch_sm120")
    for s in (r0, r1):
        assert s["env"] == {"SGLANG_OPT_USE_FUSED_STORE_CACHE": None, "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "true",
                            "SGLANG_OPT_USE_TILELANG_INDEXER": "false", "SGLANG_OPT_USE_AITER_INDEXER": "false"}
    # configure_scheduler_process's own result (dp_rank) is SGLang's.
    assert [r["dp_rank"] for r in ranks] == [None, None]


def test_ranks_correct_0517s_architecture_facts(ranks):
    f0, f1 = ranks[0]["facts"], ranks[1]["facts"]
    assert f1["probes"] == {"is_sm90_supported": False, "is_sm100_supported": False, "is_sm120_supported": False,
                            "is_blackwell_supported": False, "get_device_sm": 86}
    assert f0["probes"]["is_sm120_supported"] is True and f0["probes"]["get_device_sm"] == 120
    # The DSv4 backend's import-time _is_sm120 (what the routes' cc stand for), imported after the hook.
    assert f0["copies"]["deepseek_v4_backend._is_sm120"] is True and f1["copies"]["deepseek_v4_backend._is_sm120"] is False
    assert not f0["copies"]["deepseek_v4_backend_imported_before"]
    assert f0["copies"]["fp8_utils._is_sm120_supported"] is True and f1["copies"]["fp8_utils._is_sm120_supported"] is False
    assert [f["copies"]["deepseek_common.utils._device_sm"] for f in (f0, f1)] == [120, 86]
    assert f0["jit_arch"][:2] == [12, 0] and f1["jit_arch"][:2] == [8, 6]
    (info,) = [m for lv, m in ranks[0]["logs"] if lv == "INFO" and "rank on" in m]
    assert "is_sm120_supported False -> True" in info and "fp8_utils._is_sm120_supported False -> True" in info


def test_ranks_agree_through_init_torch_distributeds_hook_and_draft_workers_stand_aside(ranks):
    a0, a1 = ranks[0]["agreement"], ranks[1]["agreement"]
    assert a0["ranks"] == a1["ranks"] == ["rank0:cuda:0", "rank1:cuda:1"]
    assert a0["digest"] == a1["digest"] and a0["group"] == a1["group"]
    assert a0["group"]["kv_dequant"] == {"rank0:cuda:0": "triton_fp8", "rank1:cuda:1": "triton_u8"}
    for r in ranks:
        assert r["draft"] == {"logs": [], "same_agreement": True}


def test_routed_0517_call_targets_run_capdispatchs_kernels(ranks):
    """Tolerances as in test_sglang_integration's attention test; the dequant is exact on
    pools a KV store can write."""
    r = ranks[1]
    c, msg = r["calls"], f"seed {r['seed']}"
    assert c["dequant"] == {"routed": True, "identical": True}, msg
    d = c["decode"]
    assert d["routed"] and d["out_rel_err"] <= 1e-2, f"{msg}: {d}"
    assert d["lse"]["same_nonfinite"] and d["lse"]["max_abs"] <= 1e-3, f"{msg}: {d}"
    p = c["prefill"]
    assert p["routed"] and p["out_rel_err"] <= 1e-2, f"{msg}: {p}"
    for stat in ("max_logits", "lse"):
        assert p[stat]["same_nonfinite"] and p[stat]["max_abs"] <= 1e-3, f"{msg} {stat}: {p}"


def test_plan_names_0517_and_runs_its_resolution(model):
    p = _result(_start("plan", "--device", RIG, "--format", "json", "--", *_argv(model["dsv4"], "--tp-size", "2")))
    assert p["rc"] == 0, p
    out = json.loads(p["stdout"])
    assert out["sglang"] == {"version": "0.5.17", "installed": True, "tested": ">=0.5.17,<0.5.24", "in_range": True}
    assert {x["name"]: x["action"] for x in out["launch"]} == {"kv_cache_dtype": "set"}
    assert out["sglang_resolved"]["kv_cache_dtype"] == "fp8_e4m3"
    assert [r["ops"]["kv_dequant"]["routed"] for r in out["ranks"]] == [False, True]
    # SGLang 0.5.17's DSv4 default from device 0 (the 5090): flashinfer_mxfp4, kept there.
    assert [r["ops"]["moe"]["action"] for r in out["ranks"]] == ["kept", "routed"]
    # No platform facade in 0.5.17: the probes its readers call.
    assert out["ranks"][1]["arch"] == {"is_sm90_supported": False, "is_sm100_supported": False,
                                       "is_sm120_supported": False, "is_blackwell_supported": False,
                                       "get_device_sm": 86}
    assert not any(x["name"].startswith("dsv4_") for x in out["sglang_settings"])


# --------------------------------------------------------------------------- SGLang's own kernels on an H100

LIBS_0517 = ("sglang-kernel==0.4.5", "sgl-deep-gemm==0.1.5.post1")    # what 0.5.17 pins
OWN = {"decode_mla": ("flashmla", "sglang-kernel 0.4.5 sgl_kernel.flash_mla"),
       "sparse_prefill": ("flashmla_sparse", "sglang-kernel 0.4.5 sgl_kernel.flash_mla"),
       "indexer": ("deepgemm", "sgl-deep-gemm 0.1.5.post1 deep_gemm")}


@pytest.fixture(scope="module")
def h100_ranks(launcher):
    """One H100 rank as 0.5.17's run_scheduler_process runs it, on a machine with 0.5.17's pins
    (sglang-kernel 0.4.5, sgl-deep-gemm 0.1.5.post1) and on one without them (this machine's
    libraries: no sglang-kernel, sgl-deep-gemm 0.2.3.post2)."""
    env = {"CAPDISPATCH_SGLANG_DEVICES": "sim:h100", "TRITON_INTERPRET": "1"}
    out = {}
    for name, extra in (("pins", {"SCENARIO_ASSUME_LIBS": ",".join(LIBS_0517)}), ("without", {})):
        out[name] = _result(_start("rank", launcher["h100_record"], 0, 0, _free_port(), env={**env, **extra}))
    return out


def test_with_0517s_pins_sglangs_own_kernels_are_kept_and_named(h100_ranks):
    r = h100_ranks["pins"]
    st = r["state"]
    for op, (backend, label) in OWN.items():
        c = st["choices"][op]
        assert (c["action"], c["backend"], c["routed"]) == ("kept", backend, False), (op, c)
        assert f"SGLang's own kernel ({label}), judged by the knob map's statement" in c["why"], c["why"]
        assert st["routes"][op] is None and c["install"] is None
    # Nothing switches SGLang off its DeepGEMM indexer.
    assert st["env"]["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] is None
    (info,) = [m for lv, m in r["logs"] if lv == "INFO" and "rank on" in m]
    assert "SGLang's own kernel, not verified by capdispatch: indexer (SGLang's own kernel (sgl-deep-gemm " \
           "0.1.5.post1 deep_gemm))" in info


def test_the_rank_report_says_sglangs_own_kernels_are_not_verified_by_capdispatch(h100_ranks):
    rep = h100_ranks["pins"]["report"]
    for op, (backend, label) in OWN.items():
        assert rep["ops"][op]["canary"] == {backend: f"not verified by capdispatch (SGLang's own kernel ({label}))"}
    assert rep["verification"].startswith("SGLang's own kernel, not verified by capdispatch: ")
    assert "verified on this card" not in rep["verification"]


def test_without_0517s_pins_the_ops_are_routed_and_say_why(h100_ranks):
    st = h100_ranks["without"]["state"]
    assert {op: st["choices"][op]["action"] for op in OWN} == {op: "routed" for op in OWN}
    assert st["choices"]["decode_mla"]["why"].startswith(
        "SGLang's own flash_mla_with_kvcache (sglang-kernel>=0.4.5,<0.4.6 sgl_kernel.flash_mla) cannot run there: "
        "library:sglang-kernel: need sglang-kernel>=0.4.5,<0.4.6, found not installed")
    assert "library:sgl-deep-gemm: need sgl-deep-gemm>=0.1.5.post1,<0.1.6, found" in st["choices"]["indexer"]["why"]
    assert st["choices"]["decode_mla"]["install"] == "installed at sgl_kernel.flash_mla.flash_mla_with_kvcache"
    assert st["choices"]["sparse_prefill"]["install"] == "installed at sgl_kernel.flash_mla.flash_mla_sparse_fwd"
    assert st["env"]["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] == "true"
    assert h100_ranks["without"]["report"]["verification"] is None       # a simulated card: nothing to prove


@pytest.mark.parametrize("libs,kept", [(LIBS_0517, True), (("sgl-flash-mla==1.0.0", "sgl-deep-gemm==0.2.3.post2"),
                                                           False)])
def test_plan_on_an_h100_judges_sglangs_own_kernels_by_0517s_statement(model, libs, kept):
    """The plan, the launch and the rank decide alike: one pass through SGLang 0.5.17's own
    argument resolution. 0.5.23's libraries are not 0.5.17's kernels."""
    args = ["--device", "sim:h100", "--format", "json"] + [x for lib in libs for x in ("--assume-lib", lib)]
    p = _result(_start("plan", *args, "--", *_argv(model["dsv4"], "--tp-size", "1")))
    assert p["rc"] == 0, p
    out = json.loads(p["stdout"])
    ops = out["ranks"][0]["ops"]
    for op, (backend, label) in OWN.items():
        assert ops[op]["action"] == ("kept" if kept else "routed"), (op, ops[op])
        if kept:
            assert ops[op]["backend"] == backend and f"SGLang's own kernel ({label})" in ops[op]["why"]
            assert ops[op]["host"] == f"SGLang's own kernel ({label})"
        else:
            need = "sgl-deep-gemm>=0.1.5.post1,<0.1.6" if op == "indexer" else "sglang-kernel>=0.4.5,<0.4.6"
            assert f"need {need}, found " in ops[op]["why"] and ops[op]["host"] is None, (op, ops[op])


def test_an_emulated_rank_decides_as_its_card_with_0517s_facts_the_devices(launcher):
    """emu:rtx-3080@sim:h100 through 0.5.17's launcher and configure_scheduler_process: the
    3080's routes at 0.5.17's targets, SGLang's probes and import-time copies the H100's."""
    c = launcher["by_name"]["emu"]
    assert "error" not in c, c
    (info,) = [m for m in _messages(c["logs"], "INFO") if "SGLang launch" in m]
    assert "cuda:0 NVIDIA GeForce RTX 3080, cc 8.6 (emulated on sim:h100: NVIDIA H100 80GB HBM3, cc 9.0)" in info
    r = _result(_start("emu", launcher["record_emu"], 0, 0, env={"CAPDISPATCH_SGLANG_DEVICES": EMU_3080}))
    assert "error" not in r, r
    assert_routes(r["state"], {"kv_quant": None, "kv_dequant": "kv_dequant_triton_u8",
                               "indexer": "indexer_triton", "sparse_prefill": "sparse_prefill_triton",
                               "decode_mla": "decode_mla_triton", "moe": "moe_triton_w4a16"})
    f = r["facts"]
    assert f["probes"] == {"is_sm90_supported": True, "is_sm100_supported": False, "is_sm120_supported": False,
                           "is_blackwell_supported": False, "get_device_sm": 90}
    assert f["copies"]["deepseek_v4_backend._is_sm120"] is False and f["copies"]["deepseek_common.utils._device_sm"] == 90
    assert f["jit_arch"][:2] == [9, 0]
    assert (r["emulated"]["card"], r["emulated"]["on"], r["emulated"]["device"]) == (
        "rtx-3080", "sim:h100", "NVIDIA H100 80GB HBM3")


def test_an_emulated_5090_on_an_h100_is_refused_at_0517s_launch_and_rank(launcher):
    e = launcher["by_name"]["emu_refused"]["error"]
    assert e.startswith("Unsatisfiable: capdispatch: rank 0 (emu:rtx-5090@sim:h100): "), e
    r = _result(_start("emu", launcher["record_emu"], 0, 0, env={"CAPDISPATCH_SGLANG_DEVICES": EMU_5090}))
    assert r["error"].startswith("Unsatisfiable: capdispatch: rank 0 (emu:rtx-5090@sim:h100): "), r


def test_expert_parallelism_under_a_global_id_runner_value_is_refused_at_launch_and_rank(launcher):
    """0.5.17's StandardDispatcher maps expert ids to EP-local ones from the launch-wide
    moe_runner_backend (skip_local_expert_mapping), not per layer: under flashinfer_mxfp4 a
    routed layer (the 3080's) would get global ids. One line at launch; where the launch
    could not decide (no NVML), the routed rank refuses and the rank that keeps SGLang's
    method does not. Under auto (0.5.17 maps the ids to local) the launch goes ahead."""
    e = launcher["by_name"]["ep_global"]["error"]
    assert e == ("Unsatisfiable: capdispatch: SGLang 0.5.17 with --ep-size 2 and moe_runner_backend=flashinfer_mxfp4 "
                 "is not supported: its dispatcher hands every MoE layer global expert ids under that launch-wide "
                 "value, and capdispatch's MoE method, routed on cuda:1, takes EP-local ids; give --ep-size 1 or "
                 "--moe-runner-backend triton (its dispatcher maps the ids to local), or use SGLang 0.5.23 (it maps "
                 "them per layer)"), e
    auto = launcher["by_name"]["ep_auto"]
    assert "error" not in auto, auto
    assert "error" not in launcher["by_name"]["ep_ranks"]
    env = {"CAPDISPATCH_SGLANG_DEVICES": RIG}
    r1 = _result(_start("emu", launcher["record_ep"], 1, 1, env=env))
    assert r1["error"].startswith("Unsatisfiable: capdispatch: SGLang 0.5.17 with --ep-size 2 and "
                                  "moe_runner_backend=flashinfer_mxfp4 is not supported"), r1
    assert "routed on cuda:1," in r1["error"]
    r0 = _result(_start("emu", launcher["record_ep"], 0, 0, env=env))
    assert "error" not in r0, r0
    assert r0["state"]["choices"]["moe"]["action"] == "kept"


def test_the_engine_suites_first_case_keeps_every_op_on_an_h100(model):
    """The engine suite's launch on an H100 with 0.5.17's pins (benchmarks/run_engine_rehearsal.py:
    --moe-runner-backend marlin --fp8-gemm-backend triton): every op keeps SGLang's own kernel,
    the MoE its Marlin (the runner value is the user's choice, which 0.5.17's Marlin serves), so
    the plugin-on and plugin-off runs must give identical tokens."""
    args = ["--device", "sim:h100", "--format", "json", "--assume-lib", "apache-tvm-ffi==0.1.11"]
    args += [x for lib in LIBS_0517 for x in ("--assume-lib", lib)]
    p = _result(_start("plan", *args, "--", *_argv(model["dsv4"], "--tp-size", "1", "--moe-runner-backend", "marlin",
                                                    "--fp8-gemm-backend", "triton")))
    assert p["rc"] == 0, p
    ops = json.loads(p["stdout"])["ranks"][0]["ops"]
    assert {op: ops[op]["action"] for op in ops} == {op: "kept" for op in ops}, ops
    assert ops["moe"]["backend"] == "marlin_w4a16"
