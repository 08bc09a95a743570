"""Every op and backend is a torch custom op (backends/torch_ops.py) that traces.

CPU: for each backend that runs here (torch references; Triton under its interpreter)
the op passes torch.library.opcheck (schema, fake tensor, aot dispatch with dynamic
shapes), its fake implementation gives eager's shapes, dtypes and strides,
torch._dynamo.explain finds 0 graph breaks, torch.compile(fullgraph=True) gives eager's
outputs bit for bit, and the bound call equals the kernel function called directly.
Backends of GPU-only libraries (FlashMLA, FlashInfer, DeepGEMM, TileLang, SGLang's
Marlin): schema, and their fake implementations traced under FakeTensorMode / make_fx.
GPU (marked gpu; run on an H200 on 2026-12-01, every backend whose library loaded there):
eager, CUDA graph, compile fullgraph and Inductor reduce-overhead with no CUDA-graph skip.
"""
from __future__ import annotations

import importlib
import os
import random
import sys
import types

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
from triton_env import HAS_CUDA, INTERPRET, _triton_interpreter  # noqa: E402,F401 (autouse fixture)

import op_cases  # noqa: E402

_interp = pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs TRITON_INTERPRET=1")

_B = "capdispatch.backends."


def _backend_rows():
    """From the registry: (op, backend, kernel module, bound attribute, needs the Triton
    interpreter) of every backend that runs on a CPU (it needs no library but torch and
    Triton), and (op, backend, module, attribute) of every other (a GPU library's)."""
    from capdispatch.backends import Library, Platform, build
    reg = build(plugins=False)
    cpu, external = [], []
    for op in reg.ops:
        for b in reg.backends(op):
            module, attr = b.impl.split(":")
            module = module.removeprefix(_B)
            libs = {r.dist for r in b.requires if isinstance(r, Library)}
            cuda_only = any(isinstance(r, Platform) and r.kind == "cuda" for r in b.requires)
            if libs <= {"torch", "triton"} and not cuda_only:
                cpu.append((op, b.name, module, attr, "triton" in libs))
            else:
                external.append((op, b.name, module, attr))
    return cpu, external


CPU_BACKENDS, EXTERNAL_BACKENDS = _backend_rows()


def _param(row):
    marks = [_interp] if row[4] else []
    return pytest.param(*row, id=f"{row[0]}-{row[1]}", marks=marks)


CPU_PARAMS = [_param(r) for r in CPU_BACKENDS]


def new_gen():
    seed = int(os.environ.get("CUSTOM_OPS_TEST_SEED") or random.SystemRandom().randrange(2**31))
    return torch.Generator().manual_seed(seed), seed


def kernel_module(name):
    """The kernel module, (re)imported so that its Triton kernels run under the interpreter."""
    mod = importlib.import_module(_B + name)
    if INTERPRET and getattr(mod, "INTERPRETED", True) is False:
        if name in ("decode_mla.triton_kernels", "sparse_prefill.triton_kernels"):
            importlib.reload(importlib.import_module(_B + "sparse_attention.kernels"))
        mod = importlib.reload(mod)
    return mod


def _map_tensors(args, kwargs, fn, leaves=torch.Tensor):
    """ARGS and KWARGS with FN applied to every tensor (LEAVES), inside MoeWeights too."""
    from capdispatch.backends.moe.weights import MoeWeights

    def m(a):
        if isinstance(a, leaves):
            return fn(a)
        if isinstance(a, MoeWeights):
            return MoeWeights.from_parts(*(m(t) for t in (a.w13, a.w13_scale, a.w2, a.w2_scale)), a.num_experts,
                                         a.hidden, a.intermediate, a.scale_max, a.swiglu_limit, a.layout, list(a.aux),
                                         [m(t) for t in a.aux.values()])
        return a
    return tuple(m(a) for a in args), {k: m(v) for k, v in kwargs.items()}


def clone_args(args, kwargs):
    return _map_tensors(args, kwargs, lambda t: t.clone())


def as_fake(mode, args, kwargs):
    return _map_tensors(args, kwargs, mode.from_tensor)


def _written(op) -> list:
    """Positions of the arguments OP's declaration says it writes (kv_quant's pool), not `out`."""
    from capdispatch.backends import builtin
    call = builtin().ops[op].call()
    return [i for i, p in enumerate(call.params) if p.type.startswith("Tensor(a!)") and p is not call.out]


