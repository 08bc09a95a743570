"""row_scale's calibration and benchmark case (Op.case)."""
from capdispatch.backends.cases import Case


def row_scale_case(n, gen, device, prof, batch=None, layer_state=None) -> Case:
    import torch
    from .kernels import reference
    x = torch.randn(n, 64, generator=gen, device=device)
    w = torch.randn(n, generator=gen, device=device)

    def verify(fn):
        ok = bool(torch.equal(fn(x, w), reference(x, w)))
        return ok, "bit-identical to the reference" if ok else "differs from the reference"
    return Case("row_scale", n, (x, w), verify)
