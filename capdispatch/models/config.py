"""A Hugging Face config.json (as a dict) -> ModelShape, every field checked.

Built-ins go through here too (their `config` block holds the published fields), so a
built-in and its config.json cannot load to different records.
"""
from __future__ import annotations

import math

from .errors import ModelError
from .shape import ModelShape, TensorFormat

# DeepSeek-V4's per-layer ratios: 0 sliding window only, 4 (c4, sparse through the indexer)
# and 128 (c128, dense). SGLang 0.5.23 also takes 1 and 2, for V4.1 (model_type deepseek_v41),
# whose layers share compressed KV across layers; this record does not describe those.
RATIOS = (0, 4, 128)

# (config key, record field, what it is, smallest valid value); all required.
REQUIRED = (
    ("num_hidden_layers", "layers", "decoder layers", 1),
    ("hidden_size", "hidden", "the hidden size", 1),
    ("vocab_size", "vocab", "the vocabulary size", 1),
    ("num_attention_heads", "heads", "attention query heads", 1),
    ("head_dim", "head_dim", "the attention head dim (nope + rope)", 2),
    ("qk_rope_head_dim", "rope_dim", "the rope part of the head dim", 1),
    ("q_lora_rank", "q_lora_rank", "the query low-rank width", 1),
    ("o_lora_rank", "o_lora_rank", "the output low-rank width", 1),
    ("o_groups", "o_groups", "output projection groups", 1),
    ("index_n_heads", "indexer_heads", "the indexer's heads", 1),
    ("index_head_dim", "indexer_dim", "the indexer's head dim", 1),
    ("index_topk", "index_topk", "the c4 indexer's top-k", 1),
    ("sliding_window", "window", "the sliding window", 1),
    ("n_routed_experts", "experts", "routed experts", 1),
    ("num_experts_per_tok", "experts_per_token", "experts per token", 1),
    ("moe_intermediate_size", "moe_intermediate", "each expert's intermediate size", 1),
    ("n_shared_experts", "shared_experts", "shared experts", 0),
)

# (config key, record field, what it is, smallest valid value); absent means none (0).
OPTIONAL = (
    ("first_k_dense_replace", "dense_layers", "leading dense-MLP layers", 0),
    ("num_hash_layers", "hash_layers", "leading hash-routed MoE layers", 0),
    ("num_nextn_predict_layers", "mtp", "next-n (MTP) predict layers", 0),
)


def _show(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-4:]}"


def _bad(where: str, key: str, value, valid: str) -> ModelError:
    return ModelError(f"{where}: {key} {_show(value)} is not valid; valid: {valid}")


# Upper bounds (inclusive), far above any DeepSeek-V4-class model (V4-Pro: 61 layers, 7168
# hidden, 384 experts) and low enough that every plan over them stays instant and exact.
HIGH = {"num_hidden_layers": 1024, "n_routed_experts": 65536, "num_experts_per_tok": 1024,
        "max_position_embeddings": 1 << 40}
HIGH_DEFAULT = 1 << 20


def _int(cfg: dict, where: str, key: str, what: str, low: int) -> int:
    value = cfg[key]
    high = HIGH.get(key, HIGH_DEFAULT)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        size = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise _bad(where, key, value, f"{size} up to {high} ({what})")
    return value


def _require(cfg: dict, where: str, key: str, what: str) -> None:
    if key not in cfg:
        raise ModelError(f"{where}: missing field {key} ({what}); a DeepSeek-V4 config.json "
                         f"has it")


def _check_kind(cfg: dict, where: str) -> None:
    mt = cfg.get("model_type")
    if mt is not None and mt != "deepseek_v4":
        raise _bad(where, "model_type", mt, "deepseek_v4 (this record describes DeepSeek-V4 "
                                            "as SGLang serves it)")
    arch = cfg.get("architectures")
    if arch is not None and (not isinstance(arch, list) or "DeepseekV4ForCausalLM" not in arch):
        raise _bad(where, "architectures", arch, "a list holding DeepseekV4ForCausalLM")
    kv = cfg.get("num_key_value_heads")
    if kv is not None and kv != 1:
        # SGLang asserts config.num_key_value_heads == 1 (MqaAttentionBase).
        raise _bad(where, "num_key_value_heads", kv, "1 (V4 attention is MQA over one latent)")


def _ratios(cfg: dict, where: str, layers: int) -> tuple:
    if "compress_ratios" not in cfg:
        return ()
    value = cfg["compress_ratios"]
    if not isinstance(value, list) or any(isinstance(r, bool) or r not in RATIOS for r in value):
        raise _bad(where, "compress_ratios", value,
                   f"a list of per-layer ratios, each one of {', '.join(map(str, RATIOS))}")
    if len(value) < layers:
        raise _bad(where, "compress_ratios", value,
                   f"one ratio per decoder layer: at least num_hidden_layers = {layers} entries "
                   f"(found {len(value)})")
    return tuple(value)


def _swiglu(cfg: dict, where: str):
    value = cfg.get("swiglu_limit")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise _bad(where, "swiglu_limit", value, "a positive number, or absent / null for none")
    return float(value)


