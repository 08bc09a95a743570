"""row_scale's Triton kernels for the offline compile matrix (Op.compile_jobs)."""
from capdispatch.backends.compile_matrix import Job

_K = "capdispatch_newop.triton_kernels"


def jobs(target) -> list:
    from .triton_kernels import BLOCK_D, COMPILE_SIGNATURES
    return [Job("row_scale", f"{_K}:_row_scale_kernel", f"BLOCK_D={BLOCK_D}",
                dict(COMPILE_SIGNATURES["_row_scale_kernel"]), dict(BLOCK_D=BLOCK_D), num_warps=4)]
