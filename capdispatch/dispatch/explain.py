"""Explain: a plan for a group of devices and ops, as text for people and as JSON."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import attrs

from ..capabilities import derive_features
from .group import GroupResolution, resolve_group_in, unique_ids
from .resolver import as_spec, context

if TYPE_CHECKING:
    from ..backends import Registry
    from ..capabilities import Inventory
    from ..models import RankShape

log = logging.getLogger("capdispatch")

SCHEMA = 1
DEFAULT_WHOSE = "this machine's"


@attrs.frozen
class Plan:
    devices: tuple
    ops: dict                 # op -> GroupResolution
    warnings: tuple
    libraries: dict           # dist -> description, as the decision saw them
    inventory: Optional[Inventory] = attrs.field(default=None, eq=False)   # what the decision read
    registry: Optional[Registry] = attrs.field(default=None, eq=False)     # what it decided from
    whose: dict = attrs.field(factory=dict)   # whose libraries, for people: Inventory.to_dict() + note
    shapes: Optional[RankShape] = None     # what the shape ranges were checked against

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "devices": [device_dict(d, self.libraries) for d in self.devices],
            "inventory": self.whose,
            "ops": {op: g.to_dict() for op, g in self.ops.items()},
            "warnings": list(self.warnings),
            # The rank's shapes the backends' shape ranges were checked against (null: no
            # model given, shape ranges not evaluated).
            "shapes": self.shapes.to_dict() if self.shapes is not None else None,
        }

    def mixed_summary(self, hint: str = "-v shows each", total=None) -> str:
        """Every mixed-group divergence of the plan as one line, as `--brief` says it ("": none);
        TOTAL: how many ops the caller shows (default: the plan's)."""
        from .notices import summary
        return summary(self, hint, total)


def device_dict(d, libraries) -> dict:
    return {"id": d.id, "name": d.name, "cc": d.cc_str, "features": sorted(derive_features(d)),
            "libraries": libraries, "platform": d.platform, "sm_count": d.sm_count,
            "smem_optin_per_block": d.smem_optin_per_block, "memory": d.memory,
            "cuda": d.cuda, "probe": d.probe, "notes": list(d.notes)}


def whose_dict(specs, inventory, dists=()) -> dict:
    """Whose libraries planned SPECS, for people and JSON (the `inventory` of every output):
    Inventory.to_dict(DISTS) and the note on it."""
    return dict(inventory.to_dict(dists), note=inventory_note(specs, inventory))


def whose_lines(inventory: dict) -> list:
    """Whose libraries a decision used, as every command says it (docs/cli.md#whose-libraries):
    `libraries: WHOSE` and the note when there is one. INVENTORY: a whose_dict."""
    from .render import wrap
    out = wrap(f"libraries: {inventory.get('whose', DEFAULT_WHOSE)}", "")
    if inventory.get("note"):
        out += wrap(f"note: {inventory['note']}", "")
    return out


def inventory_note(specs, inventory) -> str:
    """What to say when simulated devices are planned with libraries nobody named."""
    from ..capabilities import lib_profiles
    if inventory.default:
        return (f"simulated devices, planned with the {inventory.profile.name} profile's libraries "
                f"(no --libs or --assume-lib given); --libs local plans with this machine's, "
                f"--libs PROFILE or --assume-lib NAME[==VERSION] with another's")
    if not inventory.local or not any(s.simulated for s in specs):
        return ""
    example = f"--libs {lib_profiles.default_name()}"
    return ("simulated devices, but this machine's libraries: a library missing here counts as "
            f"missing there; name the target's software with {example} or --assume-lib NAME[==VERSION]")


def plan(devices, ops=None, *, policy=None, selections=None, assume_libs=None,
         strict: bool = False, env=None, via: str = "auto", assume_cuda: Optional[str] = None,
         registry=None, selection_origin: str = "selections=", log_warnings: bool = True,
         libs=None, settings=None, settings_origin: str = "settings=", shapes=None) -> Plan:
    """Resolve OPS (default: all) over DEVICES as one group; log its warnings once
    (LOG_WARNINGS=False: the caller logs them, e.g. rank 0 of a distributed group).
    LIBS names a library profile for the target's software; SETTINGS
    ({"mixed_group": "uniform"}) sit above every policy file. SHAPES: the ranks' RankShape,
    checked against the backends' shape ranges (None: not evaluated)."""
    ctx = context(policy=policy, selections=selections, assume_libs=assume_libs, strict=strict,
                  env=env, registry=registry, selection_origin=selection_origin, libs=libs,
                  settings=settings, settings_origin=settings_origin, shapes=shapes)
    return plan_in(ctx, devices, ops, via=via, assume_cuda=assume_cuda, log_warnings=log_warnings)


def plan_in(ctx, devices, ops=None, *, via: str = "auto", assume_cuda: Optional[str] = None,
            log_warnings: bool = True) -> Plan:
    """`plan` with an already built Context (`capdispatch.context(...)`): every op
    of the plan reads the same policy stack, selections and library inventory."""
    from .inputs import api_devices
    specs = unique_ids([as_spec(d, via=via, assume_cuda=assume_cuda) for d in api_devices(devices)])
    ctx = ctx.for_devices(specs)
    names = list(ops) if ops else list(ctx.registry.ops)
    groups = {op: resolve_group_in(ctx, op, specs) for op in names}
    warnings = tuple(w for g in groups.values() for w in g.warnings)
    if log_warnings:
        for w in warnings:
            log.warning(w)
    dists = sorted({r.dist for op in names for b in ctx.registry.backends(op)
                    for r in b.requires if hasattr(r, "dist")})
    libs_seen = {d: ctx.inventory.get(d).describe() for d in dists}
    return Plan(tuple(specs), groups, warnings, libs_seen, ctx.inventory, ctx.registry,
                whose_dict(specs, ctx.inventory, dists),
                shapes=ctx.shapes)


def shapes_line(shapes) -> str:
    """One line naming the rank shapes a plan's shape ranges were checked against (shown only
    when a model was given: without one, shape ranges are not evaluated)."""
    s = shapes
    layout = f"tp {s.tp}" + (f" ep {s.ep}" if s.ep != 1 else "") + (" dp-attention" if s.dp_attention else "")
    return (f"shapes: {s.model} at {layout}, per rank: heads {s.heads} x {s.head_dim}, indexer heads "
            f"{s.indexer_heads} x {s.indexer_dim}, next_n {s.next_n}, experts {s.experts} of "
            f"{s.experts_total} (top-{s.topk}), hidden {s.hidden}, expert intermediate {s.moe_intermediate}")


def _gib(n):
    return f"{n / 2**30:.1f} GiB" if n else "memory ?"


def cuda_text(d) -> str:
    if d.cuda:
        return f"CUDA {d.cuda}"
    if d.simulated:
        return "CUDA unknown (simulated; --assume-cuda VER)"
    return "CUDA unknown (no CUDA build of torch found)"


def device_line(d) -> str:
    if d.platform != "cuda":
        return f"{d.id}  {d.name}  (probed: {d.probe})"
    smem = f"{d.smem_optin_per_block // 1024} KiB opt-in smem" if d.smem_optin_per_block else "opt-in smem ?"
    sms = f"{d.sm_count} SMs" if d.sm_count else "SMs ?"
    how = "  (simulated)" if d.simulated and d.cuda else "" if d.simulated else f"  (probed: {d.probe})"
    return f"{d.id}  {d.name}  cc {d.cc_str}, {sms}, {smem}, {_gib(d.memory)}, {cuda_text(d)}{how}"


def libraries_lines(libraries: dict, inventory: dict) -> list:
    from .render import wrap
    whose = inventory.get("whose", DEFAULT_WHOSE)
    said = f" ({inventory['profile']})" if inventory.get("profile") else None
    text = f"libraries ({whose}): " + ", ".join(
        f"{k} {v.replace(said, '') if said else v}" for k, v in libraries.items())
    out = wrap(text, "")
    if inventory.get("note"):
        out += wrap(f"note: {inventory['note']}", "")
    return out


def short_name(name: str) -> str:
    for prefix in ("NVIDIA ", "GeForce "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def cell_kind(g, r) -> str:
    if r.downgraded_from:
        return "downgraded"
    if g.mode == "uniform" and r.source.startswith("mixed_group: uniform"):
        return "uniform"
    return "fallback" if r.fallback else "first"


def positions_text(positions) -> str:
    """[0, 1, 2, 5, 7, 8] -> '#0-2,5,7-8': group positions as ranges."""
    parts, start = [], None
    for i, p in enumerate(positions):
        if start is None:
            start = p
        if i + 1 == len(positions) or positions[i + 1] != p + 1:
            parts.append(f"{start}" if start == p else f"{start}-{p}")
            start = None
    return "#" + ",".join(parts)


def _base_id(device_id: str) -> str:
    return device_id.split("@", 1)[0]


def device_columns(p: Plan, rows) -> tuple:
    """(headers, rows) of the matrix with identical cards in one column: the same card
    (name, compute capability) deciding the same in every row. A grouped column says
    how many cards it holds and their positions in the group (#0-63)."""
    groups = {}
    for i, d in enumerate(p.devices):
        key = (d.name, d.cc_str, d.simulated, tuple(r.cells[i] for r in rows))
        groups.setdefault(key, []).append(i)
    headers, members = [], list(groups.values())
    for idx in members:
        d = p.devices[idx[0]]
        card = short_name(d.name) + (f", cc {d.cc_str}" if d.cc_str else "")
        if len(idx) == 1:
            headers.append(f"{d.id}\n{card}\n{positions_text(idx)}")
            continue
        bases = {_base_id(p.devices[i].id) for i in idx}
        first = bases.pop() if len(bases) == 1 else f"{len(idx)} devices"
        headers.append(f"{first} x{len(idx)}\n{card}\n{positions_text(idx)}")
    grouped = [type(r)(r.label, tuple(r.cells[idx[0]] for idx in members), r.diverges) for r in rows]
    return headers, grouped


def matrix(p: Plan, *, color=None, width=None, ascii_only=None, stream=None,
           warnings_where: str = "", summarised: bool = False) -> str:
    """The op x device table of plan P: the backend per cell, fallbacks and
    divergences marked (see render.KINDS), whose libraries in the caption. When the
    table is wider than the terminal, identical cards share a column (with their
    positions), and what still does not fit wraps below."""
    from .render import Cell, Row, natural_width, render_matrix, terminal_width
    cols = [f"{d.id}\n{short_name(d.name)}" + (f", cc {d.cc_str}" if d.cc_str else "")
            for d in p.devices]
    rows = [Row(op, tuple(Cell(r.backend + _sized(r), cell_kind(g, r)) for r in g.per_device.values()),
                diverges=not g.uniform)
            for op, g in p.ops.items()]
    caption = f"libraries: {p.whose.get('whose', DEFAULT_WHOSE)}"
    limit = terminal_width(stream) if width is None else width
    if rows and natural_width(cols, rows) > limit:
        grouped_cols, grouped_rows = device_columns(p, rows)
        if len(grouped_cols) < len(cols):
            cols, rows = grouped_cols, grouped_rows
            caption = (f"{len(p.devices)} devices in {len(cols)} columns: identical cards deciding "
                       f"alike share one (xN cards, #positions in the group)\n" + caption)
    if any(_sized(r) for g in p.ops.values() for r in g.per_device.values()):
        caption = ("+N sized: N size buckets run another backend (the trace lists them)\n"
                   + caption)
    if p.warnings:
        from .notices import shown
        caption += f"; {len(shown(p, brief=summarised))} warning(s){warnings_where}"
    return render_matrix(cols, rows, caption=caption, color=color, width=width,
                         ascii_only=ascii_only, stream=stream)


def _sized(r) -> str:
    """' +N sized' when N size buckets of R run another backend than its catch-all."""
    n = sum(1 for b in r.buckets if b.backend != r.backend)
    return f" +{n} sized" if n else ""


def _same_trace(a, b) -> bool:
    def key(r):
        return (r.backend, r.source, r.fallback, r.downgraded_from,
                tuple((b.lower, b.upper, b.backend, b.source) for b in r.buckets),
                tuple((c.backend, c.ok, tuple((ch.code, ch.need, ch.found, ch.ok) for ch in c.checks))
                      for c in r.candidates))
    return key(a) == key(b)


def _bucket_lines(r) -> list:
    if not r.buckets:
        return []
    rows = []
    for b in r.buckets:
        flag = ""
        if b.downgraded_from:
            flag = f"  (downgraded from {b.downgraded_from})"
        elif b.fallback:
            flag = f"  (fallback from {b.wanted})"
        rows.append((f"{r.size_key} {b.label(r.size_key)}", f"{b.backend}{flag}", b.source))
    w1, w2 = max(len(a) for a, _, _ in rows), max(len(b) for _, b, _ in rows)
    return ["      buckets:"] + [f"        {a:<{w1}} -> {b:<{w2}}  # {c}" for a, b, c in rows]


def render_text(p: Plan, *, brief: bool = False, color=None, stream=None,
                summarised: Optional[bool] = None) -> str:
    """For people: the matrix (several ops or devices, or BRIEF), then unless BRIEF
    the devices, whose libraries, and each op's trace, wrapped at the terminal's width.
    SUMMARISED (default: BRIEF): the mixed-group warnings are one summary line (notices.shown)."""
    from .render import UNICODE, symbols, wrap
    sym = symbols(stream)
    out = []
    if brief or len(p.devices) > 1 or len(p.ops) > 1:
        out.append(matrix(p, color=color, stream=stream, ascii_only=sym is not UNICODE,
                          warnings_where=" on stderr",
                          summarised=brief if summarised is None else summarised))
        if brief:
            if p.whose.get("note"):
                out += wrap(f"note: {p.whose['note']}", "")
            return "\n".join(out)
        out.append("")
    for d in p.devices:
        out += wrap(device_line(d), "")
        feats = sorted(derive_features(d))
        out += wrap(f"features: {', '.join(feats) if feats else '(none)'}", "  ")
        for n in d.notes:
            out += wrap(f"note: {n}", "  ")
    out += libraries_lines(p.libraries, p.whose)
    if p.shapes is not None:
        out += wrap(shapes_line(p.shapes), "")
    for op, g in p.ops.items():
        out.append("")
        tag = "" if len(p.devices) == 1 else ("  [uniform]" if g.uniform else "  [DIVERGES]")
        out.append(f"{op}{tag}")
        shown = []
        for did, r in g.per_device.items():
            flags = []
            if r.downgraded_from:
                flags.append(f"downgraded from {r.downgraded_from}")
            elif r.fallback:
                flags.append(f"fallback from {r.wanted}")
            twin = next((t for t, tr in shown if _same_trace(tr, r)), None)
            if twin is not None:
                flags.append(f"same trace as {twin}")
            flag = f"  ({'; '.join(flags)})" if flags else ""
            out += wrap(f"{did} {sym.arrow} {r.backend}{flag}", "  ", hang="    ")
            if twin is not None:
                continue
            shown.append((did, r))
            out.append(f"      source: {r.source}")    # a file:line locator stays whole
            out += _bucket_lines(r)
            for c in r.candidates:
                mark = sym.ok if c.ok else sym.bad
                bad = [ch for ch in c.checks if not ch.ok]
                tag = f"  [{c.verification}]" if c.verification else ""
                if c.host is not None:      # the host engine's own kernel, by its statement
                    tag = f"  ({c.host}){tag}"
                if c.ok:
                    out.append(f"      {mark} {c.backend}{tag}")
                elif len(bad) == 1:
                    ch = bad[0]
                    out += wrap(f"{mark} {c.backend}: {ch.wording}{tag}",
                                "      ", hang="    ")
                else:
                    out.append(f"      {mark} {c.backend}:{tag}")
                    for ch in bad:
                        out += wrap(ch.wording, "          ",
                                    hang="    ")
    if p.warnings:
        out.append("")
        from .notices import shown
        out.append(f"{len(shown(p))} warning(s), on stderr")
    return "\n".join(out)
