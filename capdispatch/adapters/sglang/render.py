"""The adapter's decisions as text for people, from its records: `dispatch sglang plan`
(plan.build gives a plan.LaunchPlan) and the one-paragraph log lines of the launch and
each rank (a records.Decision)."""
from __future__ import annotations

import attrs

MARKS = {"routed": "routed", "kept": "kept  ", "reported": "report"}
# The matrix's cell suffix per action, and its legend line.
ACTION_TAGS = {"routed": ("(routed)", "(routed): capdispatch's kernel at SGLang's call site"),
               "kept": ("(kept)", "(kept): SGLang's own kernel runs"),
               "reported": ("(report)", "(report): decided and reported, not carried out")}


def matrix(plan, *, color=None, width=None, ascii_only=None, stream=None, brief: bool = False) -> str:
    """The op x rank table of PLAN (plan.LaunchPlan): per cell the kernel and what SGLang
    does with it (routed / kept / report), fallbacks, downgrades and divergent rows marked
    as `dispatch explain` marks them; whose libraries below, and how many warnings follow
    (under BRIEF the mixed-group divergences count as their one summary line)."""
    import capdispatch as cd
    from capdispatch import extend
    Cell, Row = extend.Cell, extend.Row
    if not plan.ranks:
        return ""
    cols = [f"cuda:{r.gpu_id} (rank {r.rank})\n{_short(r.device.name)}"
            + (f", cc {r.device.cc_str}" if r.device.cc else "") for r in plan.ranks]
    rows, used = [], set()
    for op in plan.ops:
        cs = [r.choices[op] for r in plan.ranks]
        used.update(c.action for c in cs)
        for c in cs:
            used.update(b.action for b in c.bucket_rows())
        cells = tuple(Cell(cell_text(c), c.kind) for c in cs)
        rows.append(Row(op, cells, diverges=len({c.backend for c in cs}) > 1))
    legend = [ACTION_TAGS[a][1] for a in ACTION_TAGS if a in used]
    shown = brief_warnings(plan) if brief else plan.warnings
    caption = "\n".join(legend + [f"libraries: {plan.whose}"
                                  + (f"; {len(shown)} warning(s) below" if shown else "")])
    kw = dict(color=color, ascii_only=ascii_only, stream=stream)
    table = cd.render_matrix(cols, rows, caption=caption, width=width, **kw)
    if table != cd.render_matrix(cols, rows, caption=caption, width=10**6, **kw):
        # Wider than the terminal: identical cards deciding alike share a column, as in explain.
        grouped = _rank_columns(plan, rows)
        if grouped is not None:
            gcols, grows = grouped
            many = "s" if len(gcols) > 1 else ""
            caption = (f"{len(plan.ranks)} ranks in {len(gcols)} column{many}: identical cards deciding "
                       f"alike share one (xN cards)\n" + caption)
            table = cd.render_matrix(gcols, grows, caption=caption, width=width, **kw)
    return table


def brief_warnings(plan) -> list:
    """PLAN's warnings as --brief shows them: the mixed-group divergences as one summary
    line after the rest, as `dispatch explain --brief` says them."""
    rest = [w for w in plan.warnings if w not in plan.divergent]
    return rest + ([plan.mixed_summary] if plan.mixed_summary and plan.divergent else [])


def _rank_columns(plan, rows):
    """(headers, rows) with the ranks of one card (name, compute capability) whose cells are
    the same in every row in one column; None when no two ranks share one."""
    groups = {}
    for i, r in enumerate(plan.ranks):
        key = (r.device.name, r.device.cc_str, tuple(row.cells[i] for row in rows))
        groups.setdefault(key, []).append(i)
    if len(groups) == len(plan.ranks):
        return None
    headers = []
    for (name, cc, _), idx in groups.items():
        card = _short(name) + (f", cc {cc}" if cc else "")
        if len(idx) == 1:
            r = plan.ranks[idx[0]]
            headers.append(f"cuda:{r.gpu_id} (rank {r.rank})\n{card}")
            continue
        gpus = _ranges([plan.ranks[i].gpu_id for i in idx])
        ranks = _ranges([plan.ranks[i].rank for i in idx])
        headers.append(f"cuda:{gpus} x{len(idx)}\n{card}\nranks {ranks}")
    members = list(groups.values())
    return headers, [type(r)(r.label, tuple(r.cells[idx[0]] for idx in members), r.diverges) for r in rows]


