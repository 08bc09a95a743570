"""SGLang's own DeepSeek-V4 weight-name mapping, run on the CPU without importing sglang.

The pure pieces are read out of a release's installed source with `ast` and executed
(nothing is retyped): DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format and
DEEPSEEK_V4_STACKED_PARAMS_MAPPING (models/deepseek_v4.py), FusedMoE.make_expert_params_mapping
(layers/moe/fused_moe_triton/layer.py), get_layer_id (layers/utils/common.py) and
probe_routed_expert_weight_dtype (model_loader/weight_utils.py). What is written here is
the routing of DeepseekV4ForCausalLM.load_weights (names only: which param each checkpoint
tensor lands in, for the main model and for the next-n draft) and the params the model
has, from SGLang's module tree (the set load_weights must fill, or it logs "Some weights
are not initialized").

`problems(ns, tensors, config)` lists, for TENSORS ({name: safetensors dtype}), every name
SGLang would skip with "not found in params_dict", every param left unloaded, every fused
param missing a part, and every dtype SGLang would refuse or mis-copy; empty means the
checkpoint loads.
"""
from __future__ import annotations

import ast
import json
import os
import re
import struct
from pathlib import Path
from typing import List, Optional, Tuple

from sglang_releases import package_dir


def _tree(pkg: str, rel: str):
    path = os.path.join(pkg, rel)
    return path, ast.parse(Path(path).read_text(encoding="utf-8"), path)


def _member(tree, cls: str, name: str):
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for m in node.body:
                if isinstance(m, ast.FunctionDef) and m.name == name:
                    m.decorator_list = []
                    return m
    raise LookupError(f"{cls}.{name} not found")


def _top(tree, name: str):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
        target = node.targets[0] if isinstance(node, ast.Assign) else \
            node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == name:
            return node
    raise LookupError(f"{name} not found")


def _run(ns: dict, path: str, *nodes) -> None:
    exec(compile(ast.Module(body=list(nodes), type_ignores=[]), path, "exec"), ns)


def load(release: str) -> dict:
    """The namespace holding RELEASE's functions (by their SGLang names)."""
    pkg = package_dir(release)
    ns = {"Optional": Optional, "List": List, "Tuple": Tuple, "re": re, "os": os, "json": json,
          "struct": struct, "Path": Path}
    path, tree = _tree(pkg, "srt/models/deepseek_v4.py")
    _run(ns, path, _top(tree, "DEEPSEEK_V4_STACKED_PARAMS_MAPPING"),
         _member(tree, "DeepseekV4ForCausalLM", "remap_weight_name_to_dpsk_hf_format"))
    path, tree = _tree(pkg, "srt/layers/moe/fused_moe_triton/layer.py")
    fn = _member(tree, "FusedMoE", "make_expert_params_mapping")
    fn.args.args = fn.args.args[1:]                      # a classmethod: drop cls
    _run(ns, path, fn)
    path, tree = _tree(pkg, "srt/layers/utils/common.py")
    _run(ns, path, _top(tree, "get_layer_id"))
    path, tree = _tree(pkg, "srt/model_loader/weight_utils.py")
    _run(ns, path, _top(tree, "_ROUTED_EXPERT_KEY_RE"), _top(tree, "probe_routed_expert_weight_dtype"))
    return ns


# ------------------------------------------------------------------ the model's params

