"""Test-only setup for processes that import the real SGLang on a CPU machine.

Import first, before anything imports sglang. It
  * keeps Hugging Face offline (a local config.json is all a test resolves);
  * puts an in-memory stand-in for torchvision into sys.modules. It is
    unavoidable: `sglang.srt.configs` imports torchvision at import time
    (multimodal/internvl_utils.py), and PyPI's torchvision is CUDA-linked
    (it fails to load against CPU torch), so it is never installed. The stand-in
    goes in only after transformers has decided torchvision is unavailable, so
    transformers never takes its vision paths;
  * where sgl-flash-mla's CUDA extension cannot load (no CUDA driver), puts a
    stand-in `flash_mla` into sys.modules whose kernels raise, as FlashMLA's do
    on a card it has no kernel for (e.g. SM86). SGLang's flash_mla_interface
    imports flash_mla at module level; with the stand-in it imports, so the
    adapter's decode and sparse-prefill routes hook SGLang's real functions;
  * under SGLang 0.5.17 (tests/sglang_releases.py puts its folder first):
      - a stand-in `sgl_kernel` package (sglang-kernel is not installed: its
        package import loads CUDA ops for the current GPU) holding only
        `sgl_kernel.flash_mla`, whose functions have sglang-kernel 0.4.5's exact
        parameters and raise when called, so the adapter's decode and
        sparse-prefill routes hook SGLang 0.5.17's real call targets. Any other
        `from sgl_kernel import NAME` fails, as without sglang-kernel;
      - transformers' AutoConfig.register with exist_ok=True, as SGLang 0.5.23
        calls it: 0.5.17 registers qwen3_asr, which the venv's transformers
        (newer than 0.5.17's pin) already defines.
"""
from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _install_torchvision_standin() -> None:
    # The planning command's own placeholder: one definition for both.
    from capdispatch.adapters.sglang.plan import vision_placeholder
    vision_placeholder()


_install_torchvision_standin()


class FlashMLAStandInError(RuntimeError):
    pass


def _install_flash_mla_standin() -> None:
    if "flash_mla" in sys.modules:
        return
    try:
        import flash_mla  # noqa: F401
        return
    except ImportError:
        return              # not installed: SGLang's interface fails to import, as it would
    except OSError:
        pass                # installed, but its CUDA library cannot load here

    def kernel(name):
        def call(*args, **kwargs):
            raise FlashMLAStandInError(f"flash_mla.{name}: FlashMLA stand-in (no CUDA driver here); "
                                       f"a routed call site must not reach it")
        call.__name__ = name
        return call

    class FlashMLASchedMeta:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

    pkg = types.ModuleType("flash_mla")
    pkg.__path__ = []
    iface = types.ModuleType("flash_mla.flash_mla_interface")
    iface.FlashMLASchedMeta = FlashMLASchedMeta
    pkg.flash_mla_interface = iface
    pkg.FlashMLASchedMeta = FlashMLASchedMeta
    pkg.get_mla_metadata = lambda *a, **k: (FlashMLASchedMeta(*a, **k), None)
    for name in ("flash_mla_with_kvcache", "flash_mla_sparse_fwd", "get_mla_decoding_metadata",
                 "fused_norm_rope_attn_rope_cast"):
        setattr(pkg, name, kernel(name))
    sys.modules["flash_mla"] = pkg
    sys.modules["flash_mla.flash_mla_interface"] = iface


_install_flash_mla_standin()


def _sglang_release():
    from importlib import metadata
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


class SglKernelStandInError(RuntimeError):
    pass


def _install_sgl_kernel_standin() -> None:
    import dataclasses
    import importlib.util
    if "sgl_kernel" in sys.modules or importlib.util.find_spec("sgl_kernel") is not None:
        return

    def raises(name):
        def call(*args, **kwargs):
            raise SglKernelStandInError(f"sgl_kernel.flash_mla.{name}: sglang-kernel stand-in (tests only); "
                                        f"a routed call site must not reach it")
        return call

    @dataclasses.dataclass
    class FlashMLASchedMeta:
        have_initialized: bool = False
        config: object = None
        tile_scheduler_metadata: object = None
        num_splits: object = None

    # sglang-kernel 0.4.5's parameter lists (sgl_kernel/flash_mla.py), which the
    # adapter's wrappers must match.
    def get_mla_metadata(cache_seqlens=None, num_q_tokens_per_head_k=None, num_heads_k=None, num_heads_q=None,
                         is_fp8_kvcache=False, topk=None):
        if cache_seqlens is None:
            return FlashMLASchedMeta(), None
        return raises("get_mla_metadata")()

    def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, descale_q=None, descale_k=None,
                               is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
                               extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None):
        return raises("flash_mla_with_kvcache")()

    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        return raises("flash_mla_sparse_fwd")()

    pkg = types.ModuleType("sgl_kernel")
    pkg.__path__ = []
    pkg.__capdispatch_standin__ = True
    fm = types.ModuleType("sgl_kernel.flash_mla")
    for obj in (FlashMLASchedMeta, get_mla_metadata, flash_mla_with_kvcache, flash_mla_sparse_fwd):
        obj.__module__ = fm.__name__
        setattr(fm, obj.__name__, obj)
    pkg.flash_mla = fm
    sys.modules["sgl_kernel"] = pkg
    sys.modules["sgl_kernel.flash_mla"] = fm


def _register_configs_like_0523() -> None:
    import transformers
    original = transformers.AutoConfig.register     # a staticmethod

    def register_existing_ok(model_type, config, exist_ok=False):
        return original(model_type, config, exist_ok=True)
    transformers.AutoConfig.register = staticmethod(register_existing_ok)


if _sglang_release() == "0.5.17":
    _install_sgl_kernel_standin()
    _register_configs_like_0523()
