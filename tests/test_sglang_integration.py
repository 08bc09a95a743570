"""The SGLang adapter inside the real SGLang 0.5.23 (installed with --no-deps plus
tests/requirements-nodeps.txt and tests/requirements.txt): SGLang's own plugin loader, argument resolution,
per-rank process setup, TP group and DeepSeek-V4 KV kernels. Nothing of SGLang
is mocked; each scenario runs in fresh processes (tests/sglang_scenarios.py),
because SGLang keeps per-process plugin state and spawns a process per rank.
The group's devices are simulated with CAPDISPATCH_SGLANG_DEVICES."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

from capdispatch.models import model_calls
from rank_routes import assert_routes

# Skip without SGLang, but never import it here: it imports Triton, and Triton
# decides at import whether to interpret (TRITON_INTERPRET), which other test
# modules set per test. SGLang runs only in the scenarios' own processes.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="needs SGLang (see tests/requirements-nodeps.txt and tests/requirements.txt)")

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "sglang_scenarios.py")
POL = os.path.join(HERE, "policies")
RIG = "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080"
EMU_3080 = "emu:rtx-3080@sim:h100"       # decided as an RTX 3080, SGLang's facts an H100's
EMU_5090 = "emu:rtx-5090@sim:h100"
TIMEOUT = 300


def _env(extra=None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CAPDISPATCH_", "SGLANG_", "TRITON_INTERPRET"))}
    # Rank reports go to a scratch directory, never the user's cache.
    env["CAPDISPATCH_REPORT_DIR"] = os.path.join(tempfile.gettempdir(), "capdispatch-test-reports")
    env.update(extra or {})
    return env


def _start(*args, env=None):
    return subprocess.Popen([sys.executable, SCENARIOS, *map(str, args)], env=_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc) -> dict:
    out, err = proc.communicate(timeout=TIMEOUT)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _run(*args, env=None) -> dict:
    return _result(_start(*args, env=env))


def _messages(logs, level=None):
    return [m for lv, m in logs if level is None or lv == level]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    sys.path.insert(0, HERE)
    import sglang_fake_models as fake
    root = tmp_path_factory.mktemp("sglang")
    return {"root": root, "dsv4": fake.write(str(root / "dsv4"), fake.DSV4),
            "llama": fake.write(str(root / "llama"), fake.LLAMA)}


def _argv(model_path, *more):
    return ["--model-path", model_path, "--skip-tokenizer-init", "--device", "cuda", *more]


@pytest.fixture(scope="module")
def launcher(model):
    """One fresh launcher process: SGLang's load_plugins, then one resolution per case."""
    root, dsv4 = model["root"], model["dsv4"]
    sim = {"CAPDISPATCH_SGLANG_DEVICES": RIG}
    cases = {
        "mixed": {"argv": _argv(dsv4, "--tp-size", "3"), "env": sim, "pickle": str(root / "mixed.pkl")},
        "user_set": {"argv": _argv(dsv4, "--tp", "3", "--kv-cache-dtype=fp8_e4m3"),
                     "env": {**sim, "SGLANG_DSV4_KV_LAYOUT": "v41"}},
        "bf16": {"argv": _argv(dsv4, "--tp-size", "3", "--kv-cache-dtype", "bfloat16"), "env": sim},
        "downgrade": {"argv": _argv(dsv4, "--tp-size", "3"),
                      "env": {**sim, "CAPDISPATCH_SET": "kv_dequant=triton_fp8"}},
        "strict": {"argv": _argv(dsv4, "--tp-size", "3"),
                   "env": {**sim, "CAPDISPATCH_SET": "kv_dequant=triton_fp8", "CAPDISPATCH_STRICT": "1"}},
        "error_policy": {"argv": _argv(dsv4, "--tp-size", "3"),
                         "env": {**sim, "CAPDISPATCH_POLICY": os.path.join(POL, "error.yaml")}},
        "no_nvml": {"argv": _argv(dsv4, "--tp-size", "2"), "env": {}},
        "llama": {"argv": _argv(model["llama"], "--tp-size", "3"), "env": sim},
        # An RTX 3080 emulated on an H100, and an RTX 5090 there (tests/test_sglang_integration.py, emulation).
        "emu": {"argv": _argv(dsv4, "--tp-size", "1"), "env": {"CAPDISPATCH_SGLANG_DEVICES": EMU_3080},
                "pickle": str(root / "emu.pkl")},
        "emu_refused": {"argv": _argv(dsv4, "--tp-size", "1"), "env": {"CAPDISPATCH_SGLANG_DEVICES": EMU_5090}},
        "user_tilelang": {"argv": _argv(dsv4, "--tp-size", "3"),
                          "env": {**sim, "SGLANG_OPT_USE_TILELANG_INDEXER": "1"},
                          "pickle": str(root / "user_tilelang.pkl")},
    }
    path = root / "cases.json"
    path.write_text(json.dumps(list(cases.values())))
    r = _run("launcher", path)
    r["by_name"] = dict(zip(cases, r["cases"]))
    r["record"] = cases["mixed"]["pickle"]
    r["record_user_tilelang"] = cases["user_tilelang"]["pickle"]
    r["record_emu"] = cases["emu"]["pickle"]
    return r


