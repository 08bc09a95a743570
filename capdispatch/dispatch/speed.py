"""Predicted step time of a rig, per rank and op: from a card's calibrated times where a
calibration for that card exists (a calibrated policy's `# tokens N ...: backend time`
comments, or the JSON `dispatch bench` writes), else from the calibrated card's times scaled
by the ratio of memory bandwidths (marked "estimated"); plus the weights outside the routed
experts read once per step, and the all-reduces per layer over the cards' link. The group's
step is its slowest rank's. Pure Python.

What it ignores, and says so: MTP acceptance (a decode step yields one token per request),
the scheduler and sampling on the host, the compute-bound part of prefill GEMMs outside the
ops (they are counted as weight reads), overlap of communication with compute, load imbalance
between experts, and under --dp-attention the MoE of the batch gathered from every rank (the
batch is each rank's own).
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Optional

import attrs

# Memory bandwidth (GB/s) and the link between cards of a group, per catalog card: the
# vendors' published specifications (NVIDIA product pages and datasheets), not measured here.
CARDS = {
    "a10": (600, "pcie4"), "a100": (2039, "nvlink3"), "b200": (8000, "nvlink5"),
    "dgx-spark": (273, "none"), "h100": (3350, "nvlink4"), "h200": (4800, "nvlink4"),
    "l40s": (864, "pcie4"), "rtx-3080": (760, "pcie4"), "rtx-3090": (936, "pcie4"),
    "rtx-4090": (1008, "pcie4"), "rtx-5090": (1792, "pcie5"), "rtx-pro-6000": (1792, "pcie5"),
}
CARDS_SOURCE = ("memory bandwidth from NVIDIA's published specifications of each card (A10 600 GB/s, "
                "A100 SXM4 80GB 2039, B200 8000, GB10 273, H100 SXM 3350, H200 4800, L40S 864, RTX 3080 "
                "760, 3090 936, 4090 1008, 5090 1792, RTX PRO 6000 1792)")
# Per-direction bandwidth a ring all-reduce sees (GB/s) and a per-hop latency (us): NVLink's
# published per-GPU bandwidth halved per direction; PCIe x16 at about 80% of its rate.
LINKS = {"nvlink3": (300, 3), "nvlink4": (450, 3), "nvlink5": (900, 3),
         "pcie4": (25, 10), "pcie5": (50, 10), "none": (25, 10)}
DENSE_EFFICIENCY = 0.7      # share of the bandwidth a weight-bound GEMM reaches (assumed)
DECODE_BATCHES = (1, 8, 32)
DEFAULT_PREFILL = 4096

_LINE = re.compile(r"#\s*(?P<key>tokens|rows)\s+(?P<n>\d+)(?P<graph> in a CUDA graph)?:\s*(?P<rest>.*)$")
_TIME = re.compile(r"(?P<b>[A-Za-z0-9_]+)\s+(?P<v>[0-9.]+)\s*(?P<u>us|ms|s)\b")
_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


class SpeedError(ValueError):
    pass


@attrs.frozen
class Calibration:
    """Measured per-layer times on one card: op -> backend -> ((size, ms), ...) ascending."""
    card: str                   # catalog key of the card it was measured on
    source: str
    shapes: dict                # heads, experts, moe_intermediate of the measured rank (may be empty)
    times: dict
    shapes_text: str = ""       # the calibration's own words for its shapes

    def time(self, op: str, backend: str, size: int) -> Optional[float]:
        pts = self.times.get(op, {}).get(backend)
        if not pts:
            return None
        return interpolate(pts, size)

    def fastest(self, op: str, size: int):
        best = None
        for b in self.times.get(op, {}):
            t = self.time(op, b, size)
            if t is not None and (best is None or t < best[1]):
                best = (b, t)
        return best


def interpolate(pts, size) -> float:
    """Log-log between measured sizes; proportional to size beyond the largest; the
    smallest size's time below it."""
    if size <= pts[0][0]:
        return pts[0][1]
    for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
        if size <= n1:
            f = (math.log(size) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    n, t = pts[-1]
    return t * size / n


def _shapes_of(text: str) -> dict:
    """heads, experts and moe_intermediate per rank of the shapes a calibration names
    ("deepseek-v4-flash at tp 4, ep 4, dp-attention: 64 heads, ...")."""
    m = re.match(r"^(?P<model>\S+) at tp (?P<tp>\d+), ep (?P<ep>\d+)(?P<dp>, dp-attention)?", text)
    if m:
        from ..models import ModelError, load_model
        try:
            r = load_model(m["model"]).for_rank(int(m["tp"]), int(m["ep"]), bool(m["dp"]))
            return {"heads": r.heads, "experts": r.experts, "moe_intermediate": r.moe_intermediate}
        except ModelError:
            pass
    out = {}
    m = re.search(r"(\d+) heads", text)
    if m:
        out["heads"] = int(m.group(1))
    m = re.search(r"(\d+) of (\d+) experts", text)
    if m:
        out["experts"] = int(m.group(1))
    return out


def load(path: str) -> Calibration:
    """A calibration from a calibrated policy (YAML with `# tokens N ...` comments) or
    `dispatch bench --format json` output."""
    from ..capabilities import catalog
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as exc:
        raise SpeedError(f"--calibration {path}: cannot read it ({exc.strerror})") from None
    times: dict = {}
    if path.endswith(".json"):
        try:
            # Library log lines a run printed before its JSON (older runs) are skipped.
            start = 0 if text.lstrip().startswith("{") else text.index("\n{") + 1
            data = json.loads(text[start:])
            name = data["device"]["name"]
            shapes_text = data.get("shapes", "")
            shapes = _shapes_of(shapes_text)
            for op, body in data["ops"].items():
                for row in body.get("rows", []):
                    if row.get("ok", True) and row.get("ms") is not None:
                        times.setdefault(op, {}).setdefault(row["backend"], []).append((row["size"], row["ms"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise SpeedError(f"--calibration {path}: not the JSON of `dispatch bench` ({exc})") from None
    else:
        m = re.search(r"^# Calibrated by `dispatch bench` on (.+?) \(cc", text, flags=re.M)
        if not m:
            raise SpeedError(f"--calibration {path}: not a calibrated policy (its first line names no card: "
                             f"'# Calibrated by `dispatch bench` on NAME (cc X.Y)')")
        name = m.group(1)
        sm = re.search(r"^# Shapes: (.*)$", text, flags=re.M)
        shapes_text = sm.group(1).rstrip(".") if sm else ""
        shapes = _shapes_of(shapes_text)
        op = None
        for line in text.splitlines():
            s = line.strip()
            om = re.match(r"^([a-z_]+):$", s)
            if om:
                op = om.group(1)
                continue
            lm = _LINE.match(s)
            if lm and op:
                for tm in _TIME.finditer(lm.group("rest")):
                    times.setdefault(op, {}).setdefault(tm.group("b"), []).append(
                        (int(lm.group("n")), float(tm.group("v")) * _UNIT[tm.group("u")]))
    if not times:
        raise SpeedError(f"--calibration {path}: holds no measured times")
    entry = catalog.match_name(name)
    if entry is None:
        raise SpeedError(f"--calibration {path}: measured on {name!r}, a card the catalog does not know")
    for op in times:
        for b in times[op]:
            times[op][b] = tuple(sorted(dict(times[op][b]).items()))
    return Calibration(entry["key"], os.path.basename(path), shapes, times, shapes_text)


def merged(cals) -> list:
    """One Calibration per card: the times of several files for one card (one `dispatch bench`
    JSON per op, say) joined; a later file's times replace an earlier one's for a backend."""
    by: dict = {}
    for c in cals:
        if c.card not in by:
            by[c.card] = Calibration(c.card, c.source, dict(c.shapes), {op: dict(b) for op, b in c.times.items()},
                                     c.shapes_text)
            continue
        m = by[c.card]
        for op, backends in c.times.items():
            m.times.setdefault(op, {}).update(backends)
        by[c.card] = attrs.evolve(m, source=f"{m.source}, {c.source}", shapes=m.shapes or c.shapes)
    return list(by.values())


def default_calibrations() -> list:
    """The calibrated policies shipped with capdispatch (policies/examples/*.yaml)."""
    from .. import policies
    folder = os.path.join(os.path.dirname(policies.__file__), "examples")
    out = []
    for n in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if n.endswith(".yaml"):
            try:
                out.append(load(os.path.join(folder, n)))
            except SpeedError:
                continue     # an example that is not a calibration
    return out


@attrs.frozen
class OpTime:
    op: str
    backend: str
    ms: float                   # per step (all layers that run it)
    how: str                    # "calibrated", "scaled", "estimated", "not predicted: ..."


@attrs.frozen
class RankSpeed:
    rank: int
    device: str
    phase: str                  # "decode" or "prefill"
    size: int                   # batch (decode) or prompt tokens (prefill)
    ops: tuple                  # OpTime...
    dense_ms: float
    comm_ms: float
    not_called: tuple = ()      # (op, why) of decided ops the model does not call: not timed

    @property
    def total(self) -> Optional[float]:
        if any(o.ms is None for o in self.ops):
            return None
        return sum(o.ms for o in self.ops) + self.dense_ms + self.comm_ms

    def slowest_op(self):
        known = [o for o in self.ops if o.ms is not None]
        return max(known, key=lambda o: o.ms) if known else None

    def to_dict(self) -> dict:
        return {"rank": self.rank, "device": self.device, "phase": self.phase, "size": self.size,
                "ops": [attrs.asdict(o) for o in self.ops], "dense_ms": self.dense_ms,
                "comm_ms": self.comm_ms, "total_ms": self.total,
                "not_called": {op: why for op, why in self.not_called}}


def _card_key(spec) -> Optional[str]:
    from ..capabilities import catalog
    e = catalog.match_name(spec.name)
    return e["key"] if e else None


def _scale(call, shapes, cal: Calibration) -> float:
    """The rank's share of the calibrated rank's work: the product, over the shapes CALL
    scales with (models/calls.yaml `scale`) that the calibration names, of the rank's value
    over the calibrated one."""
    s = 1.0
    for field in call.scale:
        if cal.shapes.get(field):
            s *= getattr(shapes, field) / cal.shapes[field]
    return s


def op_time(op, backend, size, shapes, spec, cals, call=None) -> OpTime:
    """OP's time per step on SPEC with BACKEND at SIZE, over the calls one forward makes of it
    (CALL, the model declaration's OpCalls; default: the architecture's, models/calls.yaml)."""
    if call is None:
        from ..models import model_calls
        declared = model_calls()
        call = declared.get(op)
        if call is None:
            return OpTime(op, backend, None, f"not predicted: {declared.not_called(op)}")
    key = _card_key(spec)
    own = next((c for c in cals if c.card == key), None)
    calls = call.per_forward(shapes)
    if own is not None:
        t = own.time(op, backend, size)
        if t is not None:
            s = _scale(call, shapes, own)
            return OpTime(op, backend, t * s * calls, "calibrated" if s == 1.0 else
                          f"calibrated, scaled x{s:.2f} to the rank's shapes")
    ref = own if own is not None else cals[0] if cals else None
    if ref is None or key not in CARDS or ref.card not in CARDS:
        return OpTime(op, backend, None, "not predicted: no calibration for this card, and no "
                                         "bandwidth figure for it")
    ratio = CARDS[ref.card][0] / CARDS[key][0]
    s = _scale(call, shapes, ref)
    t = ref.time(op, backend, size)
    if t is not None:
        return OpTime(op, backend, t * s * ratio * calls,
                      f"estimated: {ref.card}'s {backend} time x{ratio:.2f} (bandwidth ratio)")
    best = ref.fastest(op, size)
    if best is None:
        return OpTime(op, backend, None, f"not predicted: {ref.source} has no {op} times")
    scaled = f" x{ratio:.2f} (bandwidth ratio)" if ratio != 1.0 else ""
    return OpTime(op, backend, best[1] * s * ratio * calls,
                  f"estimated: {backend} not measured on {ref.card}; the fastest measured there "
                  f"({best[0]}){scaled}")


def _dense_bytes(model, shapes) -> int:
    from ..models import memory as mem
    parts = mem.weight_parts(model, shapes)
    return sum(p.bytes for p in parts if p.name not in ("routed experts", "embedding"))


def _comm_ms(shapes, tokens: int, link: str) -> float:
    n = shapes.tp
    if n == 1:
        return 0.0
    bw, lat = LINKS[link]
    nbytes = tokens * shapes.hidden * 2
    per = 2 * (n - 1) / n * nbytes / (bw * 1e9) * 1e3 + 2 * (n - 1) * lat * 1e-3
    return per * 2 * shapes.layers      # attention output and MoE output, every layer


def predict(model, shapes, specs, decisions, cals, *, prefill: int = DEFAULT_PREFILL) -> list:
    """RankSpeed per rank for decode at DECODE_BATCHES and a prefill of PREFILL tokens.
    DECISIONS: op -> device id -> Resolution (the plan's). The ops and their calls are the
    model's declaration (MODEL.calls(), models/calls.yaml); a decided op it does not call is
    named in each row's `not_called`, not timed."""
    declared = model.calls()
    not_called = tuple((op, declared.not_called(op)) for op in decisions if declared.get(op) is None)
    links = [CARDS.get(_card_key(s), (None, "pcie4"))[1] for s in specs]
    link = "pcie4" if any(l.startswith("pcie") or l == "none" for l in links) else min(links)
    dense = _dense_bytes(model, shapes)
    out = []
    for phase, sizes in (("decode", DECODE_BATCHES), ("prefill", (prefill,))):
        for n in sizes:
            tokens = n * shapes.next_n if phase == "decode" else n
            for i, spec in enumerate(specs):
                ops = []
                for call in declared.calls:
                    size = call.size(phase, n, shapes.next_n)
                    if size is None:
                        continue
                    if call.op not in decisions:
                        ops.append(OpTime(call.op, "", None, f"not predicted: {call.op} was not decided"))
                        continue
                    res = decisions[call.op][spec.id]
                    ops.append(op_time(call.op, res.backend_for(size), size, shapes, spec, cals, call))
                bw = CARDS.get(_card_key(spec), (None,))[0]
                dense_ms = dense / (bw * 1e9 * DENSE_EFFICIENCY) * 1e3 if bw else 0.0
                out.append(RankSpeed(i, spec.id, phase, n, tuple(ops), dense_ms, _comm_ms(shapes, tokens, link),
                                     not_called))
    return out
