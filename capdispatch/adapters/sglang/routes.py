"""Routing SGLang's DeepSeek-V4 call sites (KV cache, decode, sparse prefill,
indexer) to bound capdispatch kernels.

A rank installs a route only where its card needs one (SGLang's own kernel
cannot run there, or the decision for some sizes is a capdispatch backend),
through SGLang's HookRegistry, which also rebinds `from ... import` copies. The
wrapper takes the kernel for the tensor's device: a route never answers for another
device, and anything it does not cover (another layout, another store type)
goes to SGLang's own function unchanged.

The kernel is the rank's decision in served form (rank.kernel_for): bound without
argument checks, with the policy's size buckets (a size dispatcher). Sizes whose
bucket SGLang's own kernel wins are None entries of the dispatcher, and the wrapper
calls SGLang's function for them (`_pick`); inside a CUDA graph the size is static,
so which one runs is fixed at capture. The decode and indexer wrappers hand SGLang's
per-batch schedule (`tile_scheduler_metadata`, `deep_gemm_metadata`) to the kernel:
a backend that has a per-batch schedule of that library uses SGLang's, the others
ignore it.
"""
from __future__ import annotations

import logging
import importlib
from importlib.metadata import packages_distributions

import capdispatch as cd
from capdispatch import extend

log = logging.getLogger("capdispatch.sglang")

_KERNELS: dict = {}       # op -> {(device type, device index): kernel}
_BACKENDS: dict = {}      # op -> {(device type, device index): the decided backend the kernel is}
_INSTALLED: set = set()   # targets this process has hooked
_ENV_SAVED: dict = {}     # target -> {name: value before the route switched it (None: unset)}
_SAID: set = set()        # targets whose "cannot be hooked here" line this process logged


def _key(t):
    d = t.device
    return (d.type, d.index)


def _pick(fn, n: int):
    """FN for a problem of N (the op's size: the leading dimension of its size argument);
    None where a size dispatcher keeps SGLang's own call for N."""
    if fn is None or not getattr(fn, "keeps", False):
        return fn
    return fn.pick(n)


def _v4(layout) -> bool:
    # KVLayout is a str enum: KVLayout.V4 == "v4".
    return layout is None or layout == "v4" or (isinstance(layout, str) and layout.lower() == "v4")


def dequant_v4(original, quant_k_cache, page_table_1_flattened, page_size, out=None, layout=None):
    """AROUND dequantize_k_cache_paged_dsv4(quant_k_cache, page_table_1_flattened,
    page_size, out=None, layout=KVLayout.V4) -> bf16 [n, 1, 512]."""
    fn = _KERNELS.get("kv_dequant", {}).get(_key(quant_k_cache)) if _v4(layout) else None
    fn = _pick(fn, page_table_1_flattened.shape[0])
    if fn is None:
        kw = {} if layout is None else {"layout": layout}
        return original(quant_k_cache, page_table_1_flattened, page_size, out=out, **kw)
    return fn(quant_k_cache, page_table_1_flattened, page_size, out=out)


def dequant_v4_nolayout(original, quant_k_cache, page_table_1_flattened, page_size, out=None):
    """AROUND 0.5.17's dequantize_k_cache_paged(quant_k_cache, page_table_1_flattened,
    page_size, out=None) -> bf16 [n, 1, 512]: the V4 layout only."""
    fn = _pick(_KERNELS.get("kv_dequant", {}).get(_key(quant_k_cache)), page_table_1_flattened.shape[0])
    if fn is None:
        return original(quant_k_cache, page_table_1_flattened, page_size, out=out)
    return fn(quant_k_cache, page_table_1_flattened, page_size, out=out)


def store_v4_nolayout(original, input, cache, indices, *, page_size, type):  # noqa: A002
    """AROUND 0.5.17's fused_store_cache(input, cache, indices, *, page_size, type):
    only the main ("flashmla") V4 store."""
    fn = _pick(_KERNELS.get("kv_quant", {}).get(_key(cache)), input.shape[0]) if type == "flashmla" else None
    if fn is None:
        return original(input, cache, indices, page_size=page_size, type=type)
    fn(input, cache, indices, page_size)
    return None