# --------------------------------------------------------------------------- plugin

def test_sglang_plugin_loader_discovers_and_runs_register(launcher):
    assert "capdispatch.adapters.sglang:register" in launcher["entry_points"]
    assert launcher["registered"] is True and launcher["again"] is True
    assert launcher["resolution_hooks"] == ["handle_model_specific_adjustments"]
    assert launcher["hook_targets"] == ["sglang.srt.distributed.bootstrap.init_parallel_runtime",
                                        "sglang.srt.managers.scheduler.configure_scheduler_process"]
    assert launcher["configure_patched"] and launcher["parallel_patched"]
    assert launcher["load_logs"] == []        # registering decides and logs nothing


def test_knob_map_names_exist_in_this_sglang(launcher):
    assert launcher["knob_name_problems"] == []


# --------------------------------------------------------------------------- launch

def test_launch_sets_fields_and_environment_for_the_mixed_rig(launcher):
    c = launcher["by_name"]["mixed"]
    assert c["fields"]["kv_cache_dtype"] == "fp8_e4m3" and c["fields"]["tp_size"] == 3
    assert c["declared"] == [{"kv_cache_dtype": "fp8_e4m3"}]
    assert c["env"] == {"SGLANG_DSV4_KV_LAYOUT": "v4"}
    assert c["stash"]["ops"] == list(model_calls().ops)
    # SGLang's /server_info dumps vars(server_args) as JSON: the plugin's attribute is text there.
    assert c["stash_json"].startswith('"capdispatch launch inputs: '), c["stash_json"]
    assert c["stash"]["applied"] == {"kv_cache_dtype": "fp8_e4m3", "SGLANG_DSV4_KV_LAYOUT": "v4"}
    assert c["stash"]["user_env"] == {}
    infos = _messages(c["logs"], "INFO")
    assert len(infos) == 1
    assert "cuda:1 NVIDIA GeForce RTX 3080, cc 8.6 (simulated)" in infos[0]
    assert "kv_dequant: SGLang's own kernel on cuda:0; capdispatch triton_u8 on cuda:1, cuda:2" in infos[0]
    # SM86 has no FlashMLA decode: SGLang's call site is routed there.
    assert "decode_mla: SGLang's own kernel on cuda:0; capdispatch triton on cuda:1, cuda:2 (SGLang's own " \
           "flash_mla_with_kvcache cannot run there" in infos[0]
    warnings = _messages(c["logs"], "WARNING")
    assert {w.split(": ")[1] for w in warnings} >= {"kv_dequant", "indexer", "decode_mla"}
    assert all("the group's devices choose different backends" in w for w in warnings)


def test_launch_never_overwrites_what_the_user_set(launcher):
    c = launcher["by_name"]["user_set"]
    assert c["declared"] == []                                   # --kv-cache-dtype was the user's
    assert c["fields"]["kv_cache_dtype"] == "fp8_e4m3"
    assert c["env"] == {"SGLANG_DSV4_KV_LAYOUT": "v41"}          # the user's environment stands
    assert c["stash"]["applied"] == {}
    warnings = _messages(c["logs"], "WARNING")
    assert any("SGLANG_DSV4_KV_LAYOUT=v41 was set by the user and is kept, but cuda:1, cuda:2 need "
               "SGLANG_DSV4_KV_LAYOUT=v4" in w for w in warnings)
    info = _messages(c["logs"], "INFO")[0]
    assert "kept the user's kv_cache_dtype=fp8_e4m3" in info and "kept the user's SGLANG_DSV4_KV_LAYOUT=v41" in info


