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
    adapter's decode and sparse-prefill routes hook SGLang's real functions.
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