def _layer_params(p: str, ratio: int, hashed: bool, shared: bool) -> set:
    a = f"{p}.self_attn"
    out = {f"{a}.attn_sink", f"{a}.q_norm.weight", f"{a}.kv_norm.weight",
           f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight",
           f"{p}.mlp.gate.weight",
           f"{p}.mlp.topk.tid2eid" if hashed else f"{p}.mlp.gate.e_score_correction_bias"}
    for lin in ("wqkv_a", "wq_b", "wo_a", "wo_b"):
        out |= {f"{a}.{lin}.weight", f"{a}.{lin}.weight_scale_inv"}
    for part in ("attn", "ffn"):
        out |= {f"{p}.hc_{part}_{x}" for x in ("fn", "base", "scale")}
    out |= {f"{p}.mlp.experts.{w}_{x}" for w in ("w13", "w2") for x in ("weight", "weight_scale_inv")}
    if shared:
        out |= {f"{p}.mlp.shared_experts.{m}.{x}" for m in ("gate_up_proj", "down_proj")
                for x in ("weight", "weight_scale_inv")}
    if ratio:
        out |= {f"{a}.compressor.{x}" for x in ("ape", "wkv_gate.weight", "norm.weight")}
    if ratio == 4:
        i = f"{a}.indexer"
        out |= {f"{i}.wq_b.weight", f"{i}.wq_b.weight_scale_inv", f"{i}.weights_proj.weight"}
        out |= {f"{i}.compressor.{x}" for x in ("ape", "wkv_gate.weight", "norm.weight")}
    return out


def params(config: dict, nextn: bool) -> set:
    """The params load_weights fills: DeepseekV4ForCausalLM's, or the next-n draft's (which
    shares the target's embedding and head, so has neither to load)."""
    shared = bool(config.get("n_shared_experts"))
    if nextn:
        out = _layer_params("model.decoder", 0, False, shared)
        out |= {f"model.{m}.{x}" for m in ("e_proj", "h_proj") for x in ("weight", "weight_scale_inv")}
        out |= {"model.enorm.weight", "model.hnorm.weight", "model.shared_head.norm.weight"}
    else:
        out = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
        for i in range(config["num_hidden_layers"]):
            out |= _layer_params(f"model.layers.{i}", config["compress_ratios"][i],
                                 i < config.get("num_hash_layers", 0), shared)
    return out | {f"model.hc_head_{x}" for x in ("fn", "base", "scale")}


# ------------------------------------------------------------------ load_weights' routing

def route(ns: dict, names, config: dict, nextn: bool) -> dict:
    """{checkpoint name: (param, part) or None where load_weights skips it on purpose}.
    PART says which piece of a fused param it is: ('q'|'kv') for wqkv_a, ('kv'|'gate') for
    a compressor's wkv_gate, (expert, 'w1'|'w2'|'w3') for the routed experts, the shard id
    for a stacked shared-expert param, None for a plain one."""
    layers = config["num_hidden_layers"]
    stacked = ns["DEEPSEEK_V4_STACKED_PARAMS_MAPPING"]
    experts = {w: (p, e, s) for p, w, e, s in ns["make_expert_params_mapping"](
        "gate_proj", "down_proj", "up_proj", config["n_routed_experts"])}
    nextn_prefix = f"model.layers.{0 if layers == 1 else layers}"
    out_of_layer = ("shared_head.norm", "shared_head.head", "embed_tokens", ".e_proj", "h_proj",
                    "enorm", "hnorm", "hc_head_base", "hc_head_fn", "hc_head_scale")
    found = {}
    for ck in names:
        name = ns["remap_weight_name_to_dpsk_hf_format"](ck, is_nextn=nextn, num_hidden_layers=layers)
        ns["get_layer_id"](name)                     # the pipeline filter: one stage here
        if not nextn:
            if config.get("num_nextn_predict_layers", 0) > 0 and name.startswith("model.layers") \
                    and int(name.split(".")[2]) >= layers:
                found[ck] = None
                continue
            if name.startswith("mtp"):
                found[ck] = None
                continue
        else:
            if "shared_head.head" in name or "embed_tokens" in name or not name.startswith(nextn_prefix):
                found[ck] = None
                continue
            hit = next((w for w in out_of_layer if w in name), None)
            name = name.replace(nextn_prefix, "model" if hit else "model.decoder")
        for param, weight, shard in stacked:
            if weight in name and "mlp.experts." not in name:
                found[ck] = (name.replace(weight, param), shard)
                break
        else:
            m = re.search(r"experts\.\d+\.\w+\.", name)
            if m and m.group(0) in experts:
                param, e, shard = experts[m.group(0)]
                found[ck] = (name.replace(m.group(0), param), (e, shard))
            elif ".compressor.w" in name and ".wkv_gate." not in name:
                part = "kv" if name.endswith(".wkv.weight") else "gate" if name.endswith(".wgate.weight") else "?"
                found[ck] = (name.rsplit(".", 2)[0] + ".wkv_gate.weight", part)
            elif ".compressor." not in name and re.search(r"\.(wq_a|wkv)\.(weight|weight_scale_inv)$", name):
                is_q = ".wq_a." in name
                found[ck] = (name.replace(".wq_a." if is_q else ".wkv.", ".wqkv_a."), "q" if is_q else "kv")
            else:
                found[ck] = (name, None)
    return found


