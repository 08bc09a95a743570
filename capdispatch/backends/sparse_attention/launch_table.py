"""Launch table of the sparse-attention Triton kernels (kernels.py), shared by
sparse_prefill and decode_mla: tile configurations per call kind and compute capability,
and the split-K and combine constants."""
from __future__ import annotations

from ...errors import ArgumentError

__all__ = ["PORTABLE_CONFIGS", "TIMED_PORTABLE", "MEASURED_CONFIGS", "KINDS", "INTERP_CONFIG", "configs_for",
           "DECODE_MAX_TOKENS", "COMBINE_BLOCK_H", "COMBINE_BLOCK_D", "COMBINE_WARPS", "MAX_SPLITS",
           "CANDIDATE_TABLES", "CANDIDATE_TABLES_99KB", "CANDIDATE_CC", "table_configs"]

# Launch configurations per call kind, tried in order until one compiles within the
# device's shared memory (Triton raises OutOfResources at compile time). Kinds:
# "prefill" (bf16 rows), "decode" (paged pool, one pass) and "decode_split" (paged pool,
# split-K for decode-sized calls, see decode_splits).
#
# PORTABLE: entries that compile (triton 3.9, ptxas -v) for sm_80, sm_86, sm_89, sm_90a and
# sm_120a within the 99 KB of SM86/SM89/SM120, ordered by their times on an H200 held to
# that shared memory with these same mma.sync tiles (benchmarks/bench_attention.py --tune
# --tiles 99kb, 2026-12-02, CUDA graphs, DeepSeek-V4 shapes; results/
# attention_nvidia_h200_99kb_20261202T034521.md). Prefill: 32 heads x 32 rows on 4 warps,
# 1.85 ms at s=4096 against 3.56 ms on 8 warps (74 KB; ptxas spills 288-368 B of it).
# Decode: 32 x 16 on 8 warps is the fastest of the 32- and 16-head tiles for one-pass
# decode (64-head tiles of 32 rows or more need over 99 KB there) and split-K decode
# from 32 tokens (73.8 us against 92.2 us); a single token wants more, smaller programs,
# 16 x 16 on 4 warps (16.0 us against 19.0 us).
# One-pass decode from 128 tokens: 64 heads x 16 rows on 8 warps (each gathered row
# dequantised once for all 64 heads, not once per 32-head tile; 96 KB on sm_86/sm_89/
# sm_120a, 80 KB on sm_90a; ptxas spills 0-312 B): 0.172 ms against 0.295 ms at 128
# tokens and 5.17 ms against 9.28 ms at 4096 (triton_fp8; the uint8 codec 0.181 / 5.50
# against 0.330 / 10.39), but slower at 1-64 tokens, where the 32-head entry stays
# (benchmarks/bench_attention_candidates.py, 2026-12-03, 64 heads, the 99 KB candidate
# hp16; benchmarks/results/attention_candidates_nvidia_h200_20261203T134314.md);
# 65-127 tokens were not timed and keep the 32-head entry. Timed on an H200 under the
# 99 KB limits, not on an SM86/SM89/SM120 card: compiled for sm_90a, this tile's dots are
# wgmma there (80 KB) and mma.sync on those cards (96 KB); what it saves, half the
# gathers and dequant of the 32-head tile, does not depend on the MMA instruction.
# MEASURED: tables timed on hardware, keyed by compute capability. An entry with
# "max_tokens" is only used for calls of at most that many query tokens; a split-K entry
# with "max_splits" caps the split count (kernels.decode_splits).
# The H200 (SM90), 2026-11-29, CUDA graphs, DeepSeek-V4 shapes (benchmarks/results/archive/
# attention_nvidia_h200_20261129T222412.md and the sweep of ...T220941; the defaults
# re-measured in ...T223206 and ...T223630): 64-head x
# 64-row tiles (wgmma; one program per token, so each gathered row is dequantised once,
# not once per head block) are fastest for prefill (1.42 ms against 3.52 ms for the
# portable tile, s=4096), for one-pass decode (2.77 ms against 9.27 ms at 4096 tokens,
# 98 us against 295 us at 128) and for split-K decode from 8 to 64 tokens (22-99 us
# against 31-165 us), although ptxas spills 1-3 KB of their registers; they need
# 128-192 KB of shared memory, which only SM90 and SM100 have. A single token wants
# more, smaller programs: 16 heads x 32 rows, 15.9 us against 21.2 us.
# The portable decode tiles that serve any size, and 64 heads x 16 rows (see above).
_PORTABLE_DECODE = (
    dict(BLOCK_H=32, BLOCK_N=16, num_warps=8, num_stages=1),
    dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1),
)
_HP16 = dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=1)
PORTABLE_CONFIGS = {
    "prefill": (
        dict(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=2),
        dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=2),
        dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=1),
        dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1),
    ),
    "decode": (
        dict(BLOCK_H=32, BLOCK_N=16, num_warps=8, num_stages=1, max_tokens=127),
        _HP16,
    ) + _PORTABLE_DECODE,
    "decode_split": (dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1, max_tokens=1),) + _PORTABLE_DECODE,
}
# Portable entries timed with the spills ptxas reports for them (the prefill tile and the
# 64-head decode tile above); every other portable entry compiles without spills on every target.
TIMED_PORTABLE = (PORTABLE_CONFIGS["prefill"][0], _HP16)
MEASURED_CONFIGS = {
    (9, 0): {
        "prefill": (dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1),) + PORTABLE_CONFIGS["prefill"],
        "decode": (dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1),) + PORTABLE_CONFIGS["decode"],
        "decode_split": (dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2, max_tokens=1),
                         dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1)) + _PORTABLE_DECODE,
    },
}
KINDS = ("prefill", "decode", "decode_split")
# Under the interpreter (CPU) resources do not matter; small tiles keep it fast and
# exercise head / index masking with small test shapes.
INTERP_CONFIG = dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1)


