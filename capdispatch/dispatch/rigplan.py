"""A plan of a rig from a model, before anything is downloaded or loaded: is the layout one
SGLang would load, does each rank's memory (weights, KV pools for a context and batch,
workspaces) fit its card, the largest context that fits, and what change would fit.
Pure Python (models.memory does the arithmetic; cards come from the catalog or a probe)."""
from __future__ import annotations

from typing import Optional

import attrs

from ..capabilities import DeviceSpec
from ..models import Layout, ModelError, ModelShape, RankShape
from ..models import memory as _mem
from .errors import BadInput

# Kept free on every card: allocator fragmentation, NCCL buffers and what SGLang's
# --mem-fraction-static leaves outside its pools.
RESERVE_FRACTION = 0.05
RESERVE_TEXT = "5% of each card kept free (fragmentation, NCCL buffers, headroom SGLang leaves)"
DEFAULT_CONTEXT = 8192
DEFAULT_BATCH = 1


@attrs.frozen
class RankPlan:
    rank: int
    device: DeviceSpec
    memory: Optional[_mem.RankMemory]
    card_bytes: Optional[int]
    budget: Optional[int]       # card minus the reserve
    largest_context: Optional[int]

    @property
    def fits(self) -> Optional[bool]:
        if self.memory is None or self.budget is None:
            return None
        return self.memory.total <= self.budget

    @property
    def weights_fit(self) -> Optional[bool]:
        if self.memory is None or self.budget is None:
            return None
        return self.memory.weight_bytes + self.memory.workspace_bytes <= self.budget

    def to_dict(self) -> dict:
        return {"rank": self.rank, "device": self.device.id, "name": self.device.name,
                "card_bytes": self.card_bytes, "budget_bytes": self.budget,
                "memory": self.memory.to_dict() if self.memory is not None else None,
                "fits": self.fits, "weights_fit": self.weights_fit,
                "largest_context": self.largest_context,
                "tight": (self.memory.high > self.budget) if self.fits else None}


@attrs.frozen
class Option:
    """Another layout over (some of) these cards, or the cards a layout would need."""
    layout: Layout
    devices: tuple              # device ids it would use ((): cards not in the rig)
    fits: bool
    largest_context: int
    per_rank_bytes: int         # the heaviest rank's total at the plan's context and batch
    note: str = ""

    def to_dict(self) -> dict:
        return {"tp": self.layout.tp, "ep": self.layout.ep, "dp_attention": self.layout.dp_attention,
                "devices": list(self.devices), "fits": self.fits, "largest_context": self.largest_context,
                "per_rank_bytes": self.per_rank_bytes, "note": self.note}


@attrs.frozen
class RigPlan:
    model: ModelShape
    layout: Layout
    context: int
    batch: int
    devices: tuple
    refusal: Optional[str]      # SGLang would refuse the layout: why, with the numbers
    shapes: Optional[RankShape]  # None when refused
    ranks: tuple                # RankPlan per rank ((): refused)
    options: tuple              # Option...: layouts that would load (and whether they fit)
    suggestions: tuple          # sentences: what change would fit
    weights_total: int          # the whole checkpoint as loaded at tp 1, bytes
    cards_total: int            # the rig's memory, bytes

    @property
    def fits(self) -> bool:
        return self.refusal is None and bool(self.ranks) and all(r.fits for r in self.ranks)

    def to_dict(self) -> dict:
        return {"schema": 1, "model": self.model.name,
                "layout": {"tp": self.layout.tp, "ep": self.layout.ep, "dp_attention": self.layout.dp_attention},
                "context": self.context, "batch": self.batch, "refusal": self.refusal,
                "shapes": self.shapes.to_dict() if self.shapes is not None else None,
                "ranks": [r.to_dict() for r in self.ranks], "fits": self.fits,
                "largest_context": min((r.largest_context for r in self.ranks
                                        if r.largest_context is not None), default=None),
                "options": [o.to_dict() for o in self.options],
                "suggestions": list(self.suggestions),
                "weights_total_bytes": self.weights_total, "cards_total_bytes": self.cards_total,
                "reserve": RESERVE_TEXT, "margin": _mem.MARGIN_TEXT}