def store_v4(original, input, cache, indices, *, page_size, type, layout=None, freqs_cis=None):  # noqa: A002
    """AROUND fused_store_cache(input, cache, indices, *, page_size, type,
    layout=KVLayout.V4, freqs_cis=None): only the main ("flashmla") V4 store."""
    fn = None
    if type == "flashmla" and freqs_cis is None and _v4(layout):
        fn = _pick(_KERNELS.get("kv_quant", {}).get(_key(cache)), input.shape[0])
    if fn is None:
        kw = {} if layout is None else {"layout": layout}
        return original(input, cache, indices, page_size=page_size, type=type, freqs_cis=freqs_cis, **kw)
    fn(input, cache, indices, page_size)
    return None


# Each wrapper keeps the parameter names and order of the SGLang function its route
# targets in its release (check_knob_names in tests/sglang_scenarios.py compares them
# with each release's source), so positional and keyword calls bind the same way with
# no per-call inspection.
V4_TOKEN_BYTES = extend.v4_layout.TOKEN_BYTES      # FlashMLA tells cache formats apart by this last dim


def _v4_view(cache) -> bool:
    return cache is None or (cache.dim() == 4 and cache.shape[2] == 1 and cache.shape[3] == V4_TOKEN_BYTES)


def _decode_kernel(q, k_cache, block_table, head_dim_v, causal, descale_q, descale_k, is_fp8_kvcache, indices,
                   extra_k_cache):
    """The bound decode kernel for a call it covers (the sparse fp8 V4 one: indices,
    584-byte views, d_v 512, no block table, no descale), else None."""
    fn = _pick(_KERNELS.get("decode_mla", {}).get(_key(q)), q.shape[0])
    if (fn is None or indices is None or not is_fp8_kvcache or head_dim_v != 512 or block_table is not None
            or descale_q is not None or descale_k is not None or causal
            or q.shape[-1] != 512 or not _v4_view(k_cache) or not _v4_view(extra_k_cache)):
        return None
    return fn


def mla_decode(original, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
               num_splits=None, softmax_scale=None, causal=False, descale_q=None, descale_k=None,
               is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
               extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None, kv_format=None,
               *, use_legacy=True):
    """AROUND flash_mla_interface.flash_mla_with_kvcache (DSv4 decode and dense
    extend on every card but SM120) -> (out [b,s_q,h,512], lse). Covered: the
    sparse fp8 V4 call (indices, 584-byte views, d_v 512, no block table, no
    descale); SGLang reads only `out`. The rest goes to FlashMLA unchanged, and so
    do the sizes whose bucket FlashMLA wins. SGLang's schedule (a FlashMLASchedMeta,
    one per batch) reaches a FlashMLA-based kernel through capdispatch.given."""
    fn = _decode_kernel(q, k_cache, block_table, head_dim_v, causal, descale_q, descale_k, is_fp8_kvcache,
                        indices, extra_k_cache) if kv_format is None else None
    if fn is None:
        return original(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                        num_splits, softmax_scale, causal, descale_q, descale_k, is_fp8_kvcache, indices,
                        attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                        extra_topk_length, kv_format, use_legacy=use_legacy)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    with cd.given("flashmla_decode", tile_scheduler_metadata):
        return fn(q, k_cache, indices, k_cache.shape[1], scale, topk_length, attn_sink, extra_k_cache,
                  extra_indices_in_kvcache, None if extra_k_cache is None else extra_k_cache.shape[1],
                  extra_topk_length)


