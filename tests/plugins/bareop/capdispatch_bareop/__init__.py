"""An op declared without a case builder or a size ladder: `dispatch bench` names what
it lacks."""
from capdispatch.backends import TORCH, Backend, Op, SizeArg


def register(registry) -> None:
    registry.add_all((Op("bare_rows", "x [n, d] copied", "bare_rows(x) -> Tensor", reference="torch",
                         size=SizeArg("rows", 0, "x")),),
                     (Backend("bare_rows", "torch", "torch:clone", requires=(TORCH,)),))
