"""Small fake model configs (config.json only) for SGLang's argument resolution.
Side-effect free: the pytest process imports it without importing SGLang."""
from __future__ import annotations

import json
import os

# The scalars SGLang's DeepSeekV4Config needs; compress_ratios only from {0, 4, 128}.
DSV4 = {
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

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}


def write(directory: str, config: dict) -> str:
    """A model directory holding only CONFIG as config.json."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory
