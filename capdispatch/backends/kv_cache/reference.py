"""Torch backend for the DeepSeek-V4 paged KV cache (quantise-and-store, gather-and-dequantise).

Vectorised torch only (no per-token Python work), so it runs on any device torch
supports. It is the numerical reference the Triton kernels are tested against.

Encode (per 64-value nope tile, all in float32):
    scale_exp = ceil(log2(max(amax, 1e-8) / 448))        -> stored as byte scale_exp + 127
    code      = float8_e4m3fn(clamp(x / 2**scale_exp, -448, 448))   (torch's RNE cast)
Decode:
    fp8 code -> float32, times 2**(byte - 127) built from the exponent bits
    (byte 0 -> scale 0.0, byte 255 -> +inf, as SGLang's torch reference), -> bf16.
Rope values are copied as raw bf16 bits both ways.

Validation is shared with the Triton backend (``check_quant_args`` /
``check_dequant_args``); it is shape/dtype/device only and never synchronises,
so token slots are NOT range-checked (out-of-range slots raise an indexing
error here and are undefined behaviour in the Triton kernels).
"""

from __future__ import annotations

import torch

from ...errors import ArgumentError
from ..arg_checks import dtype_in, index_dtype, same_device, tensor, unit_last_stride
from ..v4_layout import (
    DATA_BYTES,
    DIM,
    DIM_NOPE,
    FP8_MAX,
    NUM_TILES,
    SCALE_BYTES,
    SCALE_EPS,
    TILE,
    UE8M0_BIAS,
    bytes_per_page,
    min_bytes_per_page,
)

__all__ = [
    "kv_quant",
    "kv_dequant",
    "new_pool",
    "check_quant_args",
    "check_dequant_args",
]


