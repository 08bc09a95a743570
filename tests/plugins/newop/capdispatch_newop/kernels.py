"""row_scale's kernels (imported only when a backend is bound)."""


def reference(x, w):
    return x * w[:, None]

