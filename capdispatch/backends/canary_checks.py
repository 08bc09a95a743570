"""Comparisons shared by the canaries and the tests: each failure is a `Mismatch`
that says which output, how far off and where.

Imports torch: import this module only where outputs are compared.
"""
from __future__ import annotations

import torch

from ..errors import CapdispatchError
from .registry import builtin

STAT_ATOL = 1e-3     # softmax statistics (max logits, lse) in fp32: absolute


class Mismatch(CapdispatchError, AssertionError):
    """An output differs from the reference beyond its tolerance."""

    def __init__(self, message: str, *, max_err: float | None = None, where: str = "",
                 tolerance: str = ""):
        super().__init__(message)
        self.max_err, self.where, self.tolerance = max_err, where, tolerance


def where_of(mask, name: str) -> str:
    """'name[i, j, ...]' of the first True element of MASK (or of its largest value)."""
    flat = int(mask.reshape(-1).float().argmax()) if mask.dtype != torch.bool else \
        int(mask.reshape(-1).nonzero()[0]) if bool(mask.any()) else 0
    idx = []
    for n in reversed(mask.shape):
        idx.append(flat % n)
        flat //= n
    return f"{name}[{', '.join(str(i) for i in reversed(idx))}]"


def rel_err(got, want):
    g, w = got.float(), want.float()
    return ((g - w).norm() / w.norm().clamp_min(1e-30)).item()


def assert_rel_close(got, want, rtol: float, name: str) -> float:
    """Relative (Frobenius) error of GOT against WANT <= RTOL; both finite."""
    g, w = got.float().cpu(), want.float().cpu()
    if g.shape != w.shape:
        raise Mismatch(f"{name}: shape {tuple(g.shape)}, want {tuple(w.shape)}", where=name)
    bad = ~torch.isfinite(g)
    if bool(bad.any()):
        raise Mismatch(f"{name}: {int(bad.sum())} non-finite values", max_err=float("inf"),
                       where=where_of(bad, name), tolerance=f"relative {rtol:g}")
    e = rel_err(g, w)
    if not e <= rtol:
        raise Mismatch(f"{name}: relative error {e:.3g} > {rtol:g}", max_err=e,
                       where=where_of((g - w).abs(), name), tolerance=f"relative {rtol:g}")
    return e


def assert_rows_close(got, want, rtol: float, name: str) -> float:
    """Every element within RTOL of its row's largest reference magnitude (last dim), so
    one wrong element is caught where a norm over the whole output would average it
    away; a row whose reference is all zeros must be exactly zero."""
    g, w = got.float().cpu(), want.float().cpu()
    d = (g - w).abs().nan_to_num(float("inf"))
    scale = w.abs().amax(dim=-1, keepdim=True)
    ratio = torch.where(scale > 0, d / scale.clamp_min(1e-30), d * float("inf")).nan_to_num(0.0)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    if not worst <= rtol:
        raise Mismatch(f"{name}: an element is off by {worst:.3g} of its row's largest value (> {rtol:g})",
                       max_err=float(d.max()), where=where_of(ratio, name),
                       tolerance=f"{rtol:g} of the row's largest value")
    return worst


def assert_stats_close(got, want, msg, atol=STAT_ATOL):
    """fp32 statistics: identical infinities, |got - want| <= ATOL where finite."""
    g, w = got.float().cpu(), want.float().cpu()
    fin = torch.isfinite(w)
    tol = f"absolute {atol:g}, identical infinities"
    differ = torch.isfinite(g) != fin
    if bool(differ.any()):
        raise Mismatch(f"{msg}: finite pattern differs", max_err=float("inf"),
                       where=where_of(differ, msg), tolerance=tol)
    inf_differ = ~fin & (g != w)
    if bool(inf_differ.any()):
        raise Mismatch(f"{msg}: infinities differ: {g[~fin][:8]} vs {w[~fin][:8]}", max_err=float("inf"),
                       where=where_of(inf_differ, msg), tolerance=tol)
    if fin.any():
        d = torch.where(fin, (g - w).abs(), torch.zeros_like(g))
        err = d.max().item()
        if not err <= atol:
            raise Mismatch(f"{msg}: max abs error {err:.3g} > {atol}", max_err=err,
                           where=where_of(d, msg), tolerance=tol)


def bf16_bits(t):
    return t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF


def assert_bf16_bits_equal(got, want, name: str) -> None:
    """Bit equality of bf16 tensors; a NaN matches any NaN."""
    g, w = bf16_bits(got.cpu()), bf16_bits(want.cpu())
    nan_g, nan_w = (g & 0x7FFF) > 0x7F80, (w & 0x7FFF) > 0x7F80
    bad = (nan_g != nan_w) | (~nan_w & (g != w))
    if bool(bad.any()):
        i = where_of(bad, name)
        gv, wv = got.float().cpu().reshape(-1), want.float().cpu().reshape(-1)
        k = int(bad.reshape(-1).nonzero()[0])
        raise Mismatch(f"{name}: {int(bad.sum())} of {bad.numel()} values differ from the reference "
                       f"bits, first {i}: {gv[k].item()!r}, want {wv[k].item()!r}",
                       max_err=float((gv - wv).abs().nan_to_num(float("inf"))[bad.reshape(-1)].max()),
                       where=i, tolerance="bit-exact (NaN matches NaN)")


def assert_bytes_equal(got, want, name: str) -> None:
    bad = got.cpu() != want.cpu()
    if bool(bad.any()):
        raise Mismatch(f"{name}: {int(bad.sum())} of {bad.numel()} bytes differ from the reference",
                       max_err=float(int(bad.sum())), where=where_of(bad, name), tolerance="byte-exact")


def compare_as_declared(op: str, got, want, args, name: str, **how):
    """OP's declared comparison (`Op.compare`) of GOT with the reference's WANT on ARGS (HOW:
    the keywords that comparison takes, such as MoE's backend), or a Mismatch naming NAME:
    a canary judges a backend by the comparison the rehearsal and calibration use."""
    return builtin().ops[op].load_compare()(got, want, args, **how).check(name)
