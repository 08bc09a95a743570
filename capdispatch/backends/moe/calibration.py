"""MoE's calibration and benchmark case (Op.case): each backend gets its own prepared copy
of one random weight set."""
from __future__ import annotations

from ..cases import Comparison

MOE_TOPK, MOE_SWIGLU_LIMIT = 6, 10.0
MOE_TOL_NORM = 1.5e-2


def moe_compare(got, want, args):
    """MoE's Op.compare: a finite output within MOE_TOL_NORM relative (Frobenius) error of the
    reference's."""
    import torch
    w = want.float()
    nrm = ((got.float() - w).norm() / w.norm().clamp_min(1e-30)).item()
    ok = bool(torch.isfinite(got).all()) and nrm <= MOE_TOL_NORM
    return Comparison(ok, f"norm rel err {nrm:.1e} (bound {MOE_TOL_NORM:g})", nrm, MOE_TOL_NORM)


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
