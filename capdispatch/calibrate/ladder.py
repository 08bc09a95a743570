"""The sizes each op is calibrated at (its leading dimension) and how it is served there."""
from __future__ import annotations

from ..errors import CapdispatchError

# Each op's default sizes are its Op.sizes (declared in its folder, with the op).


# Problem dimensions other than the bucketed one. "full" are DeepSeek-V4's at 64 attention
# heads and 64 experts per rank (benchmarks/ use the same builders); "small" keeps the CPU
# path (torch, the Triton interpreter) to seconds: shorter contexts, fewer experts,
# narrower MoE layers. `profile_of` makes one from a model's per-rank shapes (--model).
# LAYERS: DeepSeek-V4-Flash's 43, over which the served form spreads a batch's shared work.
_SHAPES = dict(heads=64, swa_topk=128, c4_topk=512, indexer_heads=64, next_n=1, moe_topk=6,
               route_skew=0.0, swiglu_limit=10.0, layers=43)
PROFILES = {
    "full": dict(_SHAPES, swa_page=256, c4_page=64, c4_tokens=65536, prefill_kv=65536, prefill_topk=512,
                 indexer_context=16384, kv_page=256, moe_experts=64, moe_experts_total=64, moe_hidden=4096,
                 moe_intermediate=2048),
    "small": dict(_SHAPES, swa_page=64, c4_page=64, c4_tokens=1024, prefill_kv=1024, prefill_topk=64,
                  indexer_context=256, kv_page=64, moe_experts=4, moe_experts_total=4, moe_hidden=256,
                  moe_intermediate=128),
}

# Expert popularity a served model shows (routing is never uniform): expert e of a random
# order is drawn with weight (e + 1) ** -SKEW. 0.5 keeps every expert busy at a few hundred
# tokens while the most popular take several times their share.
SERVED_ROUTE_SKEW = 0.5


def profile_of(rank, base: str = "full") -> dict:
    """The builders' dimensions for one rank of a model (a capdispatch RankShape): its heads,
    top-k lists, next-n rows, experts held and routed over, hidden and intermediate sizes,
    layer count; context lengths and page sizes from BASE."""
    p = dict(PROFILES[base])
    p.update(heads=rank.heads, swa_topk=rank.window, c4_topk=rank.index_topk, prefill_topk=rank.index_topk,
             indexer_heads=rank.indexer_heads, next_n=rank.next_n, moe_topk=rank.topk,
             moe_experts=rank.experts, moe_experts_total=rank.experts_total, moe_hidden=rank.hidden,
             moe_intermediate=rank.moe_intermediate, layers=rank.layers, route_skew=SERVED_ROUTE_SKEW)
    if rank.swiglu_limit is not None:
        p["swiglu_limit"] = float(rank.swiglu_limit)
    return p




class SizesError(CapdispatchError, ValueError):
    pass


def max_size(op: str, registry=None, platform: str = "cuda") -> int:
    """The largest size `--sizes` may time OP at: on a GPU 16 times its ladder's largest (the
    inputs grow with it; a typo of a few digits must not allocate the card away), on the CPU
    the ladder's largest (its inputs and the torch reference's temporaries live in host
    memory beside everything else); an op without a ladder (Op.sizes), 4096 (CPU: 256)."""
    from ..backends import builtin
    sizes = (registry or builtin()).ops[op].sizes
    if platform == "cpu":
        return max(sizes) if sizes else 256
    return 16 * max(sizes) if sizes else 4096


def parse_sizes(text: str) -> tuple:
    """'1,2,16' -> (1, 2, 16): whole numbers >= 1, ascending, no repeats."""
    out = []
    if not text.strip():
        raise SizesError("--sizes: no sizes given (e.g. 1,16,256)")
    for part in text.split(","):
        part = part.strip()
        if not part:     # a doubled, leading or trailing comma: a typo more often than a choice
            raise SizesError(f"--sizes {text!r} has an empty entry (valid: whole numbers >= 1, "
                             f"comma-separated, e.g. 1,16,256)")
        if not (part.isascii() and part.isdigit() and len(part) <= 9) or int(part) < 1:
            raise SizesError(f"--sizes: {part!r} is not a size (valid: whole numbers >= 1, "
                             f"comma-separated, e.g. 1,16,256)")
        out.append(int(part))
    if not out:
        raise SizesError("--sizes: no sizes given (e.g. 1,16,256)")
    if sorted(set(out)) != out:
        raise SizesError(f"--sizes: {text!r} must ascend without repeats (e.g. {','.join(map(str, sorted(set(out))))})")
    return tuple(out)