# What SGLang's params hold, and so what the checkpoint must store: F8_E4M3 fp8 linears
# (wo_a is refused otherwise while SGLANG_OPT_FP8_WO_A_GEMM is on), int8 MXFP4 experts
# (copied bit for bit; U8 would be converted by value), F8_E8M0 power-of-two scales, bf16
# compressors (a .scale there trips load_weights' compressor assert), F32 mixers, sinks,
# position biases and router bias, I64 hash routes.
FP8_LINEARS = re.compile(r"\.(wqkv_a|wq_b|wo_a|wo_b|gate_up_proj|down_proj|e_proj|h_proj)\.weight$")


def want_dtype(param: str) -> str:
    if param.endswith("weight_scale_inv"):
        return "F8_E8M0"
    if param.endswith(("experts.w13_weight", "experts.w2_weight")):
        return "I8"
    if FP8_LINEARS.search(param):
        return "F8_E4M3"
    if param.endswith("tid2eid"):
        return "I64"
    if re.search(r"(attn_sink|\.ape|hc_\w+_(fn|base|scale)|e_score_correction_bias)$", param):
        return "F32"
    return "BF16"


def problems(ns: dict, tensors: dict, config: dict) -> list:
    """Everything that would make SGLang skip, leave unloaded or refuse part of TENSORS."""
    out = []
    experts = config["n_routed_experts"]
    for nextn in ((False, True) if config.get("num_nextn_predict_layers", 0) else (False,)):
        model = "next-n draft" if nextn else "model"
        have = params(config, nextn)
        parts: dict = {}
        for ck, hit in route(ns, tensors, config, nextn).items():
            if hit is None:
                continue
            param, part = hit
            if param not in have:
                out.append(f"{model}: {ck} -> {param} not found in params_dict")
                continue
            parts.setdefault(param, []).append((part, ck))
            if tensors[ck] != want_dtype(param):
                out.append(f"{model}: {ck} is {tensors[ck]}; {param} takes {want_dtype(param)}")
        for param in sorted(have - set(parts)):
            out.append(f"{model}: {param} is not initialized from the checkpoint")
        for param, got in parts.items():
            pieces = sorted(str(p) for p, _ in got)
            if ".wqkv_a." in param:
                need = ["kv", "q"]
            elif param.endswith("wkv_gate.weight"):
                need = ["gate", "kv"]
            elif ".experts.w13_" in param:
                need = sorted(str((e, s)) for e in range(experts) for s in ("w1", "w3"))
            elif ".experts.w2_" in param:
                need = sorted(str((e, "w2")) for e in range(experts))
            elif "gate_up_proj" in param:
                need = ["0", "1"]
            else:
                need = ["None"]
            if pieces != need:
                missing = sorted(set(need) - set(pieces))
                extra = sorted({x for x in pieces if pieces.count(x) > 1 or x not in need})
                out.append(f"{model}: {param} lacks parts {missing[:4]}"
                           f"{' ...' if len(missing) > 4 else ''}; extra or repeated {extra[:4]}")
    return out


def folder_tensors(folder: str) -> dict:
    """{name: safetensors dtype} of a Hugging Face folder, read from its index's shards' headers."""
    index = json.loads(Path(folder, "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with open(os.path.join(folder, shard), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return out