def test_launch_user_bf16_cache_means_no_kv_op(launcher):
    """A bfloat16 KV cache: no KV or attention op; the experts are still decided."""
    c = launcher["by_name"]["bf16"]
    assert c["fields"]["kv_cache_dtype"] == "bfloat16"
    assert c["declared"] == [] and c["env"] == {"SGLANG_DSV4_KV_LAYOUT": None}
    # The ops the model declaration does not put on the KV pool (the experts among them).
    anyd = list(model_calls().any_kv_cache_dtype)
    assert "moe" in anyd and "kv_quant" not in anyd
    assert c["stash"]["ops"] == anyd and c["stash"]["applied"] == {}
    (info,) = _messages(c["logs"], "INFO")
    assert info.startswith("capdispatch: SGLang launch of kv_cache_dtype=bfloat16: DeepseekV4ForCausalLM's KV "
                           f"and attention ops run with auto or fp8_e4m3 only; {', '.join(anyd)} "
                           f"run{'s' if len(anyd) == 1 else ''} with any on ")
    assert "moe: SGLang's own kernel on cuda:0; capdispatch triton_w4a16 on cuda:1, cuda:2 (SGLang's " \
           "Mxfp4FlashinferTrtllmMoEMethod under moe_runner_backend=flashinfer_mxfp4 (SGLang's DeepSeek-V4 " \
           "default from device 0 (cuda:0, NVIDIA GeForce RTX 5090)) cannot run on this card" in info


def test_launch_explicit_choice_downgraded_per_device_or_refused_under_strict(launcher):
    c = launcher["by_name"]["downgrade"]
    downgrades = [w for w in _messages(c["logs"], "WARNING") if "was asked for (CAPDISPATCH_SET)" in w]
    assert [w.split(" ")[1] for w in downgrades] == ["cuda:1", "cuda:2"]
    s = launcher["by_name"]["strict"]
    assert s["error"].startswith("StrictFallbackError: strict: cuda:1 (NVIDIA GeForce RTX 3080): "
                                 "kv_dequant=triton_fp8 was asked for (CAPDISPATCH_SET) but cannot run")


def test_launch_mixed_group_error_refuses(launcher):
    e = launcher["by_name"]["error_policy"]["error"]
    assert e.startswith("GroupDivergenceError: kv_dequant: the group's devices choose different backends")


def test_launch_without_nvml_sets_nothing_but_ranks_still_decide(launcher):
    c = launcher["by_name"]["no_nvml"]
    assert c["declared"] == [] and c["env"] == {"SGLANG_DSV4_KV_LAYOUT": None}
    assert c["stash"]["ops"] == list(model_calls().ops)
    (w,) = _messages(c["logs"], "WARNING")
    assert "cannot read the launch's GPUs cuda:0, cuda:1 without initialising CUDA" in w


def test_launch_other_models_untouched(launcher):
    c = launcher["by_name"]["llama"]
    assert c["declared"] == [] and c["stash"]["ops"] == []
    assert c["fields"]["kv_cache_dtype"] == "auto"


def test_outside_the_tested_version_range_one_warning_nothing_changed(launcher, model):
    path = model["root"] / "version_cases.json"
    path.write_text(json.dumps([{"argv": _argv(model["dsv4"], "--tp-size", "3"),
                                 "env": {"CAPDISPATCH_SGLANG_DEVICES": RIG}}]))
    r = _run("version", "0.5.22", path)
    assert r["first"] is False and r["again"] is False
    (w,) = [m for lv, m in r["register_logs"] if lv == "WARNING"]
    assert "SGLang 0.5.22 is outside the tested range >=0.5.17,<0.5.24" in w
    assert r["env_changed"] == [] and r["hook_targets"] == [] and r["resolution_hooks"] == []
    (c,) = r["cases"]
    assert c["declared"] == [] and c["stash"] is None and c["logs"] == []
    assert c["env"] == {"SGLANG_DSV4_KV_LAYOUT": None}
    # SGLang's own resolution, untouched.
    mixed = launcher["by_name"]["mixed"]["fields"]
    assert c["fields"] == mixed


# --------------------------------------------------------------------------- ranks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODES = ("-", os.path.join(POL, "error.yaml"), os.path.join(POL, "uniform.yaml"), "require-rehearsal")


@pytest.fixture(scope="module")
def ranks(launcher):
    """Three scheduler processes on the simulated rig. Each also starts out believing
    what SGLang's override facility says of device 0 (an RTX 5090). Once SGLang's
    TP group exists they agree three times: mixed_group warn (the default), error,
    uniform -- the same sequence on every rank."""
    port = _free_port()
    env = {"CAPDISPATCH_SGLANG_DEVICES": RIG, "SCENARIO_DEVICE0_SM120": "1"}
    procs = [_start("rank", launcher["record"], r, r, port, ",".join(MODES), env=env) for r in range(3)]
    return [_result(p) for p in procs]


