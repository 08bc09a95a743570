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
    }
    path = root / "cases.json"
    path.write_text(json.dumps(list(cases.values())))
    r = _result(_start("launcher", path))
    r["by_name"] = dict(zip(cases, r["cases"]))
    r["record"] = cases["mixed"]["pickle"]
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