def configs_for(cc, kind: str, tokens: int | None = None) -> tuple:
    """The launch configurations for compute capability ``cc`` ((major, minor)) and call
    ``kind``, best first: the measured table for that capability, else the portable one;
    with ``tokens``, without the entries whose ``max_tokens`` is below it."""
    if kind not in KINDS:
        raise ArgumentError(f"unknown kernel kind {kind!r}; valid: {', '.join(KINDS)}")
    table = MEASURED_CONFIGS.get(tuple(cc), PORTABLE_CONFIGS)[kind]
    if tokens is None:
        return table
    return tuple(c for c in table if c.get("max_tokens", tokens) >= tokens)


# Split-K only for decode-sized calls: at most this many query tokens.
DECODE_MAX_TOKENS = 64
# Combine tile: small, so that even one token's merge is spread over many programs
# (the split kernel's head tile may be 64 heads; merging 64 heads x 128 columns per
# program left most SMs idle at 1-8 tokens).
COMBINE_BLOCK_H = 8
COMBINE_BLOCK_D = 64
COMBINE_WARPS = 2
MAX_SPLITS = 32   # a power of two: the combine kernel's split axis (one compile for any split count)


# --------------------------------------------------------------------------- #
# Candidate tables, toward the targets of the Triton attention fallbacks (decode within
# 1.3x of FlashMLA at 1-64 tokens and 1.5x at 4096, prefill at >= 45% of compute; served
# form). Whole tables in the format of
# MEASURED_CONFIGS[cc], not used by any backend until a benchmark on the card
# (benchmarks/bench_attention_candidates.py) puts a winner into MEASURED_CONFIGS or
# PORTABLE_CONFIGS. Each says what it changes; the reasons, per size, are in
# docs/ops/sparse_attention.md ("Why the Triton kernels miss, per size, and the candidate tables").
# --------------------------------------------------------------------------- #
_SINGLE_TOKEN = dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2, max_tokens=1)
_W16 = dict(BLOCK_H=64, BLOCK_N=64, num_warps=16, num_stages=1)
_BN32S2 = dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)
_HP16S2 = dict(BLOCK_H=64, BLOCK_N=16, num_warps=8, num_stages=2)
_HP16W16 = dict(BLOCK_H=64, BLOCK_N=16, num_warps=16, num_stages=1)
_HP16W16S2 = dict(BLOCK_H=64, BLOCK_N=16, num_warps=16, num_stages=2)

_S4 = dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=1, max_splits=4)

CANDIDATE_CC = (9, 0)


def _h200_with(lead: tuple, split_head: tuple) -> dict:
    """The H200 table with LEAD first in prefill and one-pass decode, and SPLIT_HEAD in
    place of the first split-decode entry."""
    base = MEASURED_CONFIGS[CANDIDATE_CC]
    return {"prefill": lead + base["prefill"], "decode": lead + base["decode"],
            "decode_split": split_head + base["decode_split"][1:]}


