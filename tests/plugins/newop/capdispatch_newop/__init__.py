"""A new op, added as docs/contributing.md says: `row_scale` (each row of x times its
weight), with a torch reference and a second torch backend, its case builder and its size
ladder, declared on the Op. No kernel code is imported here."""
from capdispatch.backends import TORCH, Backend, Op, SizeArg

_PKG = "capdispatch_newop"

OPS = (
    Op("row_scale", "x [n, d] times w [n] per row", "row_scale(x, w) -> Tensor", reference="torch",
       size=SizeArg("rows", 0, "x"), canary=f"{_PKG}.canary:row_scale",
       case=f"{_PKG}.calibration:row_scale_case", sizes=(1, 16, 256), served="prefill"),
)

BACKENDS = (
    Backend("row_scale", "torch", f"{_PKG}.kernels:reference", requires=(TORCH,),
            summary="torch reference (runs anywhere)"),
    Backend("row_scale", "torch_mul", f"{_PKG}.kernels:by_mul", requires=(TORCH,),
            summary="torch, one in-place multiply"),
)


def register(registry) -> None:
    registry.add_all(OPS, BACKENDS)