def results(op, out, args):
    """The op's outputs as a tuple of tensors (an op that returns nothing: what it wrote)."""
    if out is None:
        return tuple(args[i] for i in _written(op))
    return out if isinstance(out, tuple) else (out,)


def assert_same(got, want, msg):
    assert len(got) == len(want), msg
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{msg}: {g.dtype}{tuple(g.shape)} vs {w.dtype}{tuple(w.shape)}"
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{msg}: {m}")


def poisoned(buf):
    if buf.dtype.is_floating_point:
        return buf.fill_(float("nan"))
    return buf.fill_(0x5A)


class _Calls(TorchDispatchMode):
    """Records the capdispatch custom-op calls a bound function makes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "capdispatch":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def op_calls(fn, args, kwargs):
    with _Calls() as rec:
        fn(*args, **kwargs)
    return rec.calls


# --------------------------------------------------------------------------- #
# Registration: names, schemas, lazy
# --------------------------------------------------------------------------- #
def test_import_capdispatch_defines_no_op_and_imports_no_torch():
    import subprocess
    code = ("import sys, capdispatch as cd; cd.resolve('kv_dequant', 'sim:h200'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


@pytest.mark.parametrize("op,backend,module,attr,interp", CPU_PARAMS)
def test_eager_calls_skip_the_dispatcher_traced_calls_use_the_op(op, backend, module, attr, interp):
    """Eagerly the bound function runs the kernel function (no capdispatch op reaches the
    dispatcher: the profiler records none); under a dispatch mode (what fake tensors,
    make_fx and export use) the call goes through its custom op."""
    fn = getattr(kernel_module(module), attr)
    gen, _ = new_gen()
    args, kwargs, _ = op_cases.case(op, gen)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args, **kwargs)
    names = {e.name for e in prof.events()}
    assert not [n for n in names if n.startswith("capdispatch::")], sorted(names)

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    args, kwargs, _ = op_cases.case(op, gen)
    with Record():
        fn(*args, **kwargs)
    assert f"capdispatch.{op}_{backend}.default" in seen, seen[:5]


@pytest.mark.parametrize("op,backend,module,attr,interp", CPU_PARAMS)
def test_names_and_declared_mutations(op, backend, module, attr, interp):
    fn = getattr(kernel_module(module), attr)
    ns = torch.ops.capdispatch
    assert fn.__name__ == f"{op}_{backend}"
    from capdispatch.backends import builtin
    call = builtin().ops[op].call()
    written = [call.params[i].name for i in _written(op)]
    assert fn.functional is getattr(ns, f"{op}_{backend}").default
    if call.out is None:
        assert fn.with_out is None
        ops = {fn.functional: written}
    else:
        assert fn.with_out is getattr(ns, f"{op}_{backend}_out").default
        ops = {fn.functional: written, fn.with_out: written + ["out"]}
    assert ops[fn.functional] == (["pool"] if op == "kv_quant" else [])     # the declaration says so
    for o, mutated in ops.items():
        writes = [a.name for a in o._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        assert writes == mutated, (o, writes)
        assert [a.name for a in o._schema.arguments if a.kwarg_only][-1] == "checks"


# --------------------------------------------------------------------------- #
# CPU backends: opcheck, fake tensors, dynamo, compile, eager equality
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("op,backend,module,attr,interp", CPU_PARAMS)
def test_opcheck(op, backend, module, attr, interp):
    gen, seed = new_gen()
    fn = getattr(kernel_module(module), attr)
    args, kwargs, out = op_cases.case(op, gen)
    variants = [{}] if out is None else [{}, {"out": out}]
    for extra in variants:
        calls = op_calls(fn, *clone_args(args, {**kwargs, **extra}))
        assert len(calls) == 1, calls
        func, cargs, ckwargs = calls[0]
        torch.library.opcheck(func, cargs, {**ckwargs, "checks": True})
        torch.library.opcheck(func, cargs, {**ckwargs, "checks": False},
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("op,backend,module,attr,interp", CPU_PARAMS)
def test_bound_equals_direct_and_fake_matches(op, backend, module, attr, interp):
    gen, seed = new_gen()
    mod = kernel_module(module)
    fn = getattr(mod, attr)
    raw = fn.kernel
    from capdispatch.backends.torch_ops import without_checks
    args, kwargs, out = op_cases.case(op, gen)
    a1, k1 = clone_args(args, kwargs)
    want = results(op, raw(*a1, **k1), a1)
    for bound in (fn, without_checks(fn)):
        a2, k2 = clone_args(args, kwargs)
        got = results(op, bound(*a2, **k2), a2)
        assert_same(got, want, f"{op}={backend} bound vs direct, seed={seed}")
        if out is not None:
            a3, k3 = clone_args(args, kwargs)
            buf = poisoned(out.clone())
            res = bound(*a3, **k3, out=buf)
            got = results(op, res, a3)
            assert got[0] is buf
            assert_same(got, want, f"{op}={backend} out= vs direct, seed={seed}")
    mode = FakeTensorMode()
    fa, fk = as_fake(mode, *clone_args(args, kwargs))
    with mode:
        fres = results(op, fn(*fa, **fk), fa)
    for f, w in zip(fres, want):
        assert (f.shape, f.dtype, f.stride()) == (w.shape, w.dtype, w.stride()), (op, backend)


@pytest.mark.parametrize("op,backend,module,attr,interp", CPU_PARAMS)
def test_dynamo_fullgraph_no_breaks_and_equal_outputs(op, backend, module, attr, interp):
    gen, seed = new_gen()
    fn = getattr(kernel_module(module), attr)
    args, kwargs, out = op_cases.case(op, gen)
    torch._dynamo.reset()
    a1, k1 = clone_args(args, kwargs)
    explained = torch._dynamo.explain(fn)(*a1, **k1)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    a2, k2 = clone_args(args, kwargs)
    want = results(op, fn(*a2, **k2), a2)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    a3, k3 = clone_args(args, kwargs)
    assert_same(results(op, compiled(*a3, **k3), a3), want, f"{op}={backend} compiled, seed={seed}")
    if out is not None:
        a4, k4 = clone_args(args, kwargs)
        buf = poisoned(out.clone())
        compiled(*a4, **k4, out=buf)
        assert_same((buf,), want[:1], f"{op}={backend} compiled out=, seed={seed}")
    torch._dynamo.reset()


def test_inductor_functionalises_the_pool_write_and_out():
    """Inductor (CPU) compiles kv_quant (declared pool mutation) followed by kv_dequant with
    out=: the pool and out are written as in eager, with 0 graph breaks."""
    from capdispatch.backends.kv_cache import reference as KV
    gen, seed = new_gen()
    (k, pool, loc, ps), _, _ = op_cases.case("kv_quant", gen)

    def step(k, pool, loc, out):
        KV.op_kv_quant(k, pool, loc, ps)
        return KV.op_kv_dequant(pool, loc, ps, out=out)

    want_pool = pool.clone()
    want = step(k, want_pool, loc, torch.empty((k.shape[0], 1, 512), dtype=torch.bfloat16))
    torch._dynamo.reset()
    got_pool, buf = pool.clone(), poisoned(torch.empty((k.shape[0], 1, 512), dtype=torch.bfloat16))
    got = torch.compile(step, fullgraph=True)(k, got_pool, loc, buf)
    assert got is buf or torch.equal(got, buf)
    assert torch.equal(got_pool, want_pool), f"seed={seed}"
    assert torch.equal(buf, want), f"seed={seed}"
    torch._dynamo.reset()


def test_checks_still_name_bad_input_through_the_op():
    from capdispatch.backends.kv_cache import reference as KV
    pool = KV.new_pool(2, 16)
    with pytest.raises(TypeError, match="token_ids must be int32 or int64, got torch.float32"):
        KV.op_kv_dequant(pool, torch.zeros(3), 16)


def test_triton_softmax_scale_is_fp32_in_the_kernel_signature():
    """Inductor passes Python floats to user Triton kernels as fp64; the kernels declare their
    float scalars fp32 so the online softmax's loop-carried values keep one type."""
    import inspect
    import triton.language as tl
    from capdispatch.backends.moe import triton_kernels as MK
    from capdispatch.backends.sparse_attention import kernels as SK
    for kernel, name in ((SK._sparse_mla_kernel, "qk_scale"), (MK._gemm1_swiglu_kernel, "limit")):
        sig = inspect.signature(getattr(kernel, "fn", kernel))
        assert sig.parameters[name].annotation in (tl.float32, "tl.float32"), (kernel, name)


