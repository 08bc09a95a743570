"""row_scale's canary (Op.canary): a small problem checked bit-exactly against the
reference. Imports torch: loaded only when a backend is verified."""
import torch

from capdispatch.backends.canary_checks import Mismatch

from .kernels import reference


def row_scale(fn, device, seed: int, backend: str = "") -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 64, generator=gen).to(device)
    w = torch.randn(37, generator=gen).to(device)
    got, want = fn(x, w), reference(x, w)
    if not torch.equal(got, want):
        raise Mismatch("row_scale differs from the reference", where="output", tolerance="bit-exact")
    return {"tolerance": "bit-exact", "checked": x.shape[0]}
