"""The MoE route inside the real SGLang 0.5.23 (tests/sglang_moe_scenario.py, one
fresh process): on the simulated seed rig (RTX 5090, RTX 3080, RTX 3080; TP3,
EP3) SGLang's real FusedMoE, weight loader, process_weights_after_loading and
forward, per rank. Plus the plan's moe decisions, without SGLang's model code."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
RIG = "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080"
needs_sglang = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                  reason="needs SGLang (see tests/requirements-nodeps.txt and tests/requirements.txt)")


@pytest.fixture(scope="module")
def seed_rig(tmp_path_factory):
    sys.path.insert(0, HERE)
    import sglang_fake_models as fake
    # 12 routed experts (4 per rank under EP3), top-k 6: DSv4's k.
    model = fake.write(str(tmp_path_factory.mktemp("moe") / "dsv4"),
                       {**fake.DSV4, "n_routed_experts": 12, "num_experts_per_tok": 6})
    return _scenario(model, "default,explicit,strict", {"CAPDISPATCH_SGLANG_DEVICES": RIG, "TRITON_INTERPRET": "1"})


def _scenario(model_dir, modes, env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPDISPATCH_", "SGLANG_", "TRITON_"))}
    # Rank reports go to a scratch directory, never the user's cache.
    env["CAPDISPATCH_REPORT_DIR"] = os.path.join(tempfile.gettempdir(), "capdispatch-test-reports")
    env.update(env_extra)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sglang_moe_scenario.py"), model_dir, modes],
                          env=env, text=True, capture_output=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _warnings(r):
    return [m for lv, m in r["logs"] if lv == "WARNING" and "moe" in m]


@needs_sglang
def test_moe_route_names_exist_in_this_sglang(seed_rig):
    assert seed_rig["native_by_problems"] == []


@needs_sglang
def test_5090_rank_keeps_sglangs_flashinfer_method(seed_rig):
    """SGLang's own DSv4 default from device 0 (flashinfer_mxfp4) runs on the 5090:
    no route there, and SGLang's Mxfp4FlashinferCutlassMoEMethod is the layer's method."""
    mode = seed_rig["modes"]["default"]
    assert mode["launch_moe_runner_backend"] == "flashinfer_mxfp4"
    r0 = mode["ranks"][0]
    assert r0["device"] == "NVIDIA GeForce RTX 5090" and r0["platform_is_sm120"]
    assert r0["routed"] is False and r0["route"] is None and r0["backend"] == "flashinfer_cutlass_w4a8"
    assert r0["method"] == "Mxfp4FlashinferCutlassMoEMethod" and not r0["method_is_capdispatch"]
    assert "kept" in r0["why"] and not _warnings(r0)


@needs_sglang
@pytest.mark.parametrize("rank", [1, 2])
def test_3080_ranks_run_capdispatchs_method_against_the_reference(seed_rig, rank):
    """The 3080 ranks: SGLang would build Mxfp4FlashinferTrtllmMoEMethod (tcgen05 only);
    they get capdispatch's method bound to triton_w4a16 (under the interpreter), load the
    checkpoint through SGLang's weight loader (global -> local experts under EP), keep
    the E8M0 scales as bytes and the packed size per expert, and match the torch
    reference on the rank's experts with -1 for routes EP placed elsewhere.
    Tolerance (tests/test_moe.py, triton_w4a16): ||y-r||/||r|| <= 2e-3 and
    max|y-r| <= 1e-2 max|r|; the output buffer is NaN-poisoned and fully overwritten."""
    r = seed_rig["modes"]["default"]["ranks"][rank]
    msg = f"seed {seed_rig['seed']} (MOE_TEST_SEED replays)"
    assert r["device"] == "NVIDIA GeForce RTX 3080" and not r["platform_is_sm120"]
    assert r["routed"] and r["backend"] == "triton_w4a16", r["why"]
    assert r["route"] == "moe_triton_w4a16"
    assert "Mxfp4FlashinferTrtllmMoEMethod" in r["why"] and "tcgen05" in r["why"]
    assert r["method"] == "CapdispatchMxfp4MoEMethod" and r["moe_ep_rank"] == rank
    assert r["num_local_experts"] == 4 and r["fuses_routed_scaling_in_topk"]
    assert r["scale_dtype"] == "torch.float8_e8m0fnu"
    p = r["prepared"]
    assert p["backend"] == "triton_w4a16" and p["swiglu_limit"] == 10.0
    assert (p["num_experts"], p["hidden"], p["intermediate"]) == (4, 256, 128)
    packed = 3 * 256 * 128 // 2 + 3 * 256 * 128 // 32
    assert p["packed_bytes_per_expert"] == packed
    assert p["bytes_per_expert_before"] == p["bytes_per_expert_after"] == packed
    logged = [m for lv, m in r["logs"] if lv == "INFO" and "B per expert before preparation" in m]
    assert logged and f"{packed} B after" in logged[0]
    k = r["kernel"]
    assert k["same_buffer"] and k["all_written"], f"{msg}: {k}"
    assert k["ids_min"] == -1 and k["masked_routes"] == r["local_masked"] > 0, f"{msg}: {k}"
    assert r["shape"] == [5, 256] and r["ref_nonzero"], msg
    assert r["rel_err"] <= 2e-3 and r["max_abs_over_max_ref"] <= 1e-2, f"{msg}: {r['rel_err']}"
    assert not _warnings(r)


@needs_sglang
def test_explicit_user_value_downgraded_loudly_on_the_3080_ranks(seed_rig):
    mode = seed_rig["modes"]["explicit"]
    r0, r1, r2 = mode["ranks"]
    assert not r0["routed"] and r0["method"] == "Mxfp4FlashinferCutlassMoEMethod" and not _warnings(r0)
    for r, dev in ((r1, "cuda:1"), (r2, "cuda:2")):
        assert r["routed"] and r["method"] == "CapdispatchMxfp4MoEMethod"
        # One warning per rank: the flag is an explicit selection that cannot run there.
        (w,) = _warnings(r)
        assert dev in w and "NVIDIA GeForce RTX 3080" in w
        assert "was asked for (sglang --moe-runner-backend flashinfer_mxfp4) but cannot run" in w
        assert "running triton_w4a16 instead" in w
        # The rank's choice says which SGLang method could not run, and why.
        assert r["why"].startswith("the explicit choice flashinfer_cutlass_w4a8 cannot run there")
        assert "Mxfp4FlashinferTrtllmMoEMethod under moe_runner_backend=flashinfer_mxfp4 (set by the user" \
            in r["why"] and "tcgen05" in r["why"]


@needs_sglang
def test_explicit_user_value_refused_under_strict(seed_rig):
    r0, r1, r2 = seed_rig["modes"]["strict"]["ranks"]
    assert "error" not in r0 and not r0["routed"]
    for r, dev in ((r1, "cuda:1"), (r2, "cuda:2")):
        assert r["error"].startswith(f"StrictFallbackError: strict: {dev} (NVIDIA GeForce RTX 3080): "
                                     f"moe=flashinfer_cutlass_w4a8 was asked for (sglang --moe-runner-backend "
                                     f"flashinfer_mxfp4)"), r["error"]
        assert "would run triton_w4a16 instead" in r["error"]


# ------------------------------------------------------------------ the plan (no SGLang model code)

def _plan(*argv):
    from capdispatch.dispatch.cli import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["sglang", "plan", "--format", "json", *argv])
    return rc, json.loads(buf.getvalue())


@pytest.mark.parametrize("rig, want", [
    (RIG, [("flashinfer_cutlass_w4a8", False), ("triton_w4a16", True), ("triton_w4a16", True)]),
    ("sim:h200", [("flashinfer_cutlass_w4a16", False)]),
    # Device 0 an SM86 card: SGLang's DSv4 default stays `auto` (Fp8MoEMethod, no MXFP4
    # kernel), so even the 5090 is routed, to capdispatch's own FlashInfer adapter.
    ("sim:rtx-3080,sim:rtx-5090", [("triton_w4a16", True), ("flashinfer_cutlass_w4a8", True)]),
])
def test_plan_says_per_rank_whether_moe_is_kept_or_routed_and_why(rig, want):
    rc, out = _plan("--device", rig)
    assert rc == 0
    got = [(r["ops"]["moe"]["backend"], r["ops"]["moe"]["routed"]) for r in out["ranks"]]
    assert got == want
    for r in out["ranks"]:
        why = r["ops"]["moe"]["why"]
        assert "moe_runner_backend=" in why and ("kept" in why) != r["ops"]["moe"]["routed"], why


def test_plan_names_sglangs_default_from_device_0():
    _, out = _plan("--device", RIG)
    why = out["ranks"][1]["ops"]["moe"]["why"]
    assert "moe_runner_backend=flashinfer_mxfp4 (SGLang's DeepSeek-V4 default from device 0 (cuda:0" in why
    assert "Mxfp4FlashinferTrtllmMoEMethod" in why and "need tcgen05" in why
    assert not [w for w in out["warnings"] if "was set by the user" in w]


# ------------------------------------------------------------------ GPU (passed on an H200, 2026-12-01)

@needs_sglang
@pytest.mark.gpu
def test_routed_layer_at_dsv4_shapes_on_the_gpu(tmp_path):
    """SGLang's real FusedMoE on this machine's GPU 0 as rank 0 of an EP2 launch
    (64 local experts of 128, H 4096, I 2048, top-k 6; the other rank's experts
    arrive as -1), routed to triton_w4a16 by CAPDISPATCH_SET, loaded through SGLang's
    weight loader, prepared, and run for T in 1, 7, 64, 512 against the torch
    reference. Tolerances as tests/test_moe.py for triton_w4a16."""
    sys.path.insert(0, HERE)
    import sglang_fake_models as fake
    model = fake.write(str(tmp_path / "dsv4"), {**fake.DSV4, "n_routed_experts": 128, "num_experts_per_tok": 6,
                                                "hidden_size": 4096, "moe_intermediate_size": 2048})
    r = _scenario(model, "gpu", {"CAPDISPATCH_SET": "moe=triton_w4a16"})
    g = r["gpu"]
    msg = f"seed {r['seed']}"
    assert g["routed"] and g["backend"] == "triton_w4a16" and g["method_is_capdispatch"], g.get("why")
    assert g["route"] == "moe_triton_w4a16"
    assert g["num_local_experts"] == 64 and g["scale_dtype"] == "torch.float8_e8m0fnu"
    p = g["prepared"]
    assert p["packed_bytes_per_expert"] == 13_369_344
    assert p["bytes_per_expert_before"] == p["bytes_per_expert_after"] == 13_369_344
    for t, c in g["by_tokens"].items():
        assert c["shape"] == [int(t), 4096] and c["ref_nonzero"], f"{msg} T={t}"
        assert c["kernel"]["all_written"] and c["kernel"]["same_buffer"], f"{msg} T={t}: {c}"
        assert c["kernel"]["masked_routes"] == c["local_masked"], f"{msg} T={t}"
        assert c["rel_err"] <= 2e-3 and c["max_abs_over_max_ref"] <= 1e-2, f"{msg} T={t}: {c}"
    assert g["by_tokens"]["512"]["local_masked"] > 0      # EP2: about half the routes are the other rank's


# ------------------------------------------------------------------ the moe route's data and decisions

def _release():
    from capdispatch.adapters.sglang import knobs
    return knobs.load().releases[0]


def test_knob_map_moe_route_is_checked_with_the_place_of_the_mistake(tmp_path):
    from capdispatch.adapters.sglang import knobs
    text = open(knobs.DEFAULT_PATH, encoding="utf-8").read()
    cases = [("sm120: flashinfer_cutlass_w4a8, sm90:", "sm120: flashinfer_cutlas_w4a8, sm90:",
              "native_by.values.flashinfer_mxfp4.sm120: unknown backend 'flashinfer_cutlas_w4a8' for moe"),
             ("marlin: {sm90: marlin_w4a16,", "marlin: {hopper: marlin_w4a16,",
              "native_by.values.marlin: 'hopper' is not a device family"),
             ("            marlin: Mxfp4MarlinMoEMethod\n", "",
              "native_by.methods: expected one SGLang method name per value")]
    for old, new, message in cases:
        assert old in text, old
        p = tmp_path / "knobs.yaml"
        p.write_text(text.replace(old, new, 1))
        with pytest.raises(knobs.KnobsError) as err:
            knobs.load(str(p))
        assert message in str(err.value) and "releases[0].routes[" in str(err.value), str(err.value)


def test_launch_value_user_then_device_0():
    import capdispatch as cd
    from capdispatch.adapters.sglang import moe_plan
    rel = _release()
    sm86, sm120 = cd.probe("sim:rtx-3080"), cd.probe("sim:rtx-5090")
    v = moe_plan.launch_value(rel, [sm120, sm86])
    assert (v.value, v.user) == ("flashinfer_mxfp4", False) and "device 0 (sim:rtx-5090" in v.origin
    assert moe_plan.launch_value(rel, [sm86, sm120]).value == "auto"
    v = moe_plan.launch_value(rel, [sm120], explicit_fields={"moe_runner_backend"},
                              field_values={"moe_runner_backend": "marlin"})
    assert (v.value, v.user) == ("marlin", True)
    nb = moe_plan.route_of(rel).native_by
    assert nb.native("marlin", sm86) is None and nb.native("marlin", sm120) == "marlin_w4a16"
    assert nb.native("triton", sm120) is None and nb.method("flashinfer_mxfp4", sm86) == "Mxfp4FlashinferTrtllmMoEMethod"


def test_explicit_value_that_cannot_run_warns_per_device_or_refuses_under_strict():
    import capdispatch as cd
    from capdispatch.adapters.sglang import decide
    from capdispatch.adapters.sglang import gpus
    rel = _release()
    specs = gpus.devices([0, 1, 2], env={gpus.SIM_ENV: RIG})
    given = dict(explicit_fields={"moe_runner_backend"}, field_values={"moe_runner_backend": "flashinfer_mxfp4"})
    d = decide.decide(specs, ("moe",), rel, env={}, **given)
    row = d.choices["moe"]
    assert [c.routed for c in row.values()] == [False, True, True]
    # flashinfer_mxfp4 names a backend per family: an explicit selection, downgraded loudly
    # (once per card, by the resolver) where it cannot run.
    warns = [w for w in d.warnings if "was asked for (sglang --moe-runner-backend flashinfer_mxfp4)" in w]
    assert [w.split(" ", 1)[0] for w in warns] == ["cuda:1", "cuda:2"]
    assert all("running triton_w4a16 instead" in w for w in warns)
    assert not [w for w in d.warnings if "was set by the user" in w]      # not said twice
    with pytest.raises(cd.Unsatisfiable, match=r"strict: cuda:1 .*would run triton_w4a16"):
        decide.decide(specs, ("moe",), rel, env={"CAPDISPATCH_STRICT": "1"}, **given)
    # A value that names no capdispatch backend (Fp8MoEMethod: no MXFP4 kernel on any card):
    # every rank is routed, each says so at WARNING, and strict refuses on the first.
    given = dict(explicit_fields={"moe_runner_backend"}, field_values={"moe_runner_backend": "triton"})
    d = decide.decide(specs, ("moe",), rel, env={}, **given)
    assert [(c.routed, c.backend) for c in d.choices["moe"].values()] == [
        (True, "flashinfer_cutlass_w4a8"), (True, "triton_w4a16"), (True, "triton_w4a16")]
    warns = [w for w in d.warnings if "moe_runner_backend=triton was set by the user" in w]
    assert warns[0] == ("moe_runner_backend=triton was set by the user and is kept, but cuda:0 needs "
                        "moe_runner_backend=flashinfer_mxfp4")       # the SGLang-settings table's
    warns = warns[1:]
    assert [w.split(": ", 1)[0] for w in warns] == ["moe on cuda:0", "moe on cuda:1", "moe on cuda:2"]
    assert "SGLang's Fp8MoEMethod cannot run on this card" in warns[1] and "(NVIDIA GeForce RTX 3080; " in warns[1]
    assert "running capdispatch triton_w4a16 instead" in warns[1]
    with pytest.raises(cd.Unsatisfiable, match=r"strict: moe on cuda:0: .*would run capdispatch flashinfer_cutlass_w4a8"):
        decide.decide(specs, ("moe",), rel, env={"CAPDISPATCH_STRICT": "1"}, **given)
    # Not the user's value (SGLang's own default): routed, and no warning.
    d = decide.decide(specs, ("moe",), rel, env={})
    assert [c.routed for c in d.choices["moe"].values()] == [False, True, True]
    assert not [w for w in d.warnings if "was set by the user" in w]
