"""Routed-expert weights: packed MXFP4 with E8M0 scales, kept at checkpoint dtypes.

DeepSeek-V4 checkpoint layout (per MoE layer, E local experts, hidden H,
intermediate I; SGLang 0.5.23 ``Fp8Config`` fp4-experts path):

  w13        uint8 [E, 2I, H/2]   rows 0..I-1 = gate (w1), rows I..2I-1 = up (w3);
                                  two e2m1 codes per byte, element 2j in the LOW
                                  nibble, element 2j+1 in the high nibble
  w13_scale  uint8 [E, 2I, H/32]  E8M0: value 2**(byte - 127), byte 255 = NaN
  w2         uint8 [E, H, I/2]
  w2_scale   uint8 [E, H, I/32]

Memory discipline: nothing here ever holds a dequantised or float32
copy. ``prepare(weights, backend)`` rewrites the packed bytes into the layout a
backend consumes, once, after loading, one expert at a time and IN PLACE (the
same storage, at most one expert's bytes of scratch), so the bytes held per
expert equal the packed size before and after:
``bytes_per_expert() == packed_bytes_per_expert(H, I) == 3*H*I*(1/2 + 1/32)``.
Per-layer constants a backend needs (a unit global scale, the per-expert clamp
limit as a float32 [E] vector) live in ``aux`` and are reported by
``aux_bytes()`` (8 bytes per expert at most), never mixed into the weight count.
``scale_max``, the largest E8M0 byte of both scale tensors, is read once when the
record is built: the Triton decode takes a shorter path when it is at most
``FOLD_SCALE_MAX`` (triton_kernels: 2**126 folded into each scale).

This module imports torch lazily (only inside functions that take tensors) so
importing the package stays torch-free.
"""
from __future__ import annotations

import importlib
from typing import Optional

from ...errors import ArgumentError, ArgumentTypeError, CapdispatchError

GROUP = 32                 # MXFP4 block: one E8M0 scale per 32 weights
FOLD_SCALE_MAX = 128       # largest E8M0 byte whose scale times 2**126 is a bf16 number (2**127)
CHECKPOINT = "checkpoint"  # layout tag of unprepared weights

# Which layout each backend consumes, and the function that produces it from
# the checkpoint layout ("module:function", imported only when preparing).
LAYOUTS = {
    "torch": (CHECKPOINT, None),
    "triton_w4a16": (CHECKPOINT, None),
    "flashinfer_cutlass_w4a8": ("flashinfer_cutlass_sm120",
                                "capdispatch.backends.moe.flashinfer:prepare_cutlass_w4a8"),
    "flashinfer_trtllm_w4a8": ("flashinfer_trtllm",
                               "capdispatch.backends.moe.flashinfer:prepare_trtllm_w4a8"),
    "flashinfer_cutlass_w4a16": ("flashinfer_cutlass_sm90",
                                 "capdispatch.backends.moe.flashinfer:prepare_cutlass_w4a16"),
    "marlin_w4a16": ("marlin", "capdispatch.backends.moe.sglang_marlin:prepare_marlin"),
}


def packed_bytes_per_expert(hidden: int, intermediate: int) -> int:
    """4 bits per weight plus one E8M0 byte per 32 weights, for w13 and w2."""
    n = 3 * hidden * intermediate            # 2I*H (w13) + H*I (w2) weights
    return n // 2 + n // GROUP


class LayoutError(CapdispatchError, ValueError):
    """Weights are not in the layout the called backend consumes."""


