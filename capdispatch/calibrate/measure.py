"""The measurement loop: for each size, fresh inputs; each backend checked against the
torch reference, then timed (inside a CUDA graph on CUDA: see ladder.timed_in_graph)."""
from __future__ import annotations

from typing import Callable, Optional

import attrs

from .ladder import timed_in_graph


@attrs.frozen
class Row:
    op: str
    size: int
    backend: str
    ms: Optional[float]       # None: not timed (the check failed, or the call raised)
    ok: bool
    detail: str
    graph: bool

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def measure(op: str, sizes, backends: dict, *, device: str, platform: str, profile: dict, gen,
            timer: Callable, step: Callable = lambda text: None, inputs_of: Optional[dict] = None) -> list:
    """BACKENDS: name -> callable (what `bind` returns). TIMER(call, graph) -> ms times a
    zero-argument call (which carries .op, .backend and .size). STEP(text) is called
    after each (size, backend), for a progress bar. INPUTS_OF maps an entry of BACKENDS that is
    not a backend's name (e.g. what `bind` returns under a policy) to the backend whose
    prepared inputs it takes (MoE weight layouts)."""
    from . import inputs
    rows = []
    graph = timed_in_graph(platform)
    for size in sizes:
        case = inputs.case(op, size, gen, device, profile)
        for name, fn in backends.items():
            as_backend = (inputs_of or {}).get(name, name)
            ms = None
            try:
                ok, detail = case.verify_backend(as_backend, fn)
            except Exception as exc:        # one backend failing must not hide the others
                ok, detail = False, f"raised {type(exc).__name__}: {str(exc)[:300]}"
            if ok:
                call = case.bind_backend(as_backend, fn)
                call.op, call.backend, call.size = op, name, size    # for a timer that reports
                try:
                    ms = timer(call, graph)
                except Exception as exc:    # e.g. a launch that cannot be captured in a graph
                    where = "in a CUDA graph" if graph else "while timing"
                    ok, detail = False, f"failed {where}: {type(exc).__name__}: {str(exc)[:300]}"
            rows.append(Row(op, size, name, ms, ok, detail, graph))
            step(f"{op} {size} {name}")
        del case
        if platform == "cuda":
            import torch
            torch.cuda.empty_cache()
    return rows


def times_by_size(rows) -> dict:
    """size -> {backend: ms} over the rows that passed their check."""
    out = {}
    for r in rows:
        out.setdefault(r.size, {})
        if r.ok and r.ms is not None:
            out[r.size][r.backend] = r.ms
    return out