def context_limit(model: ModelShape) -> int:
    return model.max_context or 1 << 20


def budget_of(card_bytes: Optional[int]) -> Optional[int]:
    if not card_bytes:
        return None
    return int(card_bytes * (1 - RESERVE_FRACTION))


def _rank(model, shapes, i, spec, context, batch, memo=None) -> RankPlan:
    """One rank's plan; MEMO (a dict the caller owns for one build) shares the arithmetic
    between ranks of the same shapes on cards of the same size."""
    key = (shapes, spec.memory, fp8_wo_a(spec), context, batch)
    if memo is not None and key in memo:
        return attrs.evolve(memo[key], rank=i, device=spec)
    out = _rank_uncached(model, shapes, i, spec, context, batch)
    if memo is not None:
        memo[key] = out
    return out


def fp8_wo_a(spec) -> bool:
    """Does SGLang keep wo_a in fp8 on this card? Only where DeepGEMM's UE8M0 scales run (SM100);
    elsewhere its launcher turns the fp8 wo_a GEMM off and the loader dequantises wo_a to bf16."""
    return spec.cc is not None and spec.cc[0] == 10


def _rank_uncached(model, shapes, i, spec, context, batch) -> RankPlan:
    card = spec.memory
    budget = budget_of(card)
    fp8 = fp8_wo_a(spec)
    mem = _mem.rank_memory(model, shapes, context=context, batch=batch, card_bytes=card or 0, fp8_wo_a=fp8)
    largest = None
    if budget is not None:
        largest = _mem.largest_context(model, shapes, batch=batch, card_bytes=card, budget=budget,
                                       limit=context_limit(model), fp8_wo_a=fp8)
    return RankPlan(i, spec, mem, card, budget, largest)


def _option(model, layout, specs, context, batch, next_n, memo) -> Optional[Option]:
    """LAYOUT over the first layout.tp of SPECS (the largest cards first)."""
    shapes = model.for_rank(layout.tp, layout.ep, layout.dp_attention, next_n=next_n)
    used = specs[:layout.tp]
    ranks = [_rank(model, shapes, i, s, context, batch, memo) for i, s in enumerate(used)]
    if any(r.budget is None for r in ranks):
        return None
    worst = max(ranks, key=lambda r: r.memory.total - r.budget)
    return Option(layout, tuple(s.id for s in used), all(r.fits for r in ranks),
                  min(r.largest_context for r in ranks), worst.memory.total)


def _layouts(model: ModelShape, top: int, ep: int, dp_attention: bool) -> list:
    from ..models.sharding import works
    out = []
    for tp in range(1, top + 1):
        for lay in (Layout(tp, ep, dp_attention), Layout(tp, 1, dp_attention), Layout(tp, tp, dp_attention)):
            if works(model, lay) and lay not in out:
                out.append(lay)
                break
    return out


def _catalog_cards(min_bytes: int) -> list:
    from ..capabilities import catalog
    out = []
    for key in catalog.names():
        e = catalog.lookup(key)
        if e.get("section") == "gpus" and e.get("memory") and e["memory"] >= min_bytes:
            out.append((e["memory"], key))
    return [k for _, k in sorted(out)]


def group_tp(tp, devices: int) -> int:
    """The ranks of a group of DEVICES cards at --tp TP (None: one rank per device); one
    device with --tp N stands for N such cards, any other count must be TP."""
    if tp is None:
        return devices
    if devices not in (1, tp):
        raise _tp_mismatch(tp, devices)
    return tp


def _tp_mismatch(tp: int, devices: int) -> BadInput:
    return BadInput(f"--tp {tp} puts one rank on each card, but --device names {devices} "
                    f"card(s); give {tp} devices (or one, to use it {tp} times)")


# Requests served at once: SGLang's running batch is thousands at most; a million is a typo.
MAX_BATCH = 1 << 20


