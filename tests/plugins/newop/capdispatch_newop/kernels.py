"""row_scale's kernels (imported only when a backend is bound)."""


def reference(x, w):
    return x * w[:, None]


def by_mul(x, w):
    return x.clone().mul_(w.unsqueeze(1))
