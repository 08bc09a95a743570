"""row_scale's torch reference (imported only when a backend is bound): a torch custom op
whose schema and fake implementation come from the Op's declaration."""
from capdispatch.backends.torch_ops import custom_op

from . import OPS


def row_scale(x, w, *, checks=True):
    return x * w[:, None]


reference = custom_op(OPS[0], "torch", row_scale)