def _positive(cfg: dict, where: str, key: str, default: float, what: str, high: float = 1e12) -> float:
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 < value <= high:
        raise _bad(where, key, value, f"a positive number up to {high:g} ({what}), or absent / null for "
                                      f"{default:g}")
    return float(value)


def _rope(cfg: dict, where: str) -> dict:
    """The rope's bases and YaRN stretch (SGLang's DeepSeek-V4 config defaults where absent)."""
    out = {"rope_theta": _positive(cfg, where, "rope_theta", 10000.0, "the window layers' rope base"),
           "compress_rope_theta": _positive(cfg, where, "compress_rope_theta", 40000.0,
                                            "the compressed layers' rope base")}
    scaling = cfg.get("rope_scaling")
    if scaling is None:
        return out
    if not isinstance(scaling, dict):
        raise _bad(where, "rope_scaling", scaling, "an object {factor, original_max_position_embeddings, ...} "
                                                   "or absent / null for none")
    # Named by their path in errors (rope_scaling.factor), read by the same checks.
    named = {f"rope_scaling.{k}": v for k, v in scaling.items() if isinstance(k, str)}
    out["rope_factor"] = _positive(named, where, "rope_scaling.factor", 1.0, "YaRN's stretch", high=1024)
    if named.get("rope_scaling.original_max_position_embeddings") is not None:
        out["rope_original"] = _int(named, where, "rope_scaling.original_max_position_embeddings",
                                    "the positions YaRN stretches", 1)
    return out


def formats(cfg: dict, where: str) -> tuple:
    """The checkpoint formats the config states: quantization_config for the linears,
    expert_dtype for the routed experts, torch_dtype for the rest."""
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    if dtype is not None and not isinstance(dtype, str):
        raise _bad(where, "torch_dtype", dtype, "a dtype name such as bfloat16")
    plain = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype) \
        if dtype else "unstated (no torch_dtype)"
    unquantized = TensorFormat("unquantized", plain)
    linear = unquantized
    q = cfg.get("quantization_config")
    if q is not None:
        if not isinstance(q, dict) or not isinstance(q.get("quant_method"), str):
            raise _bad(where, "quantization_config", q,
                       "an object with a quant_method string (e.g. fp8)")
        block = q.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or len(block) != 2 or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block)):
            raise _bad(where, "quantization_config.weight_block_size", block,
                       "two positive integers [rows, cols]")
        method = q["quant_method"]
        fmt = q.get("fmt")
        name = f"{method}_{fmt}" if fmt else method
        linear = TensorFormat("linear", name, q.get("scale_fmt", "fp32" if block else None),
                              block)
    routed = TensorFormat("routed_experts", linear.dtype, linear.scale, linear.block)
    expert_dtype = cfg.get("expert_dtype")
    if expert_dtype is not None:
        if expert_dtype != "fp4":
            raise _bad(where, "expert_dtype", expert_dtype,
                       "fp4 (MXFP4 routed experts), or absent for experts stored like the linears")
        # DeepSeek's inference/model.py: float4_e2m1fn_x2 weights, one float8_e8m0fnu
        # scale per 32 elements along K.
        routed = TensorFormat("routed_experts", "mxfp4", "e8m0", (1, 32))
    return (routed, TensorFormat("linear", linear.dtype, linear.scale, linear.block),
            unquantized)


def parse(cfg, where: str, name: str, source: str) -> ModelShape:
    """Check a config.json's fields and build the record; `where` names the file in errors."""
    if not isinstance(cfg, dict):
        raise ModelError(f"{where}: the top level is {type(cfg).__name__}, not a JSON object "
                         f"of config fields")
    _check_kind(cfg, where)
    values: dict = {}
    for key, field, what, low in REQUIRED:
        _require(cfg, where, key, what)
        values[field] = _int(cfg, where, key, what, low)
    for key, field, what, low in OPTIONAL:
        values[field] = _int(cfg, where, key, what, low) if cfg.get(key) is not None else 0
    layers = values["layers"]
    if values["rope_dim"] >= values["head_dim"]:
        raise _bad(where, "qk_rope_head_dim", values["rope_dim"],
                   f"less than head_dim {values['head_dim']} (the rest is the nope part)")
    if values["experts_per_token"] > values["experts"]:
        raise _bad(where, "num_experts_per_tok", values["experts_per_token"],
                   f"at most n_routed_experts = {values['experts']}")
    if values["heads"] % values["o_groups"]:
        # SGLang's wo_a splits heads * head_dim into o_groups equal groups.
        raise _bad(where, "o_groups", values["o_groups"],
                   f"a divisor of num_attention_heads = {values['heads']}")
    if values["dense_layers"] >= layers:
        raise _bad(where, "first_k_dense_replace", values["dense_layers"],
                   f"fewer than num_hidden_layers = {layers}")
    max_context = None
    if cfg.get("max_position_embeddings") is not None:
        max_context = _int(cfg, where, "max_position_embeddings", "the longest context", 1)
    return ModelShape(name=name, source=source, compress_ratios=_ratios(cfg, where, layers),
                      swiglu_limit=_swiglu(cfg, where), max_context=max_context,
                      formats=formats(cfg, where), **_rope(cfg, where), **values)