# --------------------------------------------------------------------------- #
# Argument checks (shared with triton_kernels.py)
# --------------------------------------------------------------------------- #
def _pool_as_u8(pool: torch.Tensor, page_size: int) -> torch.Tensor:
    """Reinterpret the pool's bytes as uint8 [num_pages, page_bytes] and check its size."""
    tensor(pool, "pool")
    if pool.dim() != 2:
        raise ArgumentError(f"pool must be 2-D [num_pages, bytes_per_page], got shape {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ArgumentError("pool must be contiguous")
    # The pool may be exposed with another dtype (e.g. bf16) over the same bytes.
    u8 = pool if pool.dtype == torch.uint8 else pool.view(torch.uint8)
    need = min_bytes_per_page(page_size)
    if u8.shape[1] < need:
        raise ArgumentError(
            f"pool rows hold {u8.shape[1]} bytes but page_size={page_size} needs >= {need} "
            f"(layout.bytes_per_page gives {bytes_per_page(page_size)})"
        )
    return u8


def _index_1d(idx: torch.Tensor, name: str, n: int | None, device: torch.device) -> torch.Tensor:
    tensor(idx, name)
    if idx.dim() != 1:
        raise ArgumentError(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
    index_dtype(idx, name)
    if n is not None and idx.shape[0] != n:
        raise ArgumentError(f"{name} has {idx.shape[0]} entries, expected {n}")
    same_device(idx, name, device, "pool")
    return idx.contiguous()


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def check_quant_args(k: torch.Tensor, pool: torch.Tensor, loc: torch.Tensor, page_size: int,
                     checks: bool = True):
    """Validate kv_quant arguments; return (k with unit inner stride, uint8 pool view, contiguous loc).
    ``checks=False`` (serving, inputs known good) only normalises."""
    if not checks:
        return (k if k.stride(1) == 1 else k.contiguous()), _as_u8(pool), _contiguous(loc)
    u8 = _pool_as_u8(pool, page_size)
    tensor(k, "k")
    if k.dim() != 2 or k.shape[1] != DIM:
        raise ArgumentError(f"k must be [n, {DIM}], got shape {tuple(k.shape)}")
    dtype_in(k, "k", (torch.bfloat16,))
    same_device(k, "k", u8.device, "pool")
    if k.shape[0] > 0 and k.stride(1) != 1:
        k = k.contiguous()
    loc = _index_1d(loc, "loc", k.shape[0], u8.device)
    return k, u8, loc


def check_dequant_args(pool: torch.Tensor, token_ids: torch.Tensor, page_size: int, out,
                       checks: bool = True):
    """Validate kv_dequant arguments; return (uint8 pool view, contiguous ids, out or None).
    ``checks=False`` (serving, inputs known good) only normalises."""
    if not checks:
        return _as_u8(pool), _contiguous(token_ids), out
    u8 = _pool_as_u8(pool, page_size)
    ids = _index_1d(token_ids, "token_ids", None, u8.device)
    n = ids.shape[0]
    if out is not None:
        tensor(out, "out")
        if tuple(out.shape) != (n, 1, DIM):
            raise ArgumentError(f"out must have shape ({n}, 1, {DIM}), got {tuple(out.shape)}")
        dtype_in(out, "out", (torch.bfloat16,))
        same_device(out, "out", u8.device, "pool")
        unit_last_stride(out, "out")
    return u8, ids, out


def _page_views(u8: torch.Tensor, page_size: int, words: bool = False):
    """[num_pages, P, 576] data view and [num_pages, P, 8] scale view over the pool bytes.

    With ``words=True`` the views are int64 ([.., 72] and [.., 1]) when the row
    length allows it: scattering/gathering 8-byte words instead of single bytes
    makes the torch backend ~an order of magnitude faster on GPU.
    """
    num_pages = u8.shape[0]
    data_end = page_size * DATA_BYTES
    data = u8[:, :data_end].view(num_pages, page_size, DATA_BYTES)
    scales = u8[:, data_end : data_end + page_size * SCALE_BYTES].view(num_pages, page_size, SCALE_BYTES)
    if words and u8.shape[1] % 8 == 0:
        data, scales = data.view(torch.int64), scales.view(torch.int64)
    return data, scales


def _pow2_from_exponent_field(field: torch.Tensor) -> torch.Tensor:
    """float32 whose exponent field is ``field`` and mantissa 0: exactly 2**(field-127) for
    1 <= field <= 254, 0.0 for field 0 and +inf for 255 (no libm exp2 rounding involved)."""
    return (field.to(torch.int32) << 23).view(torch.float32)


# --------------------------------------------------------------------------- #
# Public ops
# --------------------------------------------------------------------------- #
def kv_quant(k: torch.Tensor, pool: torch.Tensor, loc: torch.Tensor, page_size: int, *,
             checks: bool = True) -> None:
    """Quantise bf16 K rows ``k`` [n, 512] and write them into ``pool`` at token slots ``loc``.

    Writes each token's 576 data bytes and 8 scale bytes (pad byte 0) in place;
    no other pool byte is touched. Duplicate slots in ``loc`` give an unspecified winner.
    ``checks=False`` skips argument validation (check_quant_args).
    """
    k, u8, loc = check_quant_args(k, pool, loc, page_size, checks)
    n = k.shape[0]
    if n == 0:
        return

    x = k[:, :DIM_NOPE].float().view(n, NUM_TILES, TILE)
    amax = x.abs().amax(dim=-1).clamp_min(SCALE_EPS)
    # SGLang's formula, evaluated in float32.
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).to(torch.int32)  # [n, 7]
    # x / 2**exp is exact in float32; divide by a bit-built power of two.
    scaled = x / _pow2_from_exponent_field(exp + UE8M0_BIAS).unsqueeze(-1)
    # Stage in float32 and let torch round (RNE) to e4m3fn; clamp first so it saturates at 448.
    codes = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    data = torch.cat([codes.view(n, DIM_NOPE), k[:, DIM_NOPE:].contiguous().view(torch.uint8)], dim=1)
    scale_row = torch.zeros((n, SCALE_BYTES), dtype=torch.uint8, device=k.device)
    scale_row[:, :NUM_TILES] = (exp + UE8M0_BIAS).to(torch.uint8)

    loc = loc.long()
    page, slot = loc // page_size, loc % page_size
    data_view, scale_view = _page_views(u8, page_size, words=True)
    # index_put_ on views of the pool: in place, as bytes or as 8-byte words.
    data_view[page, slot] = data.view(data_view.dtype)
    scale_view[page, slot] = scale_row.view(scale_view.dtype)


def kv_dequant(
    pool: torch.Tensor,
    token_ids: torch.Tensor,
    page_size: int,
    out: torch.Tensor | None = None,
    *,
    checks: bool = True,
) -> torch.Tensor:
    """Gather token slots ``token_ids`` from ``pool`` and dequantise them to bf16 [n, 1, 512].

    ``out`` (optional) must be bf16 [n, 1, 512] with a unit-stride last dim; any
    dim-0 stride is honoured (e.g. a slice of a larger workspace). Returns ``out``.
    ``checks=False`` skips argument validation (check_dequant_args).
    """
    u8, ids, out = check_dequant_args(pool, token_ids, page_size, out, checks)
    n = ids.shape[0]
    if out is None:
        out = torch.empty((n, 1, DIM), dtype=torch.bfloat16, device=u8.device)
    if n == 0:
        return out

    ids = ids.long()
    page, slot = ids // page_size, ids % page_size
    data_view, scale_view = _page_views(u8, page_size, words=True)
    data = data_view[page, slot].view(torch.uint8)  # [n, 576] gathered copy
    scale = _pow2_from_exponent_field(scale_view[page, slot].view(torch.uint8)[:, :NUM_TILES])  # [n, 7]

    vals = data[:, :DIM_NOPE].view(torch.float8_e4m3fn).float().view(n, NUM_TILES, TILE)
    out[:, 0, :DIM_NOPE] = (vals * scale.unsqueeze(-1)).view(n, DIM_NOPE).to(torch.bfloat16)
    out[:, 0, DIM_NOPE:] = data[:, DIM_NOPE:].contiguous().view(torch.bfloat16)
    return out


def new_pool(num_pages: int, page_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Zero-filled uint8 pool [num_pages, bytes_per_page(page_size)]."""
    return torch.zeros((num_pages, bytes_per_page(page_size)), dtype=torch.uint8, device=device)


# Custom ops (backends/torch_ops.py): what the registry binds.
from ..torch_ops import custom_op  # noqa: E402
from . import OPS  # noqa: E402

op_kv_quant = custom_op(OPS[0], "torch", kv_quant)
op_kv_dequant = custom_op(OPS[1], "torch", kv_dequant)
