"""A test kernel (tests/test_e4m3_decode.py): BLOCK V4 pool rows stored as bf16 [n, 512]
through triton_common's load_rows (DIRECT=0) or load_rows_direct (DIRECT=1, EMULATE
under the interpreter). Loaded by the test with importlib once per way of building
(compiled or interpreted), as triton_common's env.jit_module loads the toolbox."""
import triton
import triton.language as tl

from capdispatch.backends.triton_common.env import jit_module

_rows = jit_module("v4_rows")
_load_rows = _rows.load_rows
_load_rows_direct = _rows.load_rows_direct
_token_bases = _rows.token_bases
_row_tiles = _rows.row_tiles


@triton.jit
def rows_kernel(pool_ptr, ids_ptr, out_ptr, n, PAGE_SIZE: tl.constexpr, BYTES_PER_PAGE: tl.constexpr,
                DIRECT: tl.constexpr, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = r < n
    ids = tl.load(ids_ptr + r, mask=valid, other=0).to(tl.int64)
    data_base, scale_base = _token_bases(ids, PAGE_SIZE, BYTES_PER_PAGE)
    if DIRECT:
        v = _load_rows_direct(pool_ptr, data_base, scale_base, valid, EMULATE)
    else:
        v = _load_rows(pool_ptr, data_base, scale_base, valid, False)
    _, col = _row_tiles()
    tl.store(out_ptr + r.to(tl.int64)[:, None, None] * 512 + col[None, :, :], v, mask=valid[:, None, None])
