"""The Python API: env read at decision time, no torch for simulated devices, bind."""
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

import capdispatch as cd

POL = os.path.join(os.path.dirname(__file__), "policies")


def _py(code: str, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("CAPDISPATCH_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=e, timeout=120)


def test_explaining_simulated_devices_never_imports_torch():
    p = _py("""
        import sys, json, io, contextlib
        import capdispatch as cd
        from capdispatch.dispatch.cli import main
        assert 'torch' not in sys.modules
        r = cd.resolve('kv_dequant', 'sim:rtx-3080', assume_libs=['triton'])
        g = cd.resolve_group('kv_quant', ['sim:rtx-5090', 'sim:rtx-3080'])
        with contextlib.redirect_stdout(io.StringIO()):
            main(['explain', '--device', 'sim:rtx-5090,sim:sm_86', '--format', 'json'])
            main(['devices', '--device', 'sim:h200'])
            main(['ops'])
        bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'flashinfer', 'sglang', 'pynvml'))
        print(json.dumps(bad))
    """)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == []


def test_import_reads_no_environment():
    # A bad CAPDISPATCH_SET must not break `import capdispatch`; it is read at decision time.
    p = _py("import capdispatch, capdispatch.dispatch, capdispatch.backends, capdispatch.policies",
            env={"CAPDISPATCH_SET": "nonsense", "CAPDISPATCH_POLICY": "/nonexistent.yaml"})
    assert p.returncode == 0, p.stderr


def test_env_set_after_import_takes_effect(clean_env):
    r = cd.resolve("kv_dequant", "sim:rtx-5090", assume_libs=["triton"])
    assert r.backend == "triton_fp8" and r.source.startswith("default.yaml:")
    clean_env.setenv("CAPDISPATCH_SET", "kv_dequant=torch")
    r = cd.resolve("kv_dequant", "sim:rtx-5090", assume_libs=["triton"])
    assert r.backend == "torch" and r.source == "CAPDISPATCH_SET"
    clean_env.delenv("CAPDISPATCH_SET")
    clean_env.setenv("CAPDISPATCH_POLICY", os.path.join(POL, "device_scoped.yaml"))
    r = cd.resolve("kv_quant", "sim:rtx-5090", assume_libs=["triton"])
    assert r.backend == "triton_u8" and "device_scoped.yaml:4" in r.source


def test_fallback_away_from_selection_logs_warning(clean_env, caplog):
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        r = cd.resolve("kv_quant", "sim:a10", selections={"kv_quant": "triton_fp8"},
                       assume_libs=["triton"])
    assert r.backend == "triton_u8" and r.downgraded_from == "triton_fp8" and r.fallback
    assert len(caplog.records) == 1
    msg = caplog.records[0].getMessage()
    assert "sim:a10" in msg and "kv_quant=triton_fp8" in msg and "running triton_u8" in msg
    with pytest.raises(cd.Unsatisfiable, match="fp8_e4m3"):
        cd.resolve("kv_quant", "sim:a10", selections={"kv_quant": "triton_fp8"},
                   assume_libs=["triton"], strict=True)


def test_default_layer_fallback_is_quiet(clean_env, caplog):
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        r = cd.resolve("kv_quant", "sim:rtx-3090", assume_libs=["triton"])
    assert r.backend == "triton_u8" and r.fallback and r.downgraded_from is None
    assert caplog.records == []


def test_every_check_is_evaluated(clean_env):
    # cpu without Triton's interpreter and with triton assumed too old: both reasons appear.
    r = cd.resolve("kv_dequant", "cpu", assume_libs=["triton==2.0"])
    fp8 = r.candidates[0]
    failing = {c.code for c in fp8.checks if not c.ok}
    assert {"library:triton", "triton_target", "feature:fp8_e4m3"} <= failing
    assert r.backend == "torch"


def test_no_backend_lists_every_candidate(clean_env):
    with pytest.raises(cd.NoBackendError) as ei:
        cd.resolve("kv_dequant", "sim:rtx-3080", assume_libs=["torch==2.0", "triton==1.0"])
    text = str(ei.value)
    for name in ("triton_fp8", "triton_u8", "torch"):
        assert f"  {name}:" in text
    assert "torch 2.0 is outside >=2.4" in text


def test_group_api_modes(clean_env):
    g = cd.resolve_group("kv_quant", ["sim:rtx-5090", "sim:rtx-3080"], assume_libs=["triton"])
    assert not g.uniform and g.mode == "warn" and len(g.warnings) == 1
    g = cd.resolve_group("kv_quant", ["sim:rtx-5090", "sim:rtx-3080"], assume_libs=["triton"],
                         policy=os.path.join(POL, "uniform.yaml"))
    assert g.uniform and {r.backend for r in g.per_device.values()} == {"triton_u8"}
    with pytest.raises(cd.Unsatisfiable, match="mixed_group is error"):
        cd.resolve_group("kv_quant", ["sim:rtx-5090", "sim:rtx-3080"], assume_libs=["triton"],
                         policy=os.path.join(POL, "error.yaml"))


def test_bind_returns_the_kernel_itself(clean_env):
    """The module-level function of the backend, named like its custom op, that calls the
    kernel function eagerly and its custom ops when traced (.functional, .with_out)."""
    import torch
    from capdispatch.backends.kv_cache import reference
    assert cd.bind("kv_dequant", "cpu") is reference.op_kv_dequant
    fn = cd.bind("kv_quant", "cpu", backend="torch")
    assert fn is reference.op_kv_quant and fn.__name__ == "kv_quant_torch"
    assert fn.functional is torch.ops.capdispatch.kv_quant_torch.default and fn.with_out is None
    assert reference.op_kv_dequant.functional is torch.ops.capdispatch.kv_dequant_torch.default
    assert reference.op_kv_dequant.with_out is torch.ops.capdispatch.kv_dequant_torch_out.default


def test_bind_without_checks(clean_env):
    """checks=False binds the same kernel's variant that skips argument validation."""
    from capdispatch.backends.kv_cache import reference
    from capdispatch.backends.torch_ops import without_checks
    fn = cd.bind("kv_dequant", "cpu", checks=False)
    assert fn is not reference.op_kv_dequant and fn.functional is reference.op_kv_dequant.functional
    assert fn is without_checks(reference.op_kv_dequant)
    q = cd.bind("kv_quant", "cpu", checks=False)
    assert q is without_checks(reference.op_kv_quant) and q is not reference.op_kv_quant
    assert q.functional is reference.op_kv_quant.functional


def test_bind_explicit_backend_that_cannot_run_raises(clean_env):
    with pytest.raises(cd.Unsatisfiable, match="TRITON_INTERPRET"):
        cd.bind("kv_dequant", "cpu", backend="triton_u8")


def test_bind_triton_on_cpu_under_interpreter(clean_env):
    clean_env.setenv("TRITON_INTERPRET", "1")
    fn = cd.bind("kv_dequant", "cpu", backend="triton_u8")
    assert fn.__name__ == "kv_dequant_triton_u8"


def test_op_handle_binds_per_device(clean_env):
    import torch
    from capdispatch.backends import v4_layout as layout
    from capdispatch.backends.kv_cache import reference
    h = cd.OpHandle("kv_dequant")
    pool = torch.randint(0, 255, (2, layout.bytes_per_page(4)), dtype=torch.uint8)
    out = h(pool, torch.tensor([0, 5]), 4)
    assert out.shape == (2, 1, 512)
    assert h._by_device == {("cpu", None): reference.op_kv_dequant}


def test_device_spec_roundtrip():
    spec = cd.probe("sim:rtx-pro-6000")
    assert spec.cc == (12, 0) and spec.sm_count == 188
    assert cd.DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


# --------------------------------------------------------------------------- one context, in-memory policies

def test_plan_in_uses_one_context_for_every_op(monkeypatch):
    import capdispatch as cd
    monkeypatch.delenv("CAPDISPATCH_SET", raising=False)
    ctx = cd.context(assume_libs=["sgl-flash-mla==0.9.0"], selections=["moe=torch"], selection_origin="--set")
    p = cd.plan_in(ctx, ["sim:h200"], ["decode_mla", "sparse_prefill", "moe"], log_warnings=False)
    per = {op: g.per_device["sim:h200"] for op, g in p.ops.items()}
    # The assumed (too old) FlashMLA reaches both FlashMLA ops; the selection reaches moe.
    assert per["decode_mla"].backend == "triton_fp8" and per["sparse_prefill"].backend == "triton"
    assert p.libraries["sgl-flash-mla"] == "0.9.0 (assumed)"
    assert (per["moe"].backend, per["moe"].layer, per["moe"].user, per["moe"].source) == (
        "torch", "selection", True, "--set")
    assert (per["decode_mla"].layer, per["decode_mla"].user) == ("default", False)
    # The same answer as plan() with the same inputs.
    q = cd.plan(["sim:h200"], ["decode_mla", "sparse_prefill", "moe"], assume_libs=["sgl-flash-mla==0.9.0"],
                selections=["moe=torch"], log_warnings=False)
    assert {op: g.per_device["sim:h200"].backend for op, g in q.ops.items()} == {
        op: r.backend for op, r in per.items()}


def test_policy_from_dict_is_a_checked_user_policy(tmp_path):
    import capdispatch as cd
    pol = cd.policy_from_dict({"ops": {"moe": ["marlin_w4a16"]},
                               "devices": [{"match": {"cc": ">=12.0,<13.0"}, "ops": {"moe": ["torch"]}}]},
                              "sglang --moe-runner-backend x")
    r = cd.resolve("moe", "sim:rtx-5090", policy=[pol], assume_libs=["sglang-kernel==0.4.10"])
    assert (r.backend, r.source, r.layer, r.user) == ("torch", "sglang --moe-runner-backend x (device cc "
                                                      ">=12.0,<13.0)", "device", True)
    r = cd.resolve("moe", "sim:h200", policy=[pol], assume_libs=["sglang-kernel==0.4.10"])
    assert (r.backend, r.source, r.layer) == ("marlin_w4a16", "sglang --moe-runner-backend x", "policy")
    # Checked as a file is, named by its origin (it has no lines).
    with pytest.raises(cd.PolicyError, match=r"^mine: unknown backend 'marlin' for op moe; did you mean "
                                             r"'marlin_w4a16'\?"):
        cd.policy_from_dict({"ops": {"moe": ["marlin"]}}, "mine")
    with pytest.raises(cd.PolicyError, match=r"^mine: unknown key 'opz'"):
        cd.policy_from_dict({"opz": {}}, "mine")
    with pytest.raises(cd.PolicyError, match=r"^mine: expected a mapping"):
        cd.policy_from_dict(["moe"], "mine")


def test_load_marked_keeps_lines_and_refuses_other_tags():
    from capdispatch.policies import PolicyError, load_marked
    d = load_marked("a:\n  b: [1, 2]\n  c:\n    - x\n    - {y: 1}\n", "f.yaml")
    assert d == {"a": {"b": [1, 2], "c": ["x", {"y": 1}]}}
    assert (d.line_of("a"), d["a"].line_of("c"), d["a"]["c"].line_of(1)) == (2, 4, 5)
    with pytest.raises(PolicyError, match=r"^f.yaml:2: .*key 'b' given twice \(first at line 1\)"):
        load_marked("b: 1\nb: 2\n", "f.yaml")
    with pytest.raises(PolicyError, match=r"^f.yaml:1: .*tag .* is not allowed"):
        load_marked("a: !!python/object:os.system x\n", "f.yaml")
