"""The launch path's host side: benchmarks/profile_host_path.py on the CPU, the launch plans'
keys, and the device scope of a launch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The kernel modules import triton: on the CPU its jitted helpers are built in the mode of
# its first import, so that import happens under the interpreter, as in the kernel tests.
from triton_env import _triton_interpreter  # noqa: E402,F401 (autouse fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def test_profile_host_path_runs_every_backend_with_launches_recorded(tmp_path):
    """The harness on the CPU (interpreted kernels, launches recorded, nothing run): one
    row per case with positive timings, the launches a GPU host makes (the split decode:
    the split kernel and the combine), the checked and the serving call launching the
    same work, and each pointer argument named by the input it points into."""
    js = tmp_path / "host.json"
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    cases = ["kv_dequant/triton_u8", "kv_quant/triton_fp8", "decode_mla/triton+split", "indexer/triton",
             "moe/triton_w4a16", "sparse_prefill/triton"]
    cmd = [sys.executable, os.path.join(BENCH, "profile_host_path.py"), "--iters", "2", "--repeats", "1",
           "--json", str(js)]
    for c in cases:
        cmd += ["--case", c]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    data = json.loads(js.read_text())
    rows = {row["case"]: row for row in data["rows"]}
    assert set(rows) == set(cases)
    for row in rows.values():
        assert row["same_launch_checked"], row["case"]
        assert row["bound_us"] > 0 and row["serving_us"] > 0 and row["launch_us"] > 0, row
        assert 0 < row["serving_calls"] < row["bound_calls"], row       # the checks are calls too
    assert rows["decode_mla/triton+split"]["launches"] == ["_sparse_mla_kernel", "_combine_kernel"]
    # One token: its routes are the GEMMs' blocks, with no routing launch.
    assert rows["moe/triton_w4a16"]["launches"] == ["_gemm1_swiglu_kernel", "_gemm2_kernel", "_combine_kernel"]
    (name, _, args), = data["signatures"]["kv_dequant/triton_u8"]
    assert name == "_kv_dequant_kernel"
    assert args["pool_ptr"] == ["tensor", "torch.uint8", "in", 0, 0]          # the pool itself, as uint8
    assert args["out_ptr"][:3] == ["tensor", "torch.bfloat16", "new"]         # the output it allocated
    assert args["n_tokens"] == "1" and args["NATIVE_FP8"] == "False"
    (_, _, fp8), = data["signatures"]["kv_quant/triton_fp8"]
    assert fp8["pool_ptr"] == ["tensor", "torch.float8_e4m3fn", "in", 1, 0]   # the same bytes, as fp8


def test_decode_plans_are_keyed_by_device_and_shape(monkeypatch):
    """A decode launch plan is kept per (device, shape class) by the backend callable that
    made it: another shape gets its own plan, and a plan never serves another device."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import importlib
    from capdispatch.backends.sparse_attention import kernels as K
    if not K.INTERPRETED:
        importlib.reload(K)
    from capdispatch.backends.decode_mla import triton_kernels as D
    if not D.INTERPRETED:
        D = importlib.reload(D)
    from capdispatch.backends.kv_cache import reference as KV
    from triton.runtime.interpreter import InterpretedFunction
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, grid, warmup, **kw: None)
    fn = D.DecodeMla(native_fp8=False)
    pool = KV.new_pool(2, 64, "cpu")
    for h in (16, 32):
        q = torch.randn(1, 1, h, 512).bfloat16()
        idx = torch.randint(0, 128, (1, 1, 32), dtype=torch.int32)
        fn(q, pool, idx, 64, 0.05, checks=False)
        fn(q, pool, idx, 64, 0.05)
    assert len(fn.plans) == 2
    assert {k[0] for k in fn.plans} == {torch.device("cpu")}
    assert {k[3] for k in fn.plans} == {16, 32}
    assert not D.decode_mla_u8.plans or all(k[0].type == "cpu" for k in D.decode_mla_u8.plans)


class _FakeCudaTensor:
    """What on_device_of reads of a tensor: is_cuda and the device index."""
    is_cuda = True

    def __init__(self, index):
        self.index = index

    def get_device(self):
        return self.index


def test_on_device_of_switches_only_to_another_card(monkeypatch):
    """No scope for CPU tensors and for the current CUDA device (read without building a
    torch.device); torch.cuda.device(index) for a tensor on another card."""
    from capdispatch.backends import device_scope as S
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    entered = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: entered.append(index) or "scope")
    assert S.on_device_of(torch.empty(1)) is S._NO_SCOPE
    assert S.on_device_of(_FakeCudaTensor(1)) is S._NO_SCOPE
    assert entered == []
    assert S.on_device_of(_FakeCudaTensor(0)) == "scope" and entered == [0]


@pytest.mark.parametrize("module", ["kv_cache.triton_kernels", "indexer.triton_kernels", "moe.triton_kernels",
                                    "decode_mla.triton_kernels", "sparse_prefill.triton_kernels"])
def test_launch_paths_build_no_torch_device(module):
    """The Triton launch paths scope launches with on_device_of (a tensor), not
    on_device(torch.device): reading ``.device.type`` costs more than the index test."""
    import inspect
    import importlib
    src = inspect.getsource(importlib.import_module("capdispatch.backends." + module))
    assert "on_device_of(" in src and "on_device(" not in src, module


def _interpreted(monkeypatch, name):
    """The kernel module NAME built for the interpreter, its launches made no-ops."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import importlib
    if name.startswith(("sparse_prefill.", "decode_mla.")):     # their kernel: the shared one
        shared = importlib.import_module("capdispatch.backends.sparse_attention.kernels")
        if not shared.INTERPRETED:
            importlib.reload(shared)
    mod = importlib.import_module("capdispatch.backends." + name)
    if not mod.INTERPRETED:
        mod = importlib.reload(mod)
    from triton.runtime.interpreter import InterpretedFunction
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, grid, warmup, **kw: None)
    return mod


def test_plans_do_not_grow_with_context_length_or_prefill_length(monkeypatch):
    """The indexer's plan is not keyed by max_context_len (it grows every decode step),
    nor sparse_prefill's by the number of queries: one plan each for many lengths."""
    I = _interpreted(monkeypatch, "indexer.triton_kernels")
    from capdispatch.backends.indexer import layout as L
    I._plans.clear()
    kv = torch.zeros(4, L.PAGE_BYTES, dtype=torch.uint8)
    q = torch.zeros(1, 1, 64, 128, dtype=torch.uint8)
    w, bt = torch.rand(1, 64), torch.arange(4, dtype=torch.int32).view(1, 4)
    for S in (1, 63, 64, 200, 256):
        I.fp8_paged_mqa_logits_u8(q, kv, w, torch.tensor([S], dtype=torch.int32), bt, None, S, checks=False)
    assert len(I._plans) == 1
    K = _interpreted(monkeypatch, "sparse_prefill.triton_kernels")
    K.forget_plans()
    kvr = torch.randn(64, 1, 512).bfloat16()
    for s in (1, 7, 300):
        K.sparse_prefill(torch.randn(s, 16, 512).bfloat16(), kvr, torch.randint(0, 64, (s, 1, 32), dtype=torch.int32),
                         0.05, checks=False)
    assert len(K._plans) == 1
