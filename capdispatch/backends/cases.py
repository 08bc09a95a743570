"""What calibration and benchmarks share across ops: a `Case` (one call's inputs checked
against the op's reference) and the comparisons the op tests state.

An op names its case builder on its `Op` (`case="module:function"`); the builder is called
as `builder(size, gen, device, profile, batch=None, layer_state=None)` and returns a `Case`
(or an object with `op`, `size`, `args`, `verify_backend(name, fn)` and
`bind_backend(name, fn)`, when each backend needs its own prepared inputs, as MoE's do).
"""
from __future__ import annotations

from typing import Callable

import attrs

SCALE = 512 ** -0.5
HEADS = 64


@attrs.frozen
class Case:
    op: str
    size: int
    args: tuple
    verify: Callable        # fn -> (ok, detail)

    def bind(self, fn):
        args = self.args
        return lambda: fn(*args)


# --------------------------------------------------------------------------- #
# Comparisons
# --------------------------------------------------------------------------- #
def same_bf16(a, b) -> bool:
    """Bit equality, NaN matched by class."""
    import torch
    a, b = a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16)
    na, nb = (a & 0x7FFF) > 0x7F80, (b & 0x7FFF) > 0x7F80
    return bool(((na == nb) & (na | (a == b))).all())


def attention_errors(got, want):
    """(ok, out relative error, statistics abs error): output relative error <= 1e-2
    (Frobenius), statistics within 1e-3 absolute with the same non-finite entries, a
    finite output: the attention tests' bounds."""
    import torch
    o, ro = got[0].float(), want[0].float()
    rel = ((o - ro).norm() / ro.norm().clamp_min(1e-30)).item()
    stat_err, same_inf = 0.0, True
    for g, w in zip(got[1:], want[1:]):
        fin = torch.isfinite(w)
        same_inf &= bool(torch.equal(torch.isfinite(g), fin)) and bool(torch.equal(g[~fin], w[~fin]))
        if fin.any():
            stat_err = max(stat_err, (g[fin] - w[fin]).abs().max().item())
    ok = rel <= 1e-2 and stat_err <= 1e-3 and same_inf and bool(torch.isfinite(got[0]).all())
    return ok, rel, stat_err


def attention_close(got, want):
    ok, rel, stat_err = attention_errors(got, want)
    return ok, f"out rel err {rel:.1e}, statistics abs err {stat_err:.1e}"


def with_batch(op, args, batch):
    """ARGS with the op's per-batch positions (its `batch_args`) taken from BATCH (another layer's)."""
    if batch is None:
        return args
    from .registry import builtin
    out = list(args)
    for i, t in zip(builtin().ops[op].batch_args, batch):
        out[i] = t
    return tuple(out)


def reference_case(op, size, args, ref):
    # The reference runs when a backend is checked: only the first layer of a forward is.
    def verify(fn):
        if not memo:
            memo.append(ref(*args))
        return attention_close(fn(*args), memo[0])
    memo = []
    return Case(op, size, args, verify)