def test_each_rank_decides_for_its_own_card(ranks):
    states = [r["state"] for r in ranks]
    assert [s["device"]["name"] for s in states] == ["NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 3080",
                                                      "NVIDIA GeForce RTX 3080"]
    assert [s["choices"]["kv_dequant"]["backend"] for s in states] == ["triton_fp8", "triton_u8", "triton_u8"]
    kv = "kv_dequant_triton_u8"
    # The routes each card gets; any other op of the model is held to the one rule
    # (tests/rank_routes.py).
    sm86 = {"kv_quant": None, "kv_dequant": kv,
            "indexer": "indexer_triton",
            "sparse_prefill": "sparse_prefill_triton",
            "decode_mla": "decode_mla_triton",
            "moe": "moe_triton_w4a16"}
    # The 5090: FlashInfer's SM120 decode is SGLang's own (kept); DeepGEMM has no SM120
    # indexer (routed to capdispatch's TileLang kernel); SGLang calls no sparse-prefill
    # site on SM120 (its extends go through the SM120 decode entry). MoE: this CPU
    # launcher's own platform facts are no GPU's, so SGLang's DSv4 default stays
    # moe_runner_backend=auto (Fp8MoEMethod, no MXFP4 kernel) and every rank is routed,
    # the 5090 to capdispatch's FlashInfer SM120 adapter (tests/test_sglang_moe.py
    # launches with device 0's SM120 facts, where the 5090 keeps SGLang's method).
    for s, known in zip(states, [{"kv_quant": None, "kv_dequant": None,
                                  "indexer": "indexer_tilelang",
                                  "sparse_prefill": None, "decode_mla": None,
                                  "moe": "moe_flashinfer_cutlass_w4a8"},
                                 sm86, sm86], strict=True):
        assert_routes(s, known)
    assert [s["choices"]["moe"]["action"] for s in states] == ["routed", "routed", "routed"]
    assert all("moe_runner_backend=auto (as SGLang resolved it)" in s["choices"]["moe"]["why"] for s in states)
    assert states[0]["choices"]["sparse_prefill"]["why"] == "SGLang calls no routable sparse_prefill site on this card"
    assert states[1]["choices"]["decode_mla"]["why"].startswith(
        "SGLang's own flash_mla_with_kvcache cannot run there: feature:")
    # The indexer route turns SGLang's torch switch on in the rank's own process.
    for s in states:
        assert s["env"] == {"SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "true",
                            "SGLANG_OPT_USE_TILELANG_INDEXER": "false", "SGLANG_OPT_USE_AITER_INDEXER": "false"}
    for r in ranks:
        (info,) = [m for lv, m in r["logs"] if lv == "INFO" and "rank on" in m]
        assert f"rank on {r['state']['device']['id']} {r['state']['device']['name']}" in info


def test_sglang_architecture_facts_on_an_sm86_rank_say_sm86(ranks):
    f = ranks[1]["facts"]
    assert f["platform"] == {"is_sm90": False, "is_sm100": False, "is_sm120": False, "is_blackwell": False,
                             "device_sm": 86, "device_capability": [8, 6]}
    assert f["probes"] == {"is_sm90_supported": False, "is_sm100_supported": False,
                           "is_sm120_supported": False, "is_blackwell_supported": False,
                           "is_sm120": False, "get_device_sm": 86}
    assert f["copies"]["sglang.srt.utils.is_sm120_supported"] is False
    assert f["copies"]["deep_gemm_sm120._is_sm120"] is False
    # Imported after the correction (by the indexer route's target module): it read the rank's facts.
    assert f["copies"]["dsv4.metadata._IS_SM120"] is False
    assert f["jit_arch"][:2] == [8, 6]
    f0 = ranks[0]["facts"]      # this CPU machine's probes said "not SM120": corrected to the 5090's
    assert f0["probes"]["is_sm120_supported"] is True and f0["copies"]["deep_gemm_sm120._is_sm120"] is True
    assert f0["platform"]["device_sm"] == 120 and f0["jit_arch"][:2] == [12, 0]
    (info,) = [m for lv, m in ranks[0]["logs"] if lv == "INFO" and "rank on" in m]
    assert "is_sm120_supported False -> True" in info


def test_ranks_agree_over_sglangs_tp_group(ranks):
    runs = [r["agreements"][0] for r in ranks]
    assert all(a["error"] is None for a in runs)
    assert runs[0]["group"] == runs[1]["group"] == runs[2]["group"]
    group = runs[0]["group"]
    assert group["kv_dequant"] == {"rank0:cuda:0": "triton_fp8", "rank1:cuda:1": "triton_u8",
                                   "rank2:cuda:2": "triton_u8"}
    assert group["decode_mla"] == {"rank0:cuda:0": "flashinfer_sparse_mla", "rank1:cuda:1": "triton",
                                   "rank2:cuda:2": "triton"}
    divergent = [op for op, row in group.items() if len(set(row.values())) > 1]
    divergence = [m for a in runs for lv, m in a["logs"]
                  if lv == "WARNING" and "the group's devices choose different backends" in m]
    assert len(divergence) == len(divergent)           # once per op for the group, by rank 0