class MoeWeights:
    """One MoE layer's local experts. Mutable only through ``prepare``."""

    __slots__ = ("w13", "w13_scale", "w2", "w2_scale", "num_experts", "hidden", "intermediate", "scale_max",
                 "swiglu_limit", "layout", "aux", "__weakref__")

    def __init__(self, w13, w13_scale, w2, w2_scale, *, swiglu_limit: Optional[float] = None):
        import torch

        def u8(name, t):
            if not isinstance(t, torch.Tensor):
                raise ArgumentTypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dtype in (torch.int8, getattr(torch, "float8_e8m0fnu", None)):
                t = t.view(torch.uint8)        # reinterpretation, no copy
            if t.dtype != torch.uint8:
                raise ArgumentTypeError(f"{name} must hold packed bytes (uint8/int8/float8_e8m0fnu), got {t.dtype}: "
                                "MXFP4 weights and E8M0 scales are never stored widened")
            if t.dim() != 3 or not t.is_contiguous():
                raise ArgumentError(f"{name} must be a contiguous 3-D tensor, got shape {tuple(t.shape)}")
            return t

        w13, w13_scale, w2, w2_scale = (u8("w13", w13), u8("w13_scale", w13_scale),
                                        u8("w2", w2), u8("w2_scale", w2_scale))
        E, two_i, h_half = w13.shape
        H, I = 2 * h_half, two_i // 2
        want = {"w13": (E, 2 * I, H // 2), "w13_scale": (E, 2 * I, H // GROUP),
                "w2": (E, H, I // 2), "w2_scale": (E, H, I // GROUP)}
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            if tuple(t.shape) != want[name]:
                raise ArgumentError(f"{name} has shape {tuple(t.shape)}, expected {want[name]} "
                                 f"(E={E}, H={H}, I={I})")
        if two_i % 2 or H % GROUP or I % GROUP:
            raise ArgumentError(f"H={H} and I={I} must be multiples of {GROUP}")
        devices = {t.device for t in (w13, w13_scale, w2, w2_scale)}
        if len(devices) != 1:
            raise ArgumentError(f"weights live on several devices: {sorted(map(str, devices))}")
        if swiglu_limit is not None and not float(swiglu_limit) > 0:
            raise ArgumentError(f"swiglu_limit must be positive or None, got {swiglu_limit}")
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale, w2, w2_scale
        self.num_experts, self.hidden, self.intermediate = E, H, I
        # One read of the scales (a device sync where they live on a GPU), at load time.
        self.scale_max = int(torch.maximum(w13_scale.max(), w2_scale.max())) if E else 0
        self.swiglu_limit = None if swiglu_limit is None else float(swiglu_limit)
        self.layout = CHECKPOINT
        self.aux = {}

    # The record as a custom op's arguments (a schema has no records; backends/signature.py):
    # PARTS is their schema, parts() their values, from_parts(*parts) the record again.
    PARTS = ("Tensor w13, Tensor w13_scale, Tensor w2, Tensor w2_scale, int num_experts, int hidden, "
             "int intermediate, int scale_max, float? swiglu_limit, str layout, str[] aux_keys, Tensor[] aux")

    def parts(self) -> tuple:
        return (self.w13, self.w13_scale, self.w2, self.w2_scale, self.num_experts, self.hidden,
                self.intermediate, self.scale_max, self.swiglu_limit, self.layout, list(self.aux),
                list(self.aux.values()))

    @classmethod
    def from_parts(cls, w13, w13_scale, w2, w2_scale, num_experts, hidden, intermediate, scale_max, swiglu_limit,
                   layout, aux_keys, aux):
        """The record again from its parts (no checks: the parts came from one). """
        w = cls.__new__(cls)
        w.w13, w.w13_scale, w.w2, w.w2_scale = w13, w13_scale, w2, w2_scale
        w.num_experts, w.hidden, w.intermediate, w.scale_max = num_experts, hidden, intermediate, scale_max
        w.swiglu_limit, w.layout, w.aux = swiglu_limit, layout, dict(zip(aux_keys, aux))
        return w

    # ------------------------------------------------------------------ #
    @property
    def device(self):
        return self.w13.device

    def tensors(self):
        return (self.w13, self.w13_scale, self.w2, self.w2_scale)

    def bytes_per_expert(self) -> float:
        """Bytes of device/host memory the expert weights hold, per expert: every
        distinct storage behind the four weight tensors, counted whole."""
        seen, total = set(), 0
        for t in self.tensors():
            s = t.untyped_storage()
            key = (s.data_ptr(), t.device)
            if key not in seen:
                seen.add(key)
                total += s.nbytes()
        return total / self.num_experts

    def packed_bytes_per_expert(self) -> int:
        return packed_bytes_per_expert(self.hidden, self.intermediate)

    def aux_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.aux.values())

    def require_layout(self, layout: str, backend: str) -> None:
        if self.layout != layout:
            raise LayoutError(
                f"moe backend {backend!r} consumes weights in layout {layout!r}, these are in "
                f"{self.layout!r}: call capdispatch.backends.moe.prepare(weights, {backend!r}) once after "
                "loading (preparation is in place and one-way)")

    def __repr__(self):
        return (f"MoeWeights(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, "
                f"layout={self.layout!r}, swiglu_limit={self.swiglu_limit}, device={self.device})")


def prepare(weights: MoeWeights, backend: str) -> MoeWeights:
    """Put WEIGHTS into BACKEND's layout, in place, once. Returns WEIGHTS.

    A no-op when they already are; a LayoutError when they were prepared for a
    backend with another layout (preparation is one-way: reload to switch).
    """
    try:
        layout, fn = LAYOUTS[backend]
    except KeyError:
        raise ArgumentError(f"unknown moe backend {backend!r}; known: {', '.join(LAYOUTS)}") from None
    if weights.layout == layout:
        return weights
    if weights.layout != CHECKPOINT:
        raise LayoutError(f"weights were prepared for layout {weights.layout!r}; {backend!r} needs "
                          f"{layout!r} (preparation is one-way: reload the checkpoint)")
    module, _, attr = fn.partition(":")
    getattr(importlib.import_module(module), attr)(weights)
    if weights.layout != layout:  # the preparer sets it last, after every byte is in place
        raise RuntimeError(f"{fn} did not produce layout {layout!r}")
    return weights


# ---------------------------------------------------------------------- #
# In-place helpers for preparers (one expert of scratch at a time)
# ---------------------------------------------------------------------- #
def swap_halves_(t) -> None:
    """[E, 2R, C] -> rows [R:2R] then [0:R], in place (gate/up order), per expert."""
    E, two_r, _ = t.shape
    r = two_r // 2
    for e in range(E):
        tmp = t[e, :r].clone()
        t[e, :r].copy_(t[e, r:])
        t[e, r:].copy_(tmp)
        del tmp


def rewrite_per_expert_(t, fn):
    """Replace each expert's bytes of uint8 ``t`` [E, ...] by ``fn(t[e:e+1])`` (which
    must return exactly as many bytes), in place. Returns the shape fn produced for
    one expert (with the leading 1), so the caller can re-view the whole tensor."""
    shape = None
    per = t[0].numel()
    flat = t.view(t.shape[0], per)
    for e in range(t.shape[0]):
        new = fn(t[e:e + 1])
        nb = new.numel() * new.element_size()
        if nb != per:
            raise ArgumentError(f"layout rewrite changed an expert's size: {per} -> {nb} bytes")
        if shape is None:
            shape, dtype = tuple(new.shape), new.dtype
        flat[e].copy_(new.contiguous().view(-1).view(flat.dtype))
        del new
    return shape, dtype
