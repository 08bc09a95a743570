"""row_scale's calibration and benchmark case (Op.case)."""
from capdispatch.backends.cases import Case


def row_scale_case(n, gen, device, prof, batch=None, layer_state=None) -> Case:
    import torch
    from .kernels import reference
    x = torch.randn(n, 64, generator=gen, device=device)
    w = torch.randn(n, generator=gen, device=device)

    def verify(fn):
        from .canary import row_scale_compare
        c = row_scale_compare(fn(x, w), reference(x, w), (x, w))
        return c.ok, c.detail
    return Case("row_scale", n, (x, w), verify)