def test_ranks_mixed_group_error_aborts_every_rank_with_one_message(ranks):
    errors = {r["agreements"][1]["error"] for r in ranks}
    assert len(errors) == 1
    (e,) = errors
    assert e.startswith("kv_dequant: the group's devices choose different backends") and "mixed_group is error" in e


def test_ranks_mixed_group_uniform_reroutes_the_fast_card(ranks):
    assert ranks[0]["state"]["routes"]["kv_dequant"] is None                 # alone: SGLang's own
    after = [r["agreements"][2] for r in ranks]
    assert all(a["error"] is None for a in after)
    assert {a["state"]["choices"]["kv_dequant"]["backend"] for a in after} == {"triton_u8"}
    assert after[0]["state"]["routes"]["kv_dequant"] == "kv_dequant_triton_u8"
    (info,) = [m for lv, m in after[0]["logs"] if lv == "INFO" and "after agreement" in m]
    assert "after agreement with 3 rank(s): kv_dequant: triton_fp8 -> triton_u8" in info


# --------------------------------------------------------------------------- KV routes

def test_kv_dequant_route_matches_sglangs_reference_under_the_triton_interpreter(launcher):
    # cuda:1 (RTX 3080): SGLang's fp8 Triton kernel cannot run; the route runs capdispatch's triton_u8.
    r = _run("kv", launcher["record"], 1, 1, env={"CAPDISPATCH_SGLANG_DEVICES": RIG, "TRITON_INTERPRET": "1"})
    assert r["state"]["routes"]["kv_dequant"] == "kv_dequant_triton_u8"
    assert r["backend_binding_routed"] and r["backend_binding_is_source"]
    for c in r["dequant"]:
        msg = f"seed {r['seed']} (KV_TEST_SEED replays): {c}"
        assert c["backend_binding_identical"] and c["out_slice_identical"], msg
        if c["pool"] == "store-range":
            assert c["identical"], msg
        else:
            # Every byte random: the interpreter's numpy emulation gets NaN payloads and
            # bf16-subnormal products wrong (see tests/test_kv_cache_kernels.py); nothing else.
            assert c["differing_not_nan_or_subnormal"] == 0, msg


def test_kv_routes_for_an_explicit_choice_match_sglangs_reference(launcher):
    env = {"CAPDISPATCH_SGLANG_DEVICES": RIG, "TRITON_INTERPRET": "1",
           "CAPDISPATCH_SET": "kv_dequant=torch,kv_quant=torch"}
    r = _run("kv", launcher["record"], 0, 0, env=env)
    routes = r["state"]["routes"]
    assert (routes["kv_quant"], routes["kv_dequant"]) == ("kv_quant_torch",
                                                          "kv_dequant_torch")
    for c in r["dequant"]:          # every byte random, including NaN codes and overflowing scales
        assert c["identical"] and c["backend_binding_identical"] and c["out_slice_identical"], \
            f"seed {r['seed']}: {c}"
    s = r["store"]
    assert s["pool_identical_to_capdispatch_reference"] and s["rope_exact"], f"seed {r['seed']}: {s}"
    assert s["nope_max_rel_err"] < 0.07, f"seed {r['seed']}: {s}"


# --------------------------------------------------------------------------- dispatch sglang plan