def test_no_import_on_the_launch_path():
    """The Triton attention launch path imports nothing (dynamo cannot trace
    builtins.__import__, so an import there breaks the graph on every decode call)."""
    import inspect
    from capdispatch.backends.decode_mla import triton_kernels as DK
    from capdispatch.backends.sparse_attention import kernels as SK
    from capdispatch.backends.sparse_prefill import triton_kernels as PK
    for f in (SK.LaunchPlan, SK.launch_planned, SK._run_plan, SK.device_configs, PK.sparse_prefill, DK.DecodeMla,
              DK._pool_2d):
        src = inspect.getsource(f)
        assert "import" not in src and "__import__" not in src, f.__name__
    assert isinstance(SK.OUT_OF_RESOURCES, tuple) and SK.OUT_OF_RESOURCES


def test_serving_passes_aligned_index_lists_to_the_libraries_as_they_are(monkeypatch):
    """checks=False: an int32, contiguous, 64-aligned index list is not cleaned again (no
    launch inside the graph); with checks every list is cleaned."""
    from capdispatch.backends.decode_mla import library_args as ext
    idx = torch.randint(-1, 100, (2, 1, 128), dtype=torch.int32)
    calls = []
    monkeypatch.setattr(ext, "_clean_ids_fn", lambda: (lambda i, cap, align: calls.append((cap, align)) or i))
    assert ext.clean_ids(idx, 100, checks=False) is idx and calls == []
    ext.clean_ids(idx, 100, checks=True)
    ext.clean_ids(idx[..., :100], 100, checks=False)        # not 64-aligned: cleaned and padded
    assert calls == [(100, 64), (100, 64)]