def _ranges(numbers) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ",".join(parts)


def runs(c) -> str:
    """The kernel a cell names: what runs (SGLang's own where kept), else the decision."""
    return c.runs or c.backend or "sglang"


def merged(c) -> tuple:
    """C's size buckets for people (records.BucketChoice...): adjacent buckets that run one
    kernel the same way merged into one; one bucket or none: ()."""
    out = []
    for b in c.bucket_rows():
        if out and (out[-1].runs, out[-1].action, out[-1].backend) == (b.runs, b.action, b.backend):
            out[-1] = attrs.evolve(out[-1], upper=b.upper)
        else:
            out.append(b)
    return tuple(out) if len(out) >= 2 else ()


def cell_text(c) -> str:
    """One op on one rank: the kernel that runs and how; with size buckets, per bucket
    ("<=64 triton_fp8 (routed), >64 flashmla (kept)"; one tag when all agree)."""
    bs = merged(c)
    if not bs:
        return f"{runs(c)} {ACTION_TAGS[c.action][0]}"
    same = len({b.action for b in bs}) == 1
    parts = [f"{b.label()} {b.runs}" + ("" if same else f" {ACTION_TAGS[b.action][0]}") for b in bs]
    return ", ".join(parts) + (f" {ACTION_TAGS[bs[0].action][0]}" if same else "")


