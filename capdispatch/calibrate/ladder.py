"""The sizes each op is calibrated at (its leading dimension) and how it is served there."""
from __future__ import annotations

from ..errors import CapdispatchError

# Decode-time ops: 1-4096 tokens (SGLang's decode batches and extends); prefill up to 16k
# query tokens; the KV ops by rows (decode writes a batch's tokens, prefill gathers up to
# a whole context).
_DECODE = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_SIZES = {
    "decode_mla": _DECODE,
    "indexer": _DECODE,
    "moe": _DECODE,
    "sparse_prefill": (256, 512, 1024, 2048, 4096, 8192, 16384),
    "kv_quant": _DECODE + (16384,),
    "kv_dequant": (64, 256, 1024, 4096, 16384, 65536, 262144),
}


# Problem dimensions other than the bucketed one. "full" are DeepSeek-V4's (benchmarks/
# use the same builders); "small" keeps the CPU path (torch, the Triton interpreter) to
# seconds: shorter contexts, fewer experts, narrower MoE layers.
PROFILES = {
    "full": dict(swa_page=256, c4_page=64, c4_tokens=65536, prefill_kv=65536, prefill_topk=512,
                 indexer_context=16384, kv_page=256, moe_experts=64, moe_hidden=4096,
                 moe_intermediate=2048),
    "small": dict(swa_page=64, c4_page=64, c4_tokens=1024, prefill_kv=1024, prefill_topk=64,
                  indexer_context=256, kv_page=64, moe_experts=4, moe_hidden=256,
                  moe_intermediate=128),
}


# On CUDA every size is timed inside a CUDA graph: the choice between an op's kernels is
# about device time. Timed eagerly, a kernel shorter than its launch (the KV ops below
# tens of microseconds, prefill at a few hundred tokens) measures the host instead, and
# host noise then picks the backend. The host cost per call is the wrapper's, alike for
# an op's backends, and benchmarks/bench_overhead.py measures it apart.
def timed_in_graph(platform: str) -> bool:
    return platform == "cuda"


class SizesError(CapdispatchError, ValueError):
    pass


def max_size(op: str) -> int:
    """The largest size `--sizes` may time OP at: 16 times its ladder's largest (the
    inputs grow with it; a typo of a few digits must not allocate the card away)."""
    return 16 * max(DEFAULT_SIZES[op])


def parse_sizes(text: str) -> tuple:
    """'1,2,16' -> (1, 2, 16): whole numbers >= 1, ascending, no repeats."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not (part.isascii() and part.isdigit() and len(part) <= 9) or int(part) < 1:
            raise SizesError(f"--sizes: {part!r} is not a size (valid: whole numbers >= 1, "
                             f"comma-separated, e.g. 1,16,256)")
        out.append(int(part))
    if not out:
        raise SizesError("--sizes: no sizes given (e.g. 1,16,256)")
    if sorted(set(out)) != out:
        raise SizesError(f"--sizes: {text!r} must ascend without repeats (e.g. {','.join(map(str, sorted(set(out))))})")
    return tuple(out)
