"""The config.json of a cut checkpoint: the model's own fields, num_hidden_layers cut to N and
compress_ratios to N entries plus the next-n layers'; and the fields SGLang needs checked
first, so that a folder it would build wrongly is never written."""
from __future__ import annotations

import copy
import math
import os

from ..errors import ModelError

# Fields SGLang reads from a DeepSeek-V4 config.json that have no default there, or a
# default wrong for V4: it parses the file as a transformers DeepseekV3Config (SGLang's
# utils/hf_transformers/common.py registers deepseek_v4 that way), so a field the file
# lacks is either missing at model build or V3's value. (key, what it is, check, valid).
def _number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _positive_int(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 1


def _rope_scaling(v) -> bool:
    return isinstance(v, dict) and _positive_int(v.get("original_max_position_embeddings"))


NEEDED = (
    ("compress_ratios", "each layer's compress ratio (decides its compressor and indexer "
     "tensors)", lambda v: isinstance(v, list), "a list, one ratio per layer"),
    ("hc_mult", "the mHC residual streams (the hc_* tensors' shapes)", _positive_int,
     "a positive integer (4 for DeepSeek-V4)"),
    ("hc_eps", "the mHC epsilon", _number, "a number (1e-06)"),
    ("hc_sinkhorn_iters", "the mHC Sinkhorn rounds", _positive_int, "a positive integer (20)"),
    ("compress_rope_theta", "the compressed layers' RoPE base", _number, "a number (160000)"),
    ("rope_scaling", "the YaRN scaling SGLang reads original_max_position_embeddings from",
     _rope_scaling, "an object with original_max_position_embeddings"),
    ("scoring_func", "the router's score function", lambda v: isinstance(v, str),
     "a name (sqrtsoftplus)"),
    ("topk_method", "the router's top-k method", lambda v: isinstance(v, str),
     "a name (noaux_tc)"),
    ("routed_scaling_factor", "the routed experts' output scale (DeepseekV3Config's "
     "default, 2.5, is not DeepSeek-V4-Flash's 1.5)", _number, "a number"),
    ("torch_dtype", "the model's dtype", lambda v: v == "bfloat16", "bfloat16"),
    ("quantization_config", "the fp8 linears' format", lambda v: isinstance(v, dict),
     "an object (quant_method fp8, fmt e4m3, weight_block_size [128, 128])"),
    ("expert_dtype", "the routed experts' format", lambda v: v == "fp4", "fp4 (MXFP4)"),
)

# Formats the writer stores, and which field of the config states each.
LINEAR = ("fp8_e4m3", (128, 128))
ROUTED = ("mxfp4", (1, 32))


def source_config(name_or_path) -> tuple:
    """(the config's fields as a dict, where they were read) for a built-in or a
    config.json (or its folder), as load_model reads them."""

    from ..loader import _builtin_data, _read_json
    text = os.fspath(name_or_path)
    data = _builtin_data()
    for name in (text, text.lower()):
        if name in data and (name == text or not os.path.exists(text)):
            return copy.deepcopy(data[name]["config"]), f"capdispatch/models/builtin.yaml ({name})"
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    return _read_json(path), path


def check(cfg: dict, where: str, shape) -> None:
    """Refuse, naming the field, a config the checkpoint cannot be written from."""
    if "dtype" in cfg and "torch_dtype" not in cfg:
        cfg = dict(cfg, torch_dtype=cfg["dtype"])
    for key, what, ok, valid in NEEDED:
        if key not in cfg:
            raise ModelError(f"{where}: missing field {key} ({what}); a checkpoint SGLang loads "
                             f"as DeepSeek-V4 needs it in config.json")
        if not ok(cfg[key]):
            raise ModelError(f"{where}: {key} {cfg[key]!r} is not valid for a checkpoint; "
                             f"valid: {valid}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelError(f"{where}: hidden_act {cfg['hidden_act']!r} is not valid; valid: silu "
                         f"(SGLang's DeepSeek-V4 MoE takes only silu)")
    linear, routed = shape.format_of("linear"), shape.format_of("routed_experts")
    if (linear.dtype, linear.block) != LINEAR:
        raise ModelError(f"{where}: quantization_config states {linear.describe()}; valid: "
                         f"quant_method fp8, fmt e4m3, weight_block_size [128, 128] (the "
                         f"checkpoint's linears are F8_E4M3 with a scale per 128x128 block)")
    if (routed.dtype, routed.block) != ROUTED:
        raise ModelError(f"{where}: the routed experts are {routed.describe()}; valid: "
                         f"expert_dtype fp4 (MXFP4)")
    for key, value, size in (("hidden_size", shape.hidden, 32),
                             ("moe_intermediate_size", shape.moe_intermediate, 32)):
        if value % size:
            raise ModelError(f"{where}: {key} {value} is not valid for a checkpoint; valid: a "
                             f"multiple of {size} (an MXFP4 expert has one scale per 32 inputs)")
    if len(shape.compress_ratios) < shape.layers:
        raise ModelError(f"{where}: compress_ratios has {len(shape.compress_ratios)} entries; "
                         f"valid: one per decoder layer (num_hidden_layers = {shape.layers})")
    if shape.mtp > 1:
        raise ModelError(f"{where}: num_nextn_predict_layers {shape.mtp} is not valid; valid: "
                         f"0 or 1 (SGLang's DeepSeek-V4 loads one next-n layer)")


def checkpoint_config(cfg: dict, where: str, shape, layers: int) -> dict:
    """The config.json of the first LAYERS decoder layers (next-n layers kept)."""
    check(cfg, where, shape)
    out = copy.deepcopy(cfg)
    ratios = list(cfg["compress_ratios"])
    out["num_hidden_layers"] = layers
    out["compress_ratios"] = ratios[:layers] + ratios[shape.layers:]
    return out