def test_plan_with_sglang_arguments_runs_sglangs_resolution(model):
    code = ("import sys; sys.path.insert(0, %r); import sglang_prelude; "
            "from capdispatch.dispatch.cli import main; sys.exit(main(sys.argv[1:]))" % HERE)
    argv = ["sglang", "plan", "--device", RIG, "--format", "json", "--",
            *_argv(model["dsv4"], "--tp-size", "3", "--kv-cache-dtype", "fp8_e4m3")]
    p = subprocess.run([sys.executable, "-c", code, *argv], env=_env(), text=True,
                       capture_output=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["model"] == {"architecture": "DeepseekV4ForCausalLM", "assumed": False,
                            "kv_cache_dtype": "fp8_e4m3"}
    assert {x["name"]: x["action"] for x in out["launch"]} == {"kv_cache_dtype": "kept",
                                                                "SGLANG_DSV4_KV_LAYOUT": "set"}
    assert out["sglang_resolved"]["kv_cache_dtype"] == "fp8_e4m3"
    assert out["sglang_resolved"]["SGLANG_DSV4_KV_LAYOUT"] == "v4"
    assert [r["ops"]["kv_dequant"]["routed"] for r in out["ranks"]] == [False, True, True]
    # The plan predicts SGLang's DeepSeek-V4 default from device 0 (the 5090: flashinfer_mxfp4):
    # kept on the 5090, routed on the 3080s.
    assert [r["ops"]["moe"]["action"] for r in out["ranks"]] == ["kept", "routed", "routed"]
    assert [r["ops"]["moe"]["backend"] for r in out["ranks"]] == [
        "flashinfer_cutlass_w4a8", "triton_w4a16", "triton_w4a16"]
    # --assume-lib reaches the plugin's own launch step inside SGLang's resolution: an
    # H200 with an older FlashMLA routes decode, so that step sets the V4 layout.
    for lib, routed, layout in (("sgl-flash-mla==0.9.0", True, "v4"), ("sgl-flash-mla==1.0.0", False, None)):
        p = subprocess.run([sys.executable, "-c", code, "sglang", "plan", "--device", "sim:h200",
                            "--assume-lib", lib, "--format", "json", "--",
                            *_argv(model["dsv4"], "--tp-size", "1")],
                           env=_env(), text=True, capture_output=True, timeout=TIMEOUT)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout)
        assert out["ranks"][0]["ops"]["decode_mla"]["routed"] is routed, lib
        assert out["sglang_resolved"]["SGLANG_DSV4_KV_LAYOUT"] == layout, lib
        attn = next(x for x in out["sglang_settings"] if x["name"] == "dsv4_attn_backend")
        assert attn["wants"] == ({} if routed else {"flashmla": ["cuda:0"]}), lib
    bad = subprocess.run([sys.executable, "-c", code, "sglang", "plan", "--device", RIG, "--",
                          "--model-path", model["dsv4"], "--tp-size", "three"],
                         env=_env(), text=True, capture_output=True, timeout=TIMEOUT)
    assert bad.returncode == 2 and "SGLang rejected the arguments" in bad.stderr
    assert "Traceback" not in bad.stderr


# --------------------------------------------------------------------------- attention routes

def test_attention_routes_on_an_sm86_rank_run_capdispatchs_kernels_at_sglangs_call_sites(launcher):
    """cuda:1 (RTX 3080): FlashMLA (decode, sparse prefill) and DeepGEMM (indexer) have no
    SM86 kernels. The rank routes SGLang's own functions, called the way SGLang's DSv4
    backend calls them, to capdispatch's Triton kernels (under the interpreter here);
    FlashMLA itself is a stand-in that raises if reached (tests/sglang_prelude.py).
    Tolerances: out relative error (Frobenius) <= 1e-2 as in tests/test_decode_mla.py
    and tests/test_sparse_prefill.py, statistics 1e-3 absolute; indexer logits
    within 1e-4 of the largest |logit| of capdispatch's fp32 reference (both fp32),
    3e-2 of SGLang's own torch version (which stages q and K in bf16)."""
    r = _run("attn", launcher["record"], 1, 1, env={"CAPDISPATCH_SGLANG_DEVICES": RIG, "TRITON_INTERPRET": "1"})
    msg = f"seed {r['seed']} (KV_TEST_SEED replays)"
    routes = r["state"]["routes"]
    assert routes["decode_mla"] == "decode_mla_triton"
    assert routes["sparse_prefill"] == "sparse_prefill_triton"
    assert routes["indexer"] == "indexer_triton"
    d = r["decode"]
    assert "error" not in d, f"{msg}: {d}"
    assert d["routed"] and d["finite"] and d["shape"] == [3, 1, 6, 512], f"{msg}: {d}"
    assert d["out_rel_err"] <= 1e-2, f"{msg}: {d}"
    assert d["lse"]["same_nonfinite"] and d["lse"]["max_abs"] <= 1e-3, f"{msg}: {d}"
    p = r["prefill"]
    assert "error" not in p, f"{msg}: {p}"
    for legacy, c in p.items():
        assert c["out_rel_err"] <= 1e-2, f"{msg} {legacy}: {c}"
        for stat in ("max_logits", "lse"):
            assert c[stat]["same_nonfinite"] and c[stat]["max_abs"] <= 1e-3, f"{msg} {legacy} {stat}: {c}"
    ix = r["indexer"]
    assert "error" not in ix, f"{msg}: {ix}"
    assert ix["routed"] and ix["torch_switch"] is True and ix["tilelang_switch"] is False, f"{msg}: {ix}"
    assert ix["shape"] == [4, 192] and ix["masked_minus_inf"], f"{msg}: {ix}"
    assert ix["max_abs_vs_reference"] <= 1e-4, f"{msg}: {ix}"
    assert ix["max_abs_vs_sglang_torch"] <= 3e-2, f"{msg}: {ix}"
    routed = [m for lv, m in r["logs"] if lv == "INFO" and "indexer routed on" in m]
    assert routed and "set SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=true" in routed[0]
    assert (d["site"], ix["site"]) == ("flash_mla_with_kvcache", "fp8_paged_mqa_logits_torch")