# --------------------------------------------------------------------------- #
# GPU-only libraries: schema and fake implementations, on the CPU
# --------------------------------------------------------------------------- #
class _StandInDeepGEMM(types.ModuleType):
    """Importable stand-in for deep_gemm: the adapter module imports it at load time."""

    def __init__(self):
        super().__init__("deep_gemm")

    def __getattr__(self, name):
        raise AssertionError(f"deep_gemm.{name} must not run under fake tensors")


def _external(module, monkeypatch):
    if module == "indexer.deepgemm":
        monkeypatch.setitem(sys.modules, "deep_gemm", _StandInDeepGEMM())
        monkeypatch.delitem(sys.modules, _B + module, raising=False)   # restored afterwards
    if module == "indexer.tilelang_kernel":
        pytest.importorskip("tilelang")
    return importlib.import_module(_B + module)


@pytest.mark.parametrize("op,backend,module,attr", [pytest.param(*r, id=f"{r[0]}-{r[1]}") for r in EXTERNAL_BACKENDS])
def test_external_backend_fake_traces(op, backend, module, attr, monkeypatch):
    """The library is never called: FakeTensorMode and make_fx(fake) run only the fake
    implementation, whose shapes and dtypes must be the reference's."""
    from torch.fx.experimental.proxy_tensor import make_fx
    gen, seed = new_gen()
    fn = getattr(_external(module, monkeypatch), attr)
    assert fn.__name__ == f"{op}_{backend}"
    from capdispatch.backends import builtin
    ref_module, ref_attr = builtin().backend(op, builtin().ops[op].reference).impl.split(":")
    ref = getattr(kernel_module(ref_module.removeprefix(_B)), ref_attr)
    args, kwargs, out = op_cases.case(op, gen)
    want = results(op, ref(*clone_args(args, kwargs)[0], **kwargs), args)
    mode = FakeTensorMode()
    fa, fk = as_fake(mode, *clone_args(args, kwargs))
    with mode:
        got = results(op, fn(*fa, **fk), fa)
        fbuf = mode.from_tensor(out)
        got_out = results(op, fn(*fa, **fk, out=fbuf), fa)
    for g, w in zip(got, want):
        assert (g.shape, g.dtype) == (w.shape, w.dtype), (op, backend)
    assert got_out[0] is fbuf
    # An ATen-level trace (what AOTAutograd/Inductor see) holds the op as one node.
    tensors = []

    class Slot:
        def __init__(self, t):
            self.i = len(tensors)
            tensors.append(t)
    slots, kslots = _map_tensors(args, kwargs, Slot)

    def call(*ts):
        full, kfull = _map_tensors(slots, kslots, lambda slot: ts[slot.i], leaves=Slot)
        return fn(*full, **kfull)

    gm = make_fx(call, tracing_mode="fake")(*tensors)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert getattr(torch.ops.capdispatch, f"{op}_{backend}").default in targets


