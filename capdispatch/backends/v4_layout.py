"""DeepSeek-V4 ("V4") paged KV-cache byte layout, byte-compatible with SGLang 0.5.23: the data
format kv_cache writes and reads, decode_mla and the shared Triton row loader read.

Pure Python on purpose (no torch import) so that registries and tooling can read
the constants without pulling in a tensor library.

One K row is 512 bf16 values: 448 "nope" values followed by 64 "rope" values.

Per token (584 bytes):
  * 576 contiguous data bytes: 448 fp8 e4m3fn nope bytes, then 64 raw bf16 rope
    values (128 bytes);
  * 8 scale bytes: 7 UE8M0 exponents (one per 64-value nope tile, value
    ``2 ** (byte - 127)``) and one pad byte, written as 0.

Per page of P tokens: ``[P x 576 data bytes][P x 8 scale bytes]``, the page
length padded up to a multiple of 576. The pool is a uint8 tensor
``[num_pages, bytes_per_page]``; token slot ``loc`` lives in page ``loc // P``
at slot ``loc % P``.
"""

from __future__ import annotations

from ..errors import ArgumentError, ArgumentTypeError

DIM_NOPE = 448  # fp8-quantised part of a K row
DIM_ROPE = 64  # raw bf16 part of a K row
DIM = DIM_NOPE + DIM_ROPE  # 512 values per K row
TILE = 64  # nope values sharing one scale
NUM_TILES = DIM_NOPE // TILE  # 7 scales per token

ROPE_ELEM_BYTES = 2  # bf16
ROPE_BYTE_OFFSET = DIM_NOPE  # rope starts right after the 448 fp8 bytes
DATA_BYTES = DIM_NOPE + DIM_ROPE * ROPE_ELEM_BYTES  # 576 contiguous bytes per token
SCALE_PAD = 1  # the pad byte after a token's scales (written as 0)
SCALE_BYTES = NUM_TILES + SCALE_PAD  # 7 scales + 1 pad byte
TOKEN_BYTES = DATA_BYTES + SCALE_BYTES  # 584
PAGE_ALIGN = DATA_BYTES  # a page's byte length is padded to a multiple of this

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_EPS = 1e-8  # amax floor before computing the tile scale
UE8M0_BIAS = 127  # scale = 2 ** (byte - UE8M0_BIAS)


def row_bytes(dim_nope: int, dim_rope: int) -> int:
    """Bytes of one token's pool row for a K row of DIM_NOPE fp8 and DIM_ROPE bf16 values:
    the data, one UE8M0 scale per TILE nope values and the pad byte (TOKEN_BYTES at V4's
    DIM_NOPE and DIM_ROPE). Model-shape code sizes a checkpoint's rows with it."""
    return dim_nope + dim_rope * ROPE_ELEM_BYTES + dim_nope // TILE + SCALE_PAD


def _check_page_size(page_size: int) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise ArgumentTypeError(f"page_size must be an int, got {type(page_size).__name__}")
    if page_size < 1:
        raise ArgumentError(f"page_size must be >= 1, got {page_size}")
    return page_size


def scale_offset(page_size: int) -> int:
    """Byte offset of the scale block inside a page (after P x 576 data bytes)."""
    return _check_page_size(page_size) * DATA_BYTES


def min_bytes_per_page(page_size: int) -> int:
    """Bytes a page needs before padding: P x 584."""
    return _check_page_size(page_size) * TOKEN_BYTES


def bytes_per_page(page_size: int) -> int:
    """Padded page length: P x 584 rounded up to a multiple of 576."""
    need = min_bytes_per_page(page_size)
    return -(-need // PAGE_ALIGN) * PAGE_ALIGN
