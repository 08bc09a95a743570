"""Byte offsets of one token in a V4 pool, for the tests that read pools byte by byte
(the kernels compute their own; capdispatch/backends/v4_layout.py states the layout)."""
from __future__ import annotations

from capdispatch.backends.v4_layout import DATA_BYTES, SCALE_BYTES, bytes_per_page, scale_offset


def token_data_offset(loc: int, page_size: int, page_bytes: int | None = None) -> int:
    """Flat byte offset of token ``loc``'s 576 data bytes in a pool."""
    page_bytes = bytes_per_page(page_size) if page_bytes is None else page_bytes
    page, slot = divmod(loc, page_size)
    return page * page_bytes + slot * DATA_BYTES


def token_scale_offset(loc: int, page_size: int, page_bytes: int | None = None) -> int:
    """Flat byte offset of token ``loc``'s 8 scale bytes in a pool."""
    page_bytes = bytes_per_page(page_size) if page_bytes is None else page_bytes
    page, slot = divmod(loc, page_size)
    return page * page_bytes + scale_offset(page_size) + slot * SCALE_BYTES
