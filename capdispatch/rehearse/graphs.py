"""CUDA graphs in a rehearsal, as serving uses them: a decode step's calls of the ops SGLang
serves in its decode graphs (`Op.served == "decode"`), at sizes within the capture bound,
are captured once per op, layer and call shape and replayed with each step's inputs copied
into the graph's own buffers; prefill calls and calls above the bound run eagerly.

Each graphed call is warmed up eagerly on a side stream (compiles, lazily allocated
workspaces), captured on the graph's static inputs, and replayed; what it writes into its
inputs (kv_quant's pool) is copied back. The replay's output is what the model goes on with
and what the call's check compares with the reference. A CPU rank runs eagerly (no graphs),
and the report says so."""
from __future__ import annotations

from typing import Optional
import time

import attrs

__all__ = ["GraphPlan", "graph_plan", "Graphs", "GraphCaptureError"]


class GraphCaptureError(RuntimeError):
    """A chosen kernel failed under CUDA-graph capture or replay."""


@attrs.frozen
class GraphPlan:
    """Where a rank replays graphs: on (a CUDA rank), the decode rows up to the bound, why."""
    on: bool
    capture_tokens: int
    why: str

    def in_graph(self, op, size: int, decode: bool) -> bool:
        """Is a call of OP (an Op declaration) over SIZE rows replayed, in a decode step?"""
        return self.on and decode and op.served == "decode" and size <= self.capture_tokens


def graph_plan(run: str, enabled: bool, memory: Optional[int], tp: int, next_n: int) -> GraphPlan:
    """The plan of a rank running on RUN (cpu or cuda:N) whose card has MEMORY bytes, at TP
    size TP with NEXT_N query rows per request: SGLang 0.5.23's default capture bound."""
    if not run.startswith("cuda"):
        return GraphPlan(False, 0, "off: the rank runs on the CPU (no CUDA graphs), every call eager")
    if not enabled:
        return GraphPlan(False, 0, "off (--no-graphs): every call eager")
    from ..calibrate.served import capture_max_bs
    bs = capture_max_bs(memory, tp)
    rows = bs * max(1, next_n)
    return GraphPlan(True, rows, f"decode ops replayed from CUDA graphs up to {rows} rows (SGLang 0.5.23's "
                                 f"capture bound {bs} for the card's memory at tp {tp}, x next_n {next_n}); "
                                 f"prefill eager")


def _sig(args) -> tuple:
    import torch
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(("t", tuple(a.shape), a.dtype, tuple(a.stride())))
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append(("v", a))
        else:
            out.append(("o", id(a)))      # e.g. the MoE weights: the same object every step
    return tuple(out)


class _Entry:
    __slots__ = ("graph", "static", "out")

    def __init__(self, graph, static, out):
        self.graph, self.static, self.out = graph, static, out


class CudaGraphs:
    """torch.cuda's graphs, as Graphs uses them (a stand-in can replace it in tests)."""

    def __init__(self, device):
        import torch
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn, static):
        """Warm FN up on a side stream (compiles, lazy workspaces), then capture FN(*STATIC):
        (the graph, its output tensors). STATIC's tensors are restored after the warm-up."""
        import torch
        saved = [a.clone() if isinstance(a, torch.Tensor) else None for a in static]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn(*static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for s, a in zip(static, saved):          # the warm-up may have written into them
            if a is not None:
                s.copy_(a)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn(*static)
        return g, out

    def replay(self, graph):
        graph.replay()

    def synchronize(self):
        import torch
        torch.cuda.synchronize(self.device)


class Graphs:
    """One rank's captured graphs, keyed by (op, layer, call signature)."""

    def __init__(self, device, cuda=None):
        self.cuda = cuda if cuda is not None else CudaGraphs(device)
        self.entries: dict = {}
        self.captures: dict = {}       # op -> graphs captured
        self.replays: dict = {}        # op -> calls replayed

    def call(self, op: str, layer: int, fn, args):
        """The graph of FN(*ARGS) for (OP, LAYER, the args' signature), captured on the first
        such call, with ARGS copied into its inputs: `replay` runs it."""
        import torch
        key = (op, layer, _sig(args))
        e = self.entries.get(key)
        try:
            if e is None:
                static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                graph, out = self.cuda.capture(fn, static)
                e = self.entries[key] = _Entry(graph, static, out)
                self.captures[op] = self.captures.get(op, 0) + 1
            for s, a in zip(e.static, args):
                if isinstance(a, torch.Tensor):
                    s.copy_(a)
        except Exception as exc:   # noqa: BLE001 - named with the op: the kernel is not graph-safe
            raise GraphCaptureError(f"{op} (layer {layer}) failed under CUDA-graph capture: "
                                    f"{type(exc).__name__}: {exc}") from exc
        self.replays[op] = self.replays.get(op, 0) + 1
        return e

    def replay(self, e, args, spent: list):
        """Replay E (its time appended to SPENT); copy what it wrote into its inputs back to
        ARGS; its outputs, cloned."""

        import torch
        self.cuda.synchronize()
        t0 = time.perf_counter()
        self.cuda.replay(e.graph)
        self.cuda.synchronize()
        spent.append(time.perf_counter() - t0)
        for s, a in zip(e.static, args):
            if isinstance(a, torch.Tensor):
                a.copy_(s)
        return _clone(e.out)


def _clone(out):
    import torch
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_clone(o) for o in out)
    return out
