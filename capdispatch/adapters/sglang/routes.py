"""Routing SGLang's DeepSeek-V4 KV-cache call sites to bound capdispatch kernels.

A rank installs a route only where its card needs one (SGLang's own kernel
cannot run there, or the user chose a capdispatch backend explicitly), through
SGLang's HookRegistry, which also rebinds `from ... import` copies. The wrapper
takes the kernel for the tensor's device: a route never answers for another
device, and anything it does not cover (another layout, another store type)
goes to SGLang's own function unchanged.
"""
from __future__ import annotations

import logging

log = logging.getLogger("capdispatch.sglang")

_KERNELS: dict = {}       # op -> {(device type, device index): kernel}
_INSTALLED: set = set()   # targets this process has hooked


def _key(t):
    d = t.device
    return (d.type, d.index)


def _v4(layout) -> bool:
    # KVLayout is a str enum: KVLayout.V4 == "v4".
    return layout is None or layout == "v4" or (isinstance(layout, str) and layout.lower() == "v4")


def dequant_v4(original, quant_k_cache, page_table_1_flattened, page_size, out=None, layout=None):
    """AROUND dequantize_k_cache_paged_dsv4(quant_k_cache, page_table_1_flattened,
    page_size, out=None, layout=KVLayout.V4) -> bf16 [n, 1, 512]."""
    fn = _KERNELS.get("kv_dequant", {}).get(_key(quant_k_cache)) if _v4(layout) else None
    if fn is None:
        kw = {} if layout is None else {"layout": layout}
        return original(quant_k_cache, page_table_1_flattened, page_size, out=out, **kw)
    return fn(quant_k_cache, page_table_1_flattened, page_size, out=out)


def store_v4(original, input, cache, indices, *, page_size, type, layout=None, freqs_cis=None):  # noqa: A002
    """AROUND fused_store_cache(input, cache, indices, *, page_size, type,
    layout=KVLayout.V4, freqs_cis=None): only the main ("flashmla") V4 store."""
    fn = None
    if type == "flashmla" and freqs_cis is None and _v4(layout):
        fn = _KERNELS.get("kv_quant", {}).get(_key(cache))
    if fn is None:
        kw = {} if layout is None else {"layout": layout}
        return original(input, cache, indices, page_size=page_size, type=type, freqs_cis=freqs_cis, **kw)
    fn(input, cache, indices, page_size)
    return None


CALLS = {"dequant_v4": dequant_v4, "store_v4": store_v4}


def kernel(op: str, device_key):
    return _KERNELS.get(op, {}).get(device_key)


def install(route, kernel_fn, device_key) -> bool:
    """Route ROUTE's call site to KERNEL_FN for tensors on DEVICE_KEY."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType
    if route.target not in _INSTALLED:
        if route.target in getattr(HookRegistry, "_patched", ()):
            log.warning("capdispatch: %s was already hooked by another plugin; capdispatch cannot "
                        "route %s there, so SGLang's own kernel (or the other plugin's) runs",
                        route.target, route.op)
            return False
        HookRegistry.register(route.target, CALLS[route.call], HookType.AROUND,
                              source=HookSource("capdispatch", "capdispatch"))
        HookRegistry.apply_hooks()
        _INSTALLED.add(route.target)
    _KERNELS.setdefault(route.op, {})[device_key] = kernel_fn
    return True


def remove(op: str, device_key) -> None:
    """SGLang's own kernel again for DEVICE_KEY (the hook stays and passes through)."""
    _KERNELS.get(op, {}).pop(device_key, None)
