"""The test plugin's kernels (imported only when a backend is bound)."""
import os
import time

from capdispatch.backends.kv_cache import reference as R


def fp8e4nv(pool, token_ids, page_size, out=None):
    """Compiles a Triton kernel over fp8e4nv for sm_86, as a kernel built for the card
    it runs on would: Triton refuses the type below cc 8.9."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    def widen(x_ptr, y_ptr, BLOCK: tl.constexpr):
        o = tl.arange(0, BLOCK)
        tl.store(y_ptr + o, tl.load(x_ptr + o).to(tl.float32))

    kernel = JITFunction(widen)   # compiled, never interpreted: TRITON_INTERPRET does not apply
    triton.compile(ASTSource(fn=kernel, signature={"x_ptr": "*fp8e4nv", "y_ptr": "*fp32", "BLOCK": "constexpr"},
                             constexprs={"BLOCK": 64}), target=GPUTarget("cuda", 86, 32))
    raise AssertionError("Triton compiled fp8e4nv for sm_86")


def wrong(pool, token_ids, page_size, out=None):
    out = R.kv_dequant(pool, token_ids, page_size, out=out)
    flat = out.view(-1)
    flat[::1000] = flat[::1000].float().add(1.0).bfloat16()
    return out


def hang(pool, token_ids, page_size, out=None):
    while True:
        time.sleep(0.05)


def abort(pool, token_ids, page_size, out=None):
    os.abort()