def build(model: ModelShape, specs, *, tp: int, ep: int = 1, dp_attention: bool = False,
          next_n: Optional[int] = None, context: int = DEFAULT_CONTEXT, batch: int = DEFAULT_BATCH) -> RigPlan:
    """The plan of MODEL over SPECS (one DeviceSpec per rank) at the layout."""
    for name, v, low in (("--context", context, 0), ("--batch", batch, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise BadInput(f"{name} {v!r} is not valid; valid: an integer >= {low}")
    if batch > MAX_BATCH:
        raise BadInput(f"--batch {batch} is not valid; valid: 1..{MAX_BATCH} (requests served at once)")
    if context > context_limit(model):
        raise BadInput(f"--context {context} is longer than {model.name}'s max_position_embeddings "
                       f"{context_limit(model)}; valid: 0..{context_limit(model)}")
    specs = tuple(specs)
    if len(specs) != tp:
        raise _tp_mismatch(tp, len(specs))
    layout = Layout(tp, ep, dp_attention)
    weights_total = sum(p.bytes for p in _mem.weight_parts(model, model.for_rank(1, next_n=next_n)))
    cards_total = sum(s.memory or 0 for s in specs)
    refusal, shapes, ranks, memo = None, None, (), {}
    try:
        shapes = model.for_rank(tp, ep, dp_attention, next_n=next_n)
    except ModelError as exc:
        refusal = str(exc)
    if shapes is not None:
        ranks = tuple(_rank(model, shapes, i, s, context, batch, memo) for i, s in enumerate(specs))
    # Other layouts over the largest cards of the rig, and what the smallest card would need.
    by_size = sorted(specs, key=lambda s: -(s.memory or 0))
    options = []
    for lay in _layouts(model, len(specs), ep, dp_attention):
        if lay == layout:
            continue
        o = _option(model, lay, by_size, context, batch, next_n, memo)
        if o is not None:
            options.append(o)
    suggestions = _suggest(model, layout, specs, ranks, refusal, options, context, batch, next_n,
                           weights_total, cards_total, dp_attention)
    return RigPlan(model, layout, context, batch, specs, refusal, shapes, ranks, tuple(options),
                   tuple(suggestions), weights_total, cards_total)


def _gib(n) -> str:
    return f"{n / _mem.GIB:.1f} GiB"


def _suggest(model, layout, specs, ranks, refusal, options, context, batch, next_n,
             weights_total, cards_total, dp_attention) -> list:
    out = []
    if ranks and all(r.fits for r in ranks):
        return out
    if ranks and all(r.weights_fit for r in ranks) and all(r.largest_context is not None for r in ranks):
        largest = min(r.largest_context for r in ranks)
        if largest > 0:
            out.append(f"a context of {largest} tokens at batch {batch} fits every rank (--context {largest})")
    fitting = [o for o in options if o.fits]
    if fitting:
        best = max(fitting, key=lambda o: o.largest_context)
        out.append(f"tp {best.layout.tp} ep {best.layout.ep} over {', '.join(best.devices)} fits, with "
                   f"contexts up to {best.largest_context} tokens at batch {batch}")
    if cards_total and weights_total > cards_total * (1 - RESERVE_FRACTION):
        out.append(f"the weights alone are {_gib(weights_total)}; these {len(specs)} cards hold "
                   f"{_gib(cards_total)}: no layout of them loads {model.name}")
    if not fitting:
        # The fewest ranks of one card kind that would hold it: the largest valid tp up to 8,
        # and the catalog's cards with room for one rank of it.
        lays = _layouts(model, 8, 1, dp_attention)
        for lay in lays[::-1][:1]:
            shapes = model.for_rank(lay.tp, lay.ep, lay.dp_attention, next_n=next_n)
            # The workspace as on the rig's largest card (its prefill chunk follows the card's size).
            need = _mem.rank_memory(model, shapes, context=context, batch=batch,
                                    card_bytes=max(s.memory or 0 for s in specs)).total
            card = int(need / (1 - RESERVE_FRACTION)) + 1
            cards = _catalog_cards(card)
            out.append(f"tp {lay.tp} needs {_gib(need)} per rank at {context} tokens x {batch}: cards of at "
                       f"least {_gib(card)} each" + (f" (catalog: {', '.join(cards)})" if cards else
                                                     " (no catalog card has that much)"))
    if refusal and not any(o.fits for o in options):
        valid = ", ".join(f"tp {o.layout.tp}" for o in options) or "none over these cards"
        out.append(f"layouts SGLang would load over these cards: {valid}")
    return out
