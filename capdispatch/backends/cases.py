"""What calibration and benchmarks share across ops: a `Case` (one call's inputs checked
against the op's reference) and the comparisons the op tests state.

An op names its case builder on its `Op` (`case="module:function"`); the builder is called
as `builder(size, gen, device, profile, batch=None, layer_state=None)` and returns a `Case`
(or an object with `op`, `size`, `args`, `verify_backend(name, fn)` and
`bind_backend(name, fn)`, when each backend needs its own prepared inputs, as MoE's do).

An op names its comparison on its `Op` too (`compare="module:function"`): the function is
called as `compare(got, want, args)` with a backend's results and the reference's on the same
ARGS and returns a `Comparison`; `compared(op, fn, args)` runs both and compares them, and the
rehearsal and the canaries judge a backend by it.
"""
from __future__ import annotations

from typing import Callable, Optional

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
@attrs.frozen
class Comparison:
    """A backend's results against the reference's on the same inputs (what an op's
    `compare` function returns): whether they agree, one line saying how far apart they are
    against the bound, the error figure and its bound (0 and 0 for an exact contract: the
    figure is then the count of differing values), where the worst difference is, and the
    tolerance in words when "bound B" would not say it (several bounds at once)."""
    ok: bool
    detail: str
    error: float
    bound: float
    where: str = ""
    tolerance: str = ""

    def check(self, name: str) -> "Comparison":
        """SELF, or a canary_checks.Mismatch naming NAME when the results differ."""
        if self.ok:
            return self
        from .canary_checks import Mismatch     # imports torch: only when a difference is raised
        raise Mismatch(f"{name}: {self.detail}", max_err=self.error, where=self.where or name,
                       tolerance=self.tolerance or ("exact" if self.bound == 0 else f"bound {self.bound:g}"))


@attrs.frozen
class Compared:
    """One checked call: the backend's result (None for an op that returns nothing) and
    its comparison with the reference."""
    out: object
    comparison: Comparison


def written(op) -> tuple:
    """Positions of the arguments OP writes in place (`Tensor(a!)` parameters other than
    the caller's `out` buffer): an op that returns nothing is judged by them."""
    call = op.call()
    return tuple(i for i, p in enumerate(call.params) if "!" in p.type and p is not call.out)


def compared(op, fn, args, *, ref=None, fn_args=None, registry=None) -> Compared:
    """FN(*FN_ARGS or ARGS) and OP's reference (REF, default its `Op.reference` backend of
    REGISTRY) on the same ARGS, compared by the op's `compare` function. An op that returns
    nothing is compared on the arguments it writes: the reference writes copies, FN the
    caller's, so the caller's state is the backend's."""
    if not op.compare:
        from .registry import RegistryError
        raise RegistryError(f"op {op.name!r} declares no comparison: add compare=\"module:function\" to "
                             f"its Op (compare(got, want, args) -> capdispatch.backends.cases.Comparison)")
    if ref is None:
        if registry is None:
            from .registry import builtin
            registry = builtin()
        ref = registry.backend(op.name, op.reference).load()
    compare = op.load_compare()
    if op.call().returns:
        got = fn(*(args if fn_args is None else fn_args))
        return Compared(got, compare(got, ref(*args), args))
    at = written(op)
    mine = list(args)
    for i in at:
        mine[i] = args[i].clone()
    ref(*mine)
    fn(*(args if fn_args is None else fn_args))
    got, want = tuple(args[i] for i in at), tuple(mine[i] for i in at)
    return Compared(None, compare(got if len(at) != 1 else got[0], want if len(at) != 1 else want[0], args))


def same_bf16(a, b) -> bool:
    """Bit equality, NaN matched by class."""
    import torch
    a, b = a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16)
    na, nb = (a & 0x7FFF) > 0x7F80, (b & 0x7FFF) > 0x7F80
    return bool(((na == nb) & (na | (a == b))).all())


# The attention ops' bounds against the float32 reference: the output's relative (Frobenius)
# error; each element against its row's largest reference value (the Triton kernel under the
# interpreter, bf16 P as on the GPU, stays below 8e-3: one element off by more than 4e-2
# fails, where the norm would average it away); the softmax statistics (max logits, lse)
# within STAT_ATOL absolute, with identical infinities.
ATTENTION_OUT_RTOL = 1e-2
ATTENTION_ROW_RTOL = 4e-2
ATTENTION_TOLERANCE = "out relative 1e-2, per row 4e-2; statistics 1e-3 absolute, identical infinities"


def attention_errors(got, want):
    """(ok, out relative error, statistics abs error): output relative error <= 1e-2
    (Frobenius), statistics within 1e-3 absolute with the same non-finite entries, a
    finite output (the benchmarks' figures; attention_compare is the op's comparison)."""
    import torch
    o, ro = got[0].float(), want[0].float()
    rel = ((o - ro).norm() / ro.norm().clamp_min(1e-30)).item()
    stat_err, same_inf = 0.0, True
    for g, w in zip(got[1:], want[1:]):
        fin = torch.isfinite(w)
        same_inf &= bool(torch.equal(torch.isfinite(g), fin)) and bool(torch.equal(g[~fin], w[~fin]))
        if fin.any():
            stat_err = max(stat_err, (g[fin] - w[fin]).abs().max().item())
    ok = rel <= ATTENTION_OUT_RTOL and stat_err <= 1e-3 and same_inf and bool(torch.isfinite(got[0]).all())
    return ok, rel, stat_err


def attention_compare(got, want, args) -> Comparison:
    """The attention ops' Op.compare (sparse_prefill, decode_mla; results (out, ...statistics),
    the last statistic lse, the one before it max_logits): a finite out of the reference's
    shape within ATTENTION_OUT_RTOL relative and ATTENTION_ROW_RTOL of each row's largest
    value, every statistic within STAT_ATOL absolute with identical infinities. An element
    never written (a NaN-poisoned out) fails as non-finite."""
    from .canary_checks import Mismatch, assert_rel_close, assert_rows_close, assert_stats_close
    if not isinstance(got, (tuple, list)) or len(got) != len(want):
        return Comparison(False, f"{type(got).__name__} of {len(got) if isinstance(got, (tuple, list)) else 1} "
                          f"result(s), the reference returns {len(want)}", float("inf"), ATTENTION_OUT_RTOL,
                          "return value", ATTENTION_TOLERANCE)
    names = ("max_logits", "lse")[max(0, 3 - len(want)):]
    try:
        rel = assert_rel_close(got[0], want[0], ATTENTION_OUT_RTOL, "out")
        row = assert_rows_close(got[0], want[0], ATTENTION_ROW_RTOL, "out")
        for name, g, w in zip(names, got[1:], want[1:]):
            assert_stats_close(g, w, name)
    except Mismatch as e:
        return Comparison(False, str(e), e.max_err, ATTENTION_OUT_RTOL, e.where, e.tolerance)
    return Comparison(True, f"out rel err {rel:.1e} (bound 1e-2), per row {row:.1e} (bound 4e-2), "
                            f"statistics within 1e-3", rel, ATTENTION_OUT_RTOL, "", ATTENTION_TOLERANCE)


def attention_close(got, want):
    """(ok, detail) of attention_compare: the attention ops' calibration check."""
    c = attention_compare(got, want, ())
    return c.ok, c.detail


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
        c = attention_compare(fn(*args), memo[0], args)
        return c.ok, c.detail
    memo = []
    return Case(op, size, args, verify)
