"""Test-only setup for processes that import the real SGLang on a CPU machine.

Import first, before anything imports sglang. It
  * keeps Hugging Face offline (a local config.json is all a test resolves);
  * puts an in-memory stand-in for torchvision into sys.modules. It is
    unavoidable: `sglang.srt.configs` imports torchvision at import time
    (multimodal/internvl_utils.py), and PyPI's torchvision is CUDA-linked
    (it fails to load against CPU torch), so it is never installed. The stand-in
    goes in only after transformers has decided torchvision is unavailable, so
    transformers never takes its vision paths.
"""
from __future__ import annotations

import enum
import os
import sys
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _install_torchvision_standin() -> None:
    if "torchvision" in sys.modules:
        return
    import transformers.utils.import_utils as iu
    if iu.is_torchvision_available():
        return      # a real torchvision: leave it alone

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"

    def module(name):
        m = types.ModuleType(name)

        def __getattr__(attr, _n=name):
            if attr.startswith("__"):
                raise AttributeError(attr)
            if attr == "InterpolationMode":
                return InterpolationMode
            return type(attr, (), {"__init__": lambda self, *a, **k: None})

        m.__getattr__ = __getattr__
        sys.modules[name] = m

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.transforms.v2", "torchvision.io", "torchvision.ops"):
        module(name)


_install_torchvision_standin()