def _short(name: str) -> str:
    for prefix in ("NVIDIA ", "GeForce "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _inventory_lines(plan) -> list:
    lines = [f"libraries: {plan.whose}"]
    if plan.inventory.get("note"):
        lines.append(f"note: {plan.inventory['note']}")
    return lines


def _shape_lines(plan) -> list:
    """The model's rank shapes and every backend they put outside its declared range."""
    s = plan.shapes
    if s is None:
        return []
    layout = f"tp {s.tp}" + (f" ep {s.ep}" if s.ep != 1 else "") + (" dp-attention" if s.dp_attention else "")
    lines = [f"shapes: {s.model} at {layout}, per rank: heads {s.heads}, indexer heads "
             f"{s.indexer_heads}, next_n {s.next_n}, experts {s.experts}, expert "
             f"intermediate {s.moe_intermediate}"]
    rej = plan.shape_rejections
    if not rej:
        lines.append("  every backend's shape ranges admit these shapes")
    seen = set()
    for r in rej:
        key = (r.op, r.backend, r.code)
        if key in seen:
            continue
        seen.add(key)
        on = sorted({x.device for x in rej if (x.op, x.backend, x.code) == key})
        lines.append(f"  not runnable: {r.op}/{r.backend} on {', '.join(on)}: {r.wording}")
    return lines


def text(plan, *, brief: bool = False, color=None, stream=None) -> str:
    """PLAN (plan.LaunchPlan) for people: the op x rank matrix, then (unless BRIEF) the
    launch settings, each rank's choices and the SGLang settings."""
    s = plan.sglang
    head = f"SGLang {s.version}"
    if not s.installed:
        head += " (not installed: planning with its knob map)"
    lines = [f"{head}; tested range {s.tested}"]
    if not s.in_range:
        lines.append(plan.note)
        return "\n".join(lines)
    m = plan.model
    lines.append(f"model: {m.architecture}" + (" (assumed; pass `-- SGLANG ARGS` to plan a real launch)"
                                               if m.assumed else "")
                 + f"; capdispatch ops: {', '.join(plan.ops) or 'none'} ({plan.reason})")
    lines.append(f"GPUs: {', '.join(f'cuda:{g}' for g in plan.gpu_ids)}")
    lines += _inventory_lines(plan)
    lines += _shape_lines(plan)
    lines.append("")
    table = matrix(plan, color=color, stream=stream, brief=brief)
    if brief:
        below = [f"  {w}" for w in brief_warnings(plan)]
        below = ["", "warnings:"] + below if below else []
        return "\n".join(_wrapped([table] + _inventory_lines(plan)[1:] + below if table else lines)).rstrip("\n")
    if table:
        lines += [table, ""]
    lines.append("launch (main process; every rank inherits it):")
    if not plan.launch:
        lines.append("  nothing to set")
    for x in plan.launch:
        if x.action == "kept" and x.value == x.rule.value:
            lines.append(f"  kept  {x.label}  (set by the user; capdispatch wants the same)")
        elif x.action == "kept":
            lines.append(f"  kept  {x.label}  (set by the user; capdispatch wants {x.rule.value} for "
                         f"{', '.join(x.devices)}: {x.why})")
        else:
            lines.append(f"  set   {x.label}  ({x.why})")
    for r in plan.ranks:
        dev = r.device
        how = "simulated" if dev.probe == "sim" else f"probed: {dev.probe}"
        lines.append("")
        lines.append(f"rank {r.rank}: cuda:{r.gpu_id} {dev.name}, cc {dev.cc_str} ({how})")
        width = max((len(op) for op in r.choices), default=0)
        bwidth = max([10] + [len(_named(c)) for c in r.choices.values()])
        # The reason wraps under itself when that leaves it room, else under the op.
        hang = " " * (width + bwidth + 12) if width + bwidth + 12 <= 36 else "    "
        for op, c in r.choices.items():
            lines.append((f"  {op:<{width}}  {_named(c):<{bwidth}}  {MARKS[c.action]}  {c.why}", hang))
            key = _size_key(c)
            for b in merged(c):
                lines.append(f"  {'':<{width}}    {key} {b.label()}: {b.runs} {MARKS[b.action].strip()}"
                             + (f" (capdispatch decided {b.backend})" if b.runs != b.backend else ""))
        facts = " ".join(f"{k}={v}" for k, v in r.arch.items())
        lines.append(f"  architecture facts set for this rank: {facts}")
    if plan.sglang_settings:
        lines.append("")
        lines.append("SGLang settings each rank's choice needs (reported, not set; SGLang takes one "
                     "value per launch):")
        for x in plan.sglang_settings:
            label = x.name if x.kind == "field" else f"env {x.name}"
            if x.action == "kept":
                head = f"kept   {label}={x.user}  (set by the user)"
            elif x.action == "agree":
                head = f"agree  {label}={x.value}"
            elif x.action == "split":
                head = f"split  {label}"
            else:
                head = f"none   {label}"
            lines.append(f"  {head}  ({x.why})")
    if plan.resolved:
        lines.append("")
        lines.append("SGLang resolved: " + ", ".join(f"{k}={v}" for k, v in plan.resolved.items()))
    if plan.warnings:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  {w}" for w in plan.warnings]
    return "\n".join(_wrapped(lines))


def _wrapped(lines) -> list:
    """LINES at the terminal's width: the matrix (a multi-line entry) as drawn, each other
    line wrapped under its own indent, or (LINE, HANG) with that hanging indent."""
    import capdispatch as cd
    from capdispatch import extend
    out = []
    for line in lines:
        line, hang = line if isinstance(line, tuple) else (line, "    ")
        out += line.split("\n") if "\n" in line else extend.wrap_lines([line], hang=hang)
    return out


def _size_key(c) -> str:
    res = c.resolution
    return (res.size_key if res is not None else None) or "size"


def _named(c) -> str:
    """The rank line's kernel: the decision where routed or reported, what runs where
    kept; "by <size>" where buckets follow."""
    if merged(c):
        return f"by {_size_key(c)}"
    if c.action == "kept":
        return c.runs or c.backend or "-"
    return c.backend or "-"


def summary(d, *, settings: bool = True) -> str:
    """One paragraph for a log line: per op, which devices run what and why
    (and, for a launch, the settings)."""
    parts = []
    for op, row in d.choices.items():
        kept = [c.device for c in row.values() if c.action == "kept"]
        text = [f"SGLang's own kernel on {', '.join(kept)}"] if kept else []
        by = {}
        for c in row.values():
            if c.action != "kept":
                by.setdefault((c.action, c.routed_backends if c.routed else c.backend), []).append(c)
        for (action, backend), cs in by.items():
            verb = "capdispatch" if action == "routed" else "decided (reported, not carried out)"
            text.append(f"{verb} {backend} on {', '.join(c.device for c in cs)} ({cs[0].why})")
        parts.append(f"{op}: {'; '.join(text)}")
    for s in d.settings if settings else ():
        if s.action == "kept":
            parts.append(f"kept the user's {s.name}={s.value}")
        elif s.rule.routed:
            parts.append(f"set {s.label} for {', '.join(s.devices)} ({s.why})")
        else:
            parts.append(f"set {s.label} ({s.why})")
    return "; ".join(parts)
