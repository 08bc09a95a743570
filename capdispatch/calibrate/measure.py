"""The measurement loop: for each size, fresh inputs for each timed layer; each backend
checked against the torch reference, then timed in its served form (served.py): a forward
of one layer and one of several in one `batch()` block, replayed from a CUDA graph where
SGLang replays one."""
from __future__ import annotations

from typing import Callable, Optional

import attrs

from .served import ServedForm, forward, split


@attrs.frozen
class Row:
    op: str
    size: int
    backend: str
    ms: Optional[float]       # served cost per layer; None: not timed (the check failed, or the call raised)
    ok: bool
    detail: str
    graph: bool
    layer_ms: Optional[float] = None   # the layer's own work
    batch_ms: Optional[float] = None   # the batch's shared work, once per forward (None: not split out)

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def measure(op: str, sizes, backends: dict, *, device: str, platform: str, profile: dict, gen,
            timer: Callable, step: Callable = lambda text: None, inputs_of: Optional[dict] = None,
            form: Optional[ServedForm] = None) -> list:
    """BACKENDS: name -> callable (what `bind` returns; bind them with checks=False for the
    served form). TIMER(call, graph) -> ms times a zero-argument call (which carries .op,
    .backend, .size and .layers). STEP(text) is called after each (size, backend), for a
    progress bar. INPUTS_OF maps an entry of BACKENDS that is not a backend's name (e.g.
    what `bind` returns under a policy) to the backend whose prepared inputs it takes (MoE
    weight layouts). FORM: the served form (default: one layer, graphs on CUDA for every
    size of a decode op)."""
    from ..backends import builtin
    from . import inputs
    if form is None:
        form = ServedForm(platform, 1 << 62 if platform == "cuda" else 0, 1, 1)
    spec_op = builtin().ops[op]
    rows = []
    states = [dict() for _ in range(form.timed_layers)]     # per layer, across sizes (MoE weights)
    for size in sizes:
        first = inputs.case(op, size, gen, device, profile, layer_state=states[0])
        cases = [first] + [inputs.case(op, size, gen, device, profile, batch=inputs.batch_of(first)
                                       if spec_op.batch_args else None, layer_state=states[i])
                           for i in range(1, form.timed_layers)]
        graph = form.in_graph(spec_op, size)
        for name, fn in backends.items():
            as_backend = (inputs_of or {}).get(name, name)
            served = None
            try:
                ok, detail = first.verify_backend(as_backend, fn)
            except Exception as exc:        # one backend failing must not hide the others
                ok, detail = False, f"raised {type(exc).__name__}: {str(exc)[:300]}"
            if ok:
                try:
                    tune = _tuning(op, as_backend)
                    if tune is not None:    # as a server does before it serves (FlashInfer's autotuner)
                        with tune():
                            first.bind_backend(as_backend, fn)()
                    t1 = _timed(timer, _call(forward([first.bind_backend(as_backend, fn)]), op, name, size, 1),
                                graph)
                    tk = None
                    if len(cases) > 1:
                        calls = [c.bind_backend(as_backend, fn) for c in cases]
                        tk = _timed(timer, _call(forward(calls), op, name, size, len(cases)), graph)
                    served = split(t1, tk, len(cases), form.layers)
                except Exception as exc:    # e.g. a launch that cannot be captured in a graph
                    where = "in a CUDA graph" if graph else "while timing"
                    ok, detail = False, f"failed {where}: {type(exc).__name__}: {str(exc)[:300]}"
            rows.append(Row(op, size, name, served and served.ms, ok, detail, graph,
                            served and served.layer_ms, served and served.batch_ms))
            step(f"{op} {size} {name}")
        del first, cases
        if platform == "cuda":
            import torch
            torch.cuda.empty_cache()
    return rows


def _tuning(op: str, backend: str):
    """The backend's tuning context manager factory (Backend.tune), or None."""
    from ..backends import builtin
    reg = builtin()
    try:
        b = reg.backend(op, backend)
    except Exception:           # an entry that is not a registered backend (a bound policy)
        return None
    return b.load_tune()


def _timed(timer, call, graph: bool) -> float:
    """TIMER's median; eagerly the lower of two medians: a kernel of a few microseconds timed
    eagerly is mostly its launch, and one stall of the host can hold a whole window of runs."""
    t = timer(call, graph)
    return t if graph else min(t, timer(call, graph))


def _call(fn, op, backend, size, layers):
    def call():
        fn()
    call.op, call.backend, call.size, call.layers = op, backend, size, layers    # for a timer that reports
    return call


def times_by_size(rows) -> dict:
    """size -> {backend: ms} over the rows that passed their check."""
    out = {}
    for r in rows:
        out.setdefault(r.size, {})
        if r.ok and r.ms is not None:
            out[r.size][r.backend] = r.ms
    return out