def mla_decode_sgl_kernel(original, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                          num_splits=None, softmax_scale=None, causal=False, descale_q=None, descale_k=None,
                          is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
                          extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
    """AROUND sgl_kernel.flash_mla.flash_mla_with_kvcache (sglang-kernel 0.4.5; SGLang
    0.5.17's DSv4 decode on every card but SM120) -> (out, lse), covering what
    mla_decode covers. SGLang's schedule is sgl_kernel's own FlashMLASchedMeta, not
    sgl-flash-mla's, so it is not handed on: a FlashMLA-based kernel makes its own."""
    fn = _decode_kernel(q, k_cache, block_table, head_dim_v, causal, descale_q, descale_k, is_fp8_kvcache,
                        indices, extra_k_cache)
    if fn is None:
        return original(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                        num_splits, softmax_scale, causal, descale_q, descale_k, is_fp8_kvcache, indices,
                        attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return fn(q, k_cache, indices, k_cache.shape[1], scale, topk_length, attn_sink, extra_k_cache,
              extra_indices_in_kvcache, None if extra_k_cache is None else extra_k_cache.shape[1],
              extra_topk_length)


def mla_decode_sm120(original, **kwargs):
    """AROUND flash_mla_sm120.flash_mla_with_kvcache_sm120(**kwargs) (SM120 decode
    and extends) -> (out, lse); SGLang reads only `out`. A schedule SGLang passes
    (`tile_scheduler_metadata`) is handed on as in mla_decode."""
    q, k_cache = kwargs["q"], kwargs["k_cache"]
    extra = kwargs.get("extra_k_cache")
    fn = _pick(_KERNELS.get("decode_mla", {}).get(_key(q)), q.shape[0])
    if fn is None or kwargs.get("head_dim_v") != 512 or q.shape[-1] != 512 or not _v4_view(k_cache) \
            or not _v4_view(extra) or kwargs.get("indices") is None:
        return original(**kwargs)
    scale = kwargs.get("softmax_scale")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    with cd.given("flashmla_decode", kwargs.get("tile_scheduler_metadata")):
        return fn(q, k_cache, kwargs["indices"], k_cache.shape[1], scale, kwargs.get("topk_length"),
                  kwargs.get("attn_sink"), extra, kwargs.get("extra_indices_in_kvcache"),
                  None if extra is None else extra.shape[1], kwargs.get("extra_topk_length"))


def mla_sparse_prefill(original, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                       *, use_legacy=True):
    """AROUND flash_mla_interface.flash_mla_sparse_fwd -> (out, max_logits, lse),
    base-2 statistics under use_legacy as FlashMLA's legacy kernel returns them."""
    fn = _pick(_KERNELS.get("sparse_prefill", {}).get(_key(q)), q.shape[0])
    if fn is None or d_v != 512 or q.shape[-1] != 512:
        return original(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, use_legacy=use_legacy)
    return fn(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, use_legacy=use_legacy)


def mla_sparse_prefill_sgl_kernel(original, q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """AROUND sgl_kernel.flash_mla.flash_mla_sparse_fwd (sglang-kernel 0.4.5) -> (out,
    max_logits, lse); its lse is always base-2, as FlashMLA's legacy kernel returns it."""
    fn = _pick(_KERNELS.get("sparse_prefill", {}).get(_key(q)), q.shape[0])
    if fn is None or d_v != 512 or q.shape[-1] != 512:
        return original(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    return fn(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, use_legacy=True)


def indexer_logits(original, q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata,
                   max_seq_len, clean_logits=True):
    """AROUND dsv4/indexer.py's fp8_paged_mqa_logits_torch[_sm120] (which the routing
    rank makes SGLang call) -> fp32 logits [rows, max_seq_len]; positions past a
    row's length are -inf, which SGLang's top-k ignores (it masks by length).
    DeepGEMM's schedule, where SGLang made one (`deep_gemm_metadata`; None under the
    torch switch, unless SGLang forces it), is the op's `schedule_metadata`: the
    deepgemm backend runs on it, the others ignore it."""
    fn = _pick(_KERNELS.get("indexer", {}).get(_key(q_fp8)), q_fp8.shape[0])
    if fn is None:
        return original(q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata,
                        max_seq_len, clean_logits)
    return fn(q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata, max_seq_len, clean_logits)


def moe_quant_method(original, self, layer, prefix):
    """AROUND Fp8Config.get_quant_method(self, layer, prefix) -> the layer's quant
    method. Where this process's device (the one the layer's parameters are being
    created on) routes moe, an MXFP4 expert layer gets capdispatch's method bound to
    that device's kernel (moe_method.py); everything else gets SGLang's own choice."""
    from .moe_method import make, new_tensor_key
    key = new_tensor_key()
    fn = _KERNELS.get("moe", {}).get(key)
    method = None if fn is None else make(self, layer, prefix, fn, key, _BACKENDS["moe"][key])
    return original(self, layer, prefix) if method is None else method


CALLS = {"dequant_v4": dequant_v4, "store_v4": store_v4, "mla_decode": mla_decode,
         "mla_decode_sm120": mla_decode_sm120, "mla_sparse_prefill": mla_sparse_prefill,
         "indexer_logits": indexer_logits, "moe_quant_method": moe_quant_method,
         # SGLang 0.5.17's signatures (its knob-map entry names them)
         "dequant_v4_nolayout": dequant_v4_nolayout, "store_v4_nolayout": store_v4_nolayout,
         "mla_decode_sgl_kernel": mla_decode_sgl_kernel,
         "mla_sparse_prefill_sgl_kernel": mla_sparse_prefill_sgl_kernel}


def kernel(op: str, device_key):
    return _KERNELS.get(op, {}).get(device_key)


class Unresolved(Exception):
    """A route's target does not exist in this process (its module fails to import, or
    lacks the name): `reason` says which, why, and what to install."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _walk(target: str):
    """TARGET ("pkg.module.Class.attr") imported and looked up as SGLang's HookRegistry
    does, but raising the import's own error (HookRegistry's resolution turns a module
    that fails to import into "has no attribute")."""
    parts = target.split(".")
    obj = importlib.import_module(parts[0])
    name = parts[0]
    for part in parts[1:]:
        name = f"{name}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if not isinstance(obj, type(importlib)):
            raise AttributeError(f"{type(obj).__name__} {name.rsplit('.', 1)[0]!r} has no attribute {part!r}")
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            raise AttributeError(f"module {obj.__name__!r} has no attribute or submodule {part!r}") from None
    return obj


def _failing_module(exc):
    """The first module outside SGLang and the import machinery in EXC's traceback:
    the library whose import failed (e.g. flash_mla, when its CUDA extension cannot load)."""
    tb = exc.__traceback__
    while tb is not None:
        name = str(tb.tb_frame.f_globals.get("__name__", ""))
        top = name.split(".")[0]
        if top and top not in ("sglang", "importlib", "capdispatch", "builtins"):
            return name
        tb = tb.tb_next
    return None


def _distribution(module: str):
    """The distribution that installs MODULE: the libraries capdispatch's backends declare
    (flash_mla -> sgl-flash-mla), else what is installed here; None when unknown."""

    from packaging.utils import canonicalize_name

    import capdispatch as cd
    from capdispatch import extend
    top = module.split(".")[0]
    reg = extend.registry.builtin()
    for op in reg.ops:
        for b in reg.backends(op):
            for r in b.requires:
                mod = getattr(r, "module", None)
                if getattr(r, "dist", None) and mod and canonicalize_name(mod.split(".")[0]) == canonicalize_name(top):
                    return r.dist
    found = packages_distributions().get(top)
    return found[0] if found else None


def _what_to_do(target: str, exc) -> str:
    own = target.split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and exc.name and exc.name.split(".")[0] != own:
        dist = _distribution(exc.name)
        return (f"install {dist} (SGLang's module imports {exc.name})" if dist
                else f"install the package that provides the module {exc.name}")
    if isinstance(exc, (ModuleNotFoundError, AttributeError)):
        return "this SGLang has no such function: use the SGLang release the knob map names"
    module = _failing_module(exc)
    dist = _distribution(module) if module else None
    if dist:
        return f"{dist} is installed but fails to import here: reinstall it for this torch and CUDA"
    return "fix the import error above (a library SGLang's module needs fails to load)"


def resolve(target: str) -> None:
    """Raise Unresolved when TARGET cannot be hooked in this process."""
    try:
        _walk(target)
    except Exception as exc:  # any import failure of SGLang's module means: no route here
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise Unresolved(f"{target} cannot be imported here ({type(exc).__name__}: {first}); "
                         f"{_what_to_do(target, exc)}") from None


def install(route, kernel_fn, device_key, backend=None):
    """Route ROUTE's call site to KERNEL_FN, the decided capdispatch BACKEND bound (for a
    size dispatcher: its catch-all bucket's backend), for tensors on DEVICE_KEY. Returns None once routed, else why the route did not take effect
    (said in one WARNING per target and process)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType
    what = f"{route.op}" + (f" (capdispatch {backend})" if backend else "")
    if route.target not in _INSTALLED:
        if route.target in getattr(HookRegistry, "_patched", ()):
            log.warning("capdispatch: %s was already hooked by another plugin; capdispatch cannot "
                        "route %s there, so SGLang's own kernel (or the other plugin's) runs",
                        route.target, what)
            return f"{route.target} was already hooked by another plugin"
        try:
            resolve(route.target)
        except Unresolved as exc:
            # Checked before registering, so SGLang's registry never tries (and logs) it.
            if route.target not in _SAID:
                _SAID.add(route.target)
                log.warning("capdispatch: %s is NOT routed on %s: %s", what, _where(device_key), exc.reason)
            return exc.reason
        HookRegistry.register(route.target, CALLS[route.call], HookType.AROUND,
                              source=HookSource("capdispatch", "capdispatch"))
        HookRegistry.apply_hooks()
        if route.target not in HookRegistry._patched:
            # SGLang logged why; nothing changed. Take the hook back so later
            # apply_hooks() calls do not retry it.
            mine = CALLS[route.call]
            HookRegistry._hooks[route.target] = [h for h in HookRegistry._hooks[route.target]
                                                 if h[1] is not mine]
            log.warning("capdispatch: could not hook %s (see SGLang's error above); %s on %s stays "
                        "with SGLang's own kernel", route.target, what, _where(device_key))
            return f"SGLang could not hook {route.target}"
        _INSTALLED.add(route.target)
    _KERNELS.setdefault(route.op, {})[device_key] = kernel_fn
    _BACKENDS.setdefault(route.op, {})[device_key] = backend
    return None


def _where(device_key) -> str:
    kind, index = device_key
    return kind if index is None else f"{kind}:{index}"


def switch_env(route, environ) -> list:
    """Set ROUTE's switches in ENVIRON (the rank's own process environment), keeping
    what was there to restore. Returns the "NAME=value" it changed."""
    saved = _ENV_SAVED.setdefault(route.target, {})
    changed = []
    for name, value in route.env:
        if environ.get(name) != value:
            saved.setdefault(name, environ.get(name))
            environ[name] = value
            changed.append(f"{name}={value}")
    return changed


def restore_env(route, environ) -> list:
    """Undo switch_env for ROUTE (the rank no longer routes it). Returns the names restored."""
    saved = _ENV_SAVED.pop(route.target, {})
    for name, value in saved.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value
    return list(saved)


def clear_env(route, environ, keep) -> list:
    """Unset ROUTE's switch names in ENVIRON except those in KEEP (the user's), so
    SGLang reads its declared defaults. Returns the "NAME=value" it unset."""
    cleared = []
    for name, _ in route.env:
        if name in environ and name not in keep:
            cleared.append(f"{name}={environ.pop(name)}")
    return cleared


def remove(op: str, device_key) -> None:
    """SGLang's own kernel again for DEVICE_KEY (the hook stays and passes through)."""
    _KERNELS.get(op, {}).pop(device_key, None)
    _BACKENDS.get(op, {}).pop(device_key, None)
