"""MoE's calibration and benchmark case (Op.case): each backend gets its own prepared copy
of one random weight set."""
from __future__ import annotations

from typing import Optional

import attrs

from ..cases import Comparison

MOE_TOPK, MOE_SWIGLU_LIMIT = 6, 10.0


@attrs.frozen
class MoeTolerance:
    """A MoE backend's bound against the reference: the output's norm-relative (Frobenius) error,
    its largest error relative to the reference's largest magnitude (None: unbounded), and the
    activation quantisation the reference applies for it (R.moe's act_quant; None: bf16)."""
    norm: float
    max: Optional[float] = None
    act_quant: Optional[str] = None


# The bound when no backend is named (the rehearsal and calibration, against the bf16 reference).
MOE_TOLERANCE = MoeTolerance(1.5e-2)
MOE_TOL_NORM = MOE_TOLERANCE.norm
# Per backend, as tests/test_moe.py measured them: capdispatch's own kernels; the MXFP8-activation
# (W4A8) kernels against the MXFP8 reference; any other (W4A16) kernel MOE_OTHER_TOLERANCE.
MOE_TOLERANCES = {
    "torch": MoeTolerance(2e-3, 1e-2),
    "triton_w4a16": MoeTolerance(2e-3, 1e-2),
    "flashinfer_cutlass_w4a8": MoeTolerance(4e-2, 1e-1, "mxfp8"),
    "flashinfer_trtllm_w4a8": MoeTolerance(4e-2, 1e-1, "mxfp8"),
}
MOE_OTHER_TOLERANCE = MoeTolerance(1.5e-2, 3e-2)


def moe_tolerance(backend: str = "") -> MoeTolerance:
    """BACKEND's bound (MOE_TOLERANCES); "" names none: MOE_TOLERANCE."""
    return MOE_TOLERANCES.get(backend, MOE_OTHER_TOLERANCE) if backend else MOE_TOLERANCE


def moe_compare(got, want, args, backend: str = "") -> Comparison:
    """MoE's Op.compare: a finite output of the reference's shape, exactly 0 for a token whose
    every route is masked (ARGS[3] ids all < 0), within moe_tolerance(BACKEND) of WANT (the
    reference at that tolerance's act_quant)."""
    import torch
    from ..canary_checks import where_of
    tol = moe_tolerance(backend)
    words = f"norm-relative {tol.norm:g}" + ("" if tol.max is None else f", max-relative {tol.max:g}")
    if tuple(got.shape) != tuple(want.shape):
        return Comparison(False, f"shape {tuple(got.shape)}, reference {tuple(want.shape)}", float("inf"),
                          tol.norm, "out", words)
    g, w = got.float().cpu(), want.float().cpu()
    bad = ~torch.isfinite(g)
    if bool(bad.any()):
        return Comparison(False, f"{int(bad.sum())} non-finite values (unwritten or overflow)", float("inf"),
                          tol.norm, where_of(bad, "out"), words)
    dead = (args[3].cpu() < 0).all(dim=1)
    if bool((g[dead] != 0).any()):
        row = int(dead.nonzero()[((g[dead] != 0).any(dim=1)).nonzero()[0]])
        return Comparison(False, "a token whose every route is masked is not exactly 0",
                          float(g[dead].abs().max()), tol.norm, f"out[{row}, :]", "exactly 0")
    d = (g - w).abs()
    nrm = float(d.norm() / w.norm().clamp_min(1e-30))
    mx = float(d.max() / w.abs().max().clamp_min(1e-30)) if d.numel() else 0.0
    ok = nrm <= tol.norm and (tol.max is None or mx <= tol.max)
    detail = f"norm rel err {nrm:.1e} (bound {tol.norm:g})"
    if tol.max is not None:
        detail += f", max rel err {mx:.1e} (bound {tol.max:g})"
    return Comparison(ok, detail, nrm, tol.norm, "" if ok else where_of(d, "out"), words)


def copy_weights(w):
    """A copy a backend may re-lay out in place (`prepare`) without touching the original."""
    from .weights import MoeWeights
    return MoeWeights(w.w13.clone(), w.w13_scale.clone(), w.w2.clone(), w.w2_scale.clone(),
                      swiglu_limit=w.swiglu_limit)


class MoeCase:
    """MoE weights are laid out per backend (`prepare`), so the case hands each backend
    its own prepared copy of one random weight set."""

    def __init__(self, T, gen, device, prof, batch=None, layer_state=None):
        import torch
        from . import reference as R
        E, H, I = prof["moe_experts"], prof["moe_hidden"], prof["moe_intermediate"]
        K, total = prof.get("moe_topk", MOE_TOPK), prof.get("moe_experts_total", E)
        self.op, self.size = "moe", T
        # The reference's weight and routing draws run on the CPU: a CPU generator, seeded
        # from the caller's, then the tensors move to DEVICE.
        cpu = torch.Generator().manual_seed(
            int(torch.randint(0, 2 ** 62, (1,), generator=gen, device=gen.device).item()))
        # A layer's weights do not depend on the size: LAYER_STATE (a dict kept by the caller
        # for one layer across sizes) holds them and their per-backend layouts.
        state = {} if layer_state is None else layer_state
        if "base" not in state:
            state["base"] = R.random_weights(E, H, I, gen=cpu, device=device,
                                             swiglu_limit=prof.get("swiglu_limit", MOE_SWIGLU_LIMIT))
            state["prepared"] = {}
        self.base = state["base"]
        self.x = torch.randn(T, H, generator=cpu).bfloat16().to(device)
        # Routes over every expert of the model, skewed as PROFILE says; under EP the routes to
        # experts this rank does not hold are -1 (the rank holds the first E).
        self.tw, ids = R.random_routing(T, min(K, total), total, gen=cpu, skew=prof.get("route_skew", 0.0))
        self.ids = torch.where(ids < E, ids, torch.full_like(ids, -1)).to(device)
        self.tw = self.tw.to(device)
        self._want = None
        self._prepared = state["prepared"]
        self.args = (self.x, self.base, self.tw, self.ids)

    def weights_for(self, backend: str):
        from . import prepare
        if backend not in self._prepared:
            w = self.base if backend in ("torch", "triton_w4a16") else copy_weights(self.base)
            prepare(w, backend)
            self._prepared[backend] = w
        return self._prepared[backend]

    @property
    def want(self):
        """The reference output, computed when a backend is first checked."""
        if self._want is None:
            from . import reference as R
            self._want = R.moe(self.x, self.base, self.tw, self.ids)
        return self._want

    def verify_backend(self, backend, fn):
        c = moe_compare(fn(self.x, self.weights_for(backend), self.tw, self.ids), self.want,
                        (self.x, self.base, self.tw, self.ids))
        return c.ok, c.detail

    def bind_backend(self, backend, fn):
        x, w, tw, ids = self.x, self.weights_for(backend), self.tw, self.ids
        return lambda: fn(x, w, tw, ids)
