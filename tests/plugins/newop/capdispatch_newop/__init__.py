"""A new op, added as docs/contributing.md says: `row_scale` (each row of x times its
weight), with a torch reference and a Triton backend, its typed signature and result, canary,
comparison, case builder, size ladder and compile jobs declared on the Op. No kernel code is imported here."""
from capdispatch.backends import TORCH, TRITON, Backend, Op, Out, SizeArg, TritonTarget

_PKG = "capdispatch_newop"

OPS = (
    Op("row_scale", "x [n, d] times w [n] per row", "row_scale(Tensor x, Tensor w) -> Tensor",
       outputs=(Out(("x.0", "x.1"), "x"),), reference="torch", size=SizeArg("rows", 0, "x"),
       canary=f"{_PKG}.canary:row_scale", compare=f"{_PKG}.canary:row_scale_compare",
       case=f"{_PKG}.calibration:row_scale_case",
       sizes=(1, 16, 256), served="prefill", compile_jobs=f"{_PKG}.compile_jobs:jobs"),
)

BACKENDS = (
    Backend("row_scale", "torch", f"{_PKG}.kernels:reference", requires=(TORCH,),
            summary="torch reference (runs anywhere)"),
    Backend("row_scale", "triton", f"{_PKG}.triton_kernels:row_scale",
            requires=(TORCH, TRITON, TritonTarget("8.0")), summary="Triton, one program per row block"),
)


def register(registry) -> None:
    registry.add_all(OPS, BACKENDS)