# --------------------------------------------------------------------------- emulated ranks

SM86_ROUTES = {"kv_quant": None, "kv_dequant": "kv_dequant_triton_u8", "indexer": "indexer_triton",
               "sparse_prefill": "sparse_prefill_triton", "decode_mla": "decode_mla_triton", "moe": "moe_triton_w4a16"}


def test_an_emulated_rank_decides_as_its_card_with_sglangs_facts_the_devices(launcher):
    """emu:rtx-3080@sim:h100: the launch and the rank decide as the RTX 3080 (its routes, the
    real-card sites SGLang calls on the H100 alike); SGLang's own architecture facts are the
    H100's, so every kernel SGLang runs itself is the one it runs there without the plugin;
    the report says which card is emulated on which device."""
    c = launcher["by_name"]["emu"]
    assert "error" not in c, c
    (info,) = _messages(c["logs"], "INFO")
    assert "cuda:0 NVIDIA GeForce RTX 3080, cc 8.6 (emulated on sim:h100: NVIDIA H100 80GB HBM3, cc 9.0)" in info
    assert "capdispatch triton_u8 on cuda:0" in info
    r = _run("emu", launcher["record_emu"], 0, 0, env={"CAPDISPATCH_SGLANG_DEVICES": EMU_3080})
    assert "error" not in r, r
    assert r["state"]["device"]["name"] == "NVIDIA GeForce RTX 3080"
    assert_routes(r["state"], SM86_ROUTES)
    assert r["key"] == ["cpu", None]          # the device is simulated: its kernels on the CPU
    f = r["facts"]
    assert f["platform"] == {"is_sm90": True, "is_sm100": False, "is_sm120": False, "is_blackwell": False,
                             "device_sm": 90, "device_capability": [9, 0]}
    assert f["probes"]["is_sm90_supported"] is True and f["probes"]["get_device_sm"] == 90
    assert f["jit_arch"][:2] == [9, 0]
    e = r["report"]["emulated"]
    assert {k: e[k] for k in ("card", "name", "cc", "on", "device", "device_cc")} == {
        "card": "rtx-3080", "name": "NVIDIA GeForce RTX 3080", "cc": "8.6", "on": "sim:h100",
        "device": "NVIDIA H100 80GB HBM3", "device_cc": "9.0"}
    assert e["facts"] is None and "simulated" in e["note"]
    (line,) = [m for lv, m in r["logs"] if lv == "INFO" and "rank on" in m]
    assert "(emulated on sim:h100: NVIDIA H100 80GB HBM3, cc 9.0)" in line
    assert "SGLang's architecture facts: the NVIDIA H100 80GB HBM3's (the device that is there)" in line


def test_an_emulated_card_whose_sglang_sites_are_not_the_devices_is_refused_at_launch_and_rank(launcher):
    """An RTX 5090 on an H100: SGLang reaches its SM120 sites only when told SM120, which would
    run SGLang's own SM120 kernels on an SM90 card: one line, at launch and on the rank."""
    e = launcher["by_name"]["emu_refused"]["error"]
    assert e.startswith("Unsatisfiable: capdispatch: rank 0 (emu:rtx-5090@sim:h100): "), e
    assert "but SGLang on the NVIDIA H100 80GB HBM3 (cc 9.0) calls" in e and "\n" not in e
    r = _run("emu", launcher["record_emu"], 0, 0, env={"CAPDISPATCH_SGLANG_DEVICES": EMU_5090})
    assert r["error"].startswith("Unsatisfiable: capdispatch: rank 0 (emu:rtx-5090@sim:h100): "), r
    assert "emulate a card whose SGLang call sites are the device's" in r["error"]


