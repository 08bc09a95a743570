"""The served form: an op called the way a model serves it, for calibration, the regret
check and the benchmarks alike.

- Bound without argument checks (`bind(..., checks=False)`): serving's shapes are known good.
- The layers of one forward inside one `capdispatch.batch()` block, each layer with its own
  inputs and the batch's per-batch tensors (the op's `batch_args`), so work a library derives
  once per batch (FlashMLA's decode schedule) is done once and shared, as SGLang does. It is
  timed apart: one forward of 1 layer and one of K layers give the per-layer time
  ((t_K - t_1) / (K - 1)) and the per-batch time (t_1 - per-layer); a layer's served cost is
  per-layer + per-batch / layers, the model's layer count.
- Replayed from a CUDA graph at the sizes SGLang captures for decode (`capture_max_bs`), eager
  above them and for prefill ops, which SGLang 0.5.23 runs eagerly.
"""
from __future__ import annotations

from typing import Optional

import attrs

# SGLang 0.5.23's default decode capture bound, by the card's memory and the TP size
# (arg_groups/memory_hook.py, _handle_gpu_memory_settings): (memory below MiB, tp < 4, tp >= 4).
_CAPTURE_BS = ((20 * 1024, 8, 8), (35 * 1024, 48, 160), (60 * 1024, 32, 160), (90 * 1024, 256, 512),
               (160 * 1024, 256, 512))
_CAPTURE_BS_LARGEST = 512
# A forward of this many layers separates the per-batch work from the per-layer work;
# more would only cost memory (each layer holds its own pools or weights).
TIMED_LAYERS = 4


def capture_max_bs(memory_bytes: Optional[int], tp: int = 1) -> int:
    """The largest decode batch SGLang 0.5.23 replays from a CUDA graph by default on a card
    with MEMORY_BYTES at TP size TP (`--cuda-graph-max-bs` overrides it there)."""
    if not memory_bytes:
        return 160 if tp >= 4 else 48          # SGLang's fallback when the memory is unknown
    mib = memory_bytes / (1 << 20)
    for below, small, large in _CAPTURE_BS:
        if mib < below:
            return large if tp >= 4 else small
    return _CAPTURE_BS_LARGEST


@attrs.frozen
class ServedForm:
    """How one rank serves the ops: where CUDA graphs replay, and over how many layers a
    batch's shared work is spread."""
    platform: str            # "cuda" | "cpu"
    capture_tokens: int      # decode ops up to this many query rows replay a graph (0: never)
    layers: int              # layers of one forward: the per-batch work is divided over them
    timed_layers: int        # layers in one timed forward (1: the per-batch work is not split out)

    def in_graph(self, op, size: int) -> bool:
        """Is OP (an Op) at SIZE replayed from a CUDA graph when served?"""
        return self.platform == "cuda" and op.served == "decode" and size <= self.capture_tokens

    def describe(self) -> str:
        if self.platform != "cuda":
            return "eager on the CPU, one layer per timed call, without argument checks"
        split = (f"a forward of {self.timed_layers} layers in one batch() against one of 1 layer: the "
                 f"per-batch work is timed apart and divided over {self.layers} layers"
                 if self.timed_layers > 1 else f"one layer per call ({self.layers} in the model)")
        return (f"without argument checks; decode ops replayed from a CUDA graph up to "
                f"{self.capture_tokens} rows and eager above, prefill ops eager; {split}")


def form_for(spec, *, layers: int = 1, next_n: int = 1, tp: int = 1, capture_max_bs_: Optional[int] = None,
             timed_layers: int = TIMED_LAYERS) -> ServedForm:
    """The served form on the device SPEC for a model of LAYERS layers served with NEXT_N
    query rows per request (1 + speculative tokens) at TP size TP; CAPTURE_MAX_BS_ overrides
    SGLang's default capture bound (`--cuda-graph-max-bs`)."""
    if spec.platform != "cuda":
        return ServedForm("cpu", 0, max(1, layers), 1)
    bs = capture_max_bs_ if capture_max_bs_ is not None else capture_max_bs(spec.memory, tp)
    return ServedForm("cuda", bs * max(1, next_n), max(1, layers), max(1, min(timed_layers, layers)))


@attrs.frozen
class ServedTime:
    """One backend at one size, served: ms is what a layer costs (its own work plus its
    share of the batch's); layer_ms and batch_ms the two parts (batch_ms None: not split)."""
    ms: float
    layer_ms: float
    batch_ms: Optional[float]


def split(t1: float, tk: Optional[float], k: int, layers: int) -> ServedTime:
    """From one forward of 1 layer (T1 ms) and one of K layers (TK ms), the served cost per
    layer of a model of LAYERS layers. Noise can make the per-batch part slightly negative:
    it is then 0 (the per-layer part keeps the whole time)."""
    if tk is None or k <= 1:
        return ServedTime(t1, t1, None)
    layer = max((tk - t1) / (k - 1), 0.0)
    if layer == 0.0 or layer > t1:
        layer = min(tk / k, t1)
    batch = max(t1 - layer, 0.0)
    return ServedTime(layer + batch / max(layers, 1), layer, batch)


def forward(calls):
    """One forward over CALLS (one zero-argument call per layer) in one batch() block."""
    from ..backends.batch_scope import batch
    calls = tuple(calls)

    def run():
        with batch():
            for c in calls:
                c()
    return run