# For this card's capability (cc 9.0, 227 KB): name -> (what it changes, table).
CANDIDATE_TABLES = {
    "w16": ("64x64 tiles on 16 warps instead of 8: the same head packing with the fp32 "
            "accumulator and the dequantised rows spread over twice the threads; but 512 "
            "threads cap a thread at 128 registers, and ptxas spills more (4.9 KB for the fp8 "
            "pool on sm_90a against 1 KB on 8 warps): timed to settle it, not expected to win",
            _h200_with((_W16,), (_SINGLE_TOKEN, _W16))),
    "bn32s2": ("64 heads x 32 rows, 2 stages: the next block's gather (bf16 rows: cp.async) "
               "overlaps this block's dots; 96-128 KB instead of 196 KB of shared memory and "
               "fewer spills (260 B for prefill on sm_90a against 344 B)",
               _h200_with((_BN32S2,), (_SINGLE_TOKEN, _BN32S2))),
    "s4": ("the current tiles with split-K decode capped at 4 ranges per token: each split "
           "writes a 64 x 512 fp32 partial (128 KB) that the combine reads back, 10 MB at 8 "
           "tokens with 10 splits against 3 MB of K/V; fewer, longer programs trade SM fill "
           "for that traffic",
           _h200_with((), (_SINGLE_TOKEN, _S4))),
    "hp16": ("split-K decode with all 64 heads in one program from the first token (64 x 16 "
             "rows): every gathered row is dequantised once, not once per 16-head block, "
             "and 16-row blocks give a one-token list 40 blocks to split over",
             _h200_with((), (_HP16,))),
    # One token (the 1.3x target's closest miss): the split entry's head tile and row block.
    # Timed on an H200 (2026-12-03, triton_fp8, served): 20.9 / 20.8 / 17.2 us against the
    # shipped entry's 15.8 us, so none is taken (benchmarks/results/h200-2026-12-03/
    # attention_candidates_t1_1901.md).
    "t1h32": ("one token with 32-head x 32-row split programs: each gathered row dequantised "
              "twice instead of four times, 40 programs instead of 80",
              _h200_with((), (dict(_SINGLE_TOKEN, BLOCK_H=32),) + MEASURED_CONFIGS[CANDIDATE_CC]["decode_split"][1:2])),
    "t1n64": ("one token with 16-head x 64-row split programs: 10 ranges instead of 20, so half "
              "the fp32 partials written and merged",
              _h200_with((), (dict(_SINGLE_TOKEN, BLOCK_N=64),) + MEASURED_CONFIGS[CANDIDATE_CC]["decode_split"][1:2])),
    "t1n16": ("one token with 16-head x 16-row split programs on two stages: 40 blocks, so the "
              "ranges can be cut finer",
              _h200_with((), (dict(_SINGLE_TOKEN, BLOCK_N=16),) + MEASURED_CONFIGS[CANDIDATE_CC]["decode_split"][1:2])),
}

def _with_direct(table: dict) -> dict:
    """TABLE with every decode entry decoding the uint8 pool straight to bf16 (``DIRECT``)."""
    return {kind: tuple(c if kind == "prefill" else dict(c, DIRECT=True) for c in configs)
            for kind, configs in table.items()}


# An entry's "DIRECT": True makes the uint8 codec (decode_mla ``triton``; KV_MODE 1) decode
# e4m3 straight to bf16 in PTX (triton_common/codec.py e4m3fn_scaled_bf16_ptx) instead of
# through float32; the native-fp8 codec ignores it. Exact for every byte and scale
# (tests/test_e4m3_decode.py: the PTX emulated for all 256 x 256, the interpreter on the
# 64-head tiles; the GPU tests wait for a card). An earlier direct decode, tried on an
# H200 and an H100 on 2026-12-06, was wrong on the 8-warp tiles
# (docs/ops/sparse_attention.md says how); this one is a candidate until a card times it.
_DIRECT_WHY = ("the current tiles with the uint8 codec (decode_mla triton) decoding e4m3 straight "
               "to bf16 (prmt, shift, mask, NaN-code OR and two bf16 fmas per pair of values) "
               "instead of through float32; triton_fp8 unchanged")
CANDIDATE_TABLES["direct"] = (_DIRECT_WHY, _with_direct(MEASURED_CONFIGS[CANDIDATE_CC]))

# For the 99 KB cards (SM86, SM89, SM120: 101376 B per block), in PORTABLE_CONFIGS' format.
CANDIDATE_TABLES_99KB = {
    "direct": (_DIRECT_WHY.replace("current tiles", "portable tiles"), _with_direct(PORTABLE_CONFIGS)),
    "hp16": ("64 heads x 16 rows: head packing within 99 KB (the 64 x 512 query tile is 64 KB, "
             "a 16-row K tile 16 KB), so each gathered row is dequantised once for 64 heads "
             "instead of twice (32-head tiles); its one-pass decode entry is the shipped one "
             "from 128 tokens (2026-12-03 run), its split and prefill entries were slower",
             {"prefill": (_HP16S2,) + PORTABLE_CONFIGS["prefill"],
              "decode": (_HP16,) + _PORTABLE_DECODE,
              "decode_split": (_HP16,) + PORTABLE_CONFIGS["decode_split"]}),
    "hp16w16": ("as hp16 on 16 warps: the accumulator and the dequantised rows over twice the "
                "threads, at 128 registers a thread (ptxas spills 0.2-1.5 KB; 64 x 32 rows would "
                "need 112-128 KB: over 99 KB)",
                {"prefill": (_HP16W16S2,) + PORTABLE_CONFIGS["prefill"],
                 "decode": (_HP16W16,) + _PORTABLE_DECODE,
                 "decode_split": (_HP16W16,) + PORTABLE_CONFIGS["decode_split"]}),
}


def table_configs(table: dict, kind: str, tokens: int | None = None) -> tuple:
    """``configs_for`` over TABLE (one capability's {kind: configurations}) instead of the
    launch table: a candidate table's configurations for KIND and TOKENS, best first."""
    if kind not in KINDS:
        raise ArgumentError(f"unknown kernel kind {kind!r}; valid: {', '.join(KINDS)}")
    configs = table[kind]
    if tokens is None:
        return configs
    return tuple(c for c in configs if c.get("max_tokens", tokens) >= tokens)