# --------------------------------------------------------------------------- #
# GPU matrix (H200): eager, CUDA graph, compile fullgraph, reduce-overhead
# --------------------------------------------------------------------------- #
ALL_BACKENDS = [(r[0], r[1]) for r in CPU_BACKENDS] + [(r[0], r[1]) for r in EXTERNAL_BACKENDS]


def _gpu_bound(op, backend):
    import capdispatch as cd
    try:
        return cd.bind(op, "cuda:0", backend=backend)
    except cd.Unsatisfiable as exc:
        pytest.skip(f"{op}={backend} does not run on this card: {exc}")


def _gpu_case(op, backend, gen):
    args, kwargs, out = op_cases.case(op, gen, "cuda")
    if op == "moe":
        from capdispatch.backends.moe import prepare
        prepare(args[1], backend)
    return args, kwargs, out


def _snap(op, res, args):
    return tuple(t.clone() for t in results(op, res, args))


# Library kernels that reduce with atomics may differ from run to run in the last bits.
_NONDETERMINISTIC = {("moe", "flashinfer_cutlass_w4a8"), ("moe", "flashinfer_trtllm_w4a8"),
                     ("moe", "flashinfer_cutlass_w4a16"), ("moe", "marlin_w4a16")}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("op,backend", ALL_BACKENDS, ids=[f"{o}-{b}" for o, b in ALL_BACKENDS])
@pytest.mark.parametrize("mode", ["cuda_graph", "compile_fullgraph", "reduce_overhead"])
@pytest.mark.parametrize("with_out", [False, True], ids=["functional", "out"])
def test_gpu_matrix(op, backend, mode, with_out):
    gen, seed = new_gen()
    fn = _gpu_bound(op, backend)
    args, kwargs, out = _gpu_case(op, backend, gen)
    if with_out and out is None:
        pytest.skip(f"{op} has no out= variant")
    extra = {"out": out} if with_out else {}
    a0, k0 = clone_args(args, {**kwargs, **extra})
    want = _snap(op, fn(*a0, **k0), a0)
    torch.cuda.synchronize()
    a1, k1 = clone_args(args, {**kwargs, **extra})
    if mode == "cuda_graph":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*a1, **k1)                                  # warm-up: compiles, allocates workspaces
        torch.cuda.current_stream().wait_stream(s)
        a1, k1 = clone_args(args, {**kwargs, **extra})
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            res = fn(*a1, **k1)
        g.replay()
        torch.cuda.synchronize()
        got = results(op, res, a1)
    else:
        from torch._dynamo.utils import counters
        torch._dynamo.reset()
        counters.clear()
        ea, ek = clone_args(args, {**kwargs, **extra})
        explained = torch._dynamo.explain(fn)(*ea, **ek)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        if mode == "reduce_overhead":
            # A mutated argument must be a static input for Inductor's CUDA graphs (as a
            # server's KV pool and output workspaces are): the declared mutation does the rest.
            for t in [a1[i] for i in _written(op)] + ([k1["out"]] if with_out else []):
                torch._dynamo.mark_static_address(t)
        compiled = torch.compile(fn, fullgraph=True,
                                 mode="reduce-overhead" if mode == "reduce_overhead" else None)
        for _ in range(3):                                # reduce-overhead records on the later calls
            res = compiled(*a1, **k1)                     # same arguments: writes are idempotent
        torch.cuda.synchronize()
        got = results(op, res, a1)
        if mode == "reduce_overhead":
            skips = dict(counters["inductor"])
            assert not skips.get("cudagraph_skips"), f"{op}={backend}: Inductor skipped CUDA graphs: {skips}"
        torch._dynamo.reset()
    msg = f"{op}={backend} {mode}, seed={seed}"
    if (op, backend) in _NONDETERMINISTIC:
        for g, w in zip(got, want):
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2, msg=lambda m: f"{msg}: {m}")
    else:
        assert_same(tuple(t.clone() for t in got), want, msg)