def test_attention_routes_of_an_emulated_3080_run_at_the_sites_sglang_calls_on_the_device(launcher):
    """The emulated 3080's routes at SGLang's own call targets, as its DSv4 backend calls them
    with the H100's facts: capdispatch's Triton kernels (interpreter), the tolerances of
    test_attention_routes_on_an_sm86_rank_run_capdispatchs_kernels_at_sglangs_call_sites."""
    r = _run("attn", launcher["record_emu"], 0, 0, env={"CAPDISPATCH_SGLANG_DEVICES": EMU_3080,
                                                        "TRITON_INTERPRET": "1"})
    msg = f"seed {r['seed']} (KV_TEST_SEED replays)"
    assert_routes(r["state"], SM86_ROUTES)
    d, ix = r["decode"], r["indexer"]
    assert "error" not in d and d["routed"] and d["out_rel_err"] <= 1e-2, f"{msg}: {d}"
    assert d["lse"]["same_nonfinite"] and d["lse"]["max_abs"] <= 1e-3, f"{msg}: {d}"
    for legacy, c in r["prefill"].items():
        assert c["out_rel_err"] <= 1e-2, f"{msg} {legacy}: {c}"
    assert "error" not in ix and ix["routed"] and ix["max_abs_vs_reference"] <= 1e-4, f"{msg}: {ix}"
    assert (d["site"], ix["site"]) == ("flash_mla_with_kvcache", "fp8_paged_mqa_logits_torch")


def test_attention_routes_on_an_sm120_rank_for_an_explicit_choice(launcher):
    """cuda:0 (RTX 5090) with decode_mla and indexer chosen explicitly: SGLang's SM120
    entries (flash_mla_with_kvcache_sm120, fp8_paged_mqa_logits_torch_sm120) are the
    sites, and they run capdispatch's torch references. Same tolerances as above."""
    env = {"CAPDISPATCH_SGLANG_DEVICES": RIG, "CAPDISPATCH_SET": "decode_mla=torch,indexer=torch"}
    r = _run("attn", launcher["record"], 0, 0, env=env)
    msg = f"seed {r['seed']}"
    routes = r["state"]["routes"]
    assert routes["decode_mla"] == "decode_mla_torch"
    assert routes["indexer"] == "indexer_torch"
    assert routes["sparse_prefill"] is None and "prefill" not in r
    d, ix = r["decode"], r["indexer"]
    assert "error" not in d and "error" not in ix, f"{msg}: {d} {ix}"
    assert (d["site"], ix["site"]) == ("flash_mla_with_kvcache_sm120", "fp8_paged_mqa_logits_torch_sm120")
    assert d["routed"] and d["out_rel_err"] <= 1e-2 and d["lse"]["same_nonfinite"], f"{msg}: {d}"
    assert ix["routed"] and ix["max_abs_vs_reference"] == 0.0 and ix["masked_minus_inf"], f"{msg}: {ix}"
    assert ix["max_abs_vs_sglang_torch"] <= 3e-2, f"{msg}: {ix}"


def test_user_indexer_switch_keeps_sglangs_choice_and_says_it_cannot_run(launcher):
    """A user who set SGLang's TileLang switch chose SGLang's indexer: the rank keeps it,
    sets nothing, and warns where SGLang's default cannot run."""
    assert launcher["by_name"]["user_tilelang"]["stash"]["user_env"] == {"SGLANG_OPT_USE_TILELANG_INDEXER": "1"}
    r = _run("rank", launcher["record_user_tilelang"], 1, 1, env={"CAPDISPATCH_SGLANG_DEVICES": RIG,
                                                                   "SGLANG_OPT_USE_TILELANG_INDEXER": "1"})
    st = r["state"]
    assert st["routes"]["indexer"] is None and st["choices"]["indexer"]["routed"] is False
    assert st["choices"]["indexer"]["why"].startswith("the user set SGLANG_OPT_USE_TILELANG_INDEXER=1: "
                                                      "SGLang's own indexer choice kept")
    assert st["env"]["SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"] is None
    assert any(lv == "WARNING" and m.startswith("capdispatch: indexer on cuda:1: the user set") for lv, m in r["logs"])


def test_ranks_record_the_rehearsal_and_a_launch_can_require_it(ranks):
    """Each rank's report carries the rehearsal entry after agreement; with
    CAPDISPATCH_REQUIRE_REHEARSAL=1 a group without a passed rehearsal (here a simulated rig,
    which has no card to rehearse) stops on every rank, naming the setting and the command."""
    first = [r["agreements"][0]["rehearsal"] for r in ranks]
    assert first == [{"required": False, "found": False, "verdict": None}] * 3
    req = [r["agreements"][3] for r in ranks]
    assert len({a["error"] for a in req}) == 1
    err = req[0]["error"]
    assert err.startswith("CAPDISPATCH_REQUIRE_REHEARSAL=1: the group's cards are simulated")
    assert "`dispatch rehearse --device cuda:0,cuda:1,cuda:2 --model" in err and "--tp 3`" in err
    assert all(a["rehearsal"]["required"] and a["rehearsal"]["refused"] for a in req)
