"""Test-only setup for processes that import the real SGLang on a CPU machine.

Import first, before anything imports sglang. It
  * keeps Hugging Face offline (a local config.json is all a test resolves);
  * puts an in-memory stand-in for torchvision into sys.modules. It is
    unavoidable: `sglang.srt.configs` imports torchvision at import time
    (multimodal/internvl_utils.py), and PyPI's torchvision is CUDA-linked
    (it fails to load against CPU torch), so it is never installed. The stand-in
    goes in only after transformers has decided torchvision is unavailable, so
    transformers never takes its vision paths.
Also writes a small fake DeepSeek-V4 config.json (write_fake_dsv4).
"""
from __future__ import annotations

import enum
import json
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


# The scalars SGLang's DeepSeekV4Config needs; compress_ratios only from {0, 4, 128}.
FAKE_DSV4 = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "num_hidden_layers": 2, "compress_ratios": [0, 4, 128], "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3",
                            "activation_scheme": "dynamic", "scale_fmt": "ue8m0"},
    "hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 1024,
    "max_position_embeddings": 4096, "intermediate_size": 512, "moe_intermediate_size": 256,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 512, "q_lora_rank": 256,
    "qk_nope_head_dim": 448, "qk_rope_head_dim": 64, "v_head_dim": 512, "index_head_dim": 128,
    "index_n_heads": 8, "index_topk": 64, "sliding_window": 128, "window_size": 128,
    "num_key_value_heads": 1, "o_lora_rank": 256, "o_groups": 2, "hc_mult": 4,
}


def write_fake_dsv4(directory: str, **overrides) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**FAKE_DSV4, **overrides}, f)
    return directory
