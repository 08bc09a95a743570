"""The adapter's decisions as text for people: `dispatch sglang plan` (plan.build
gives the data) and the one-paragraph log lines of the launch and each rank."""
from __future__ import annotations

MARKS = {"routed": "routed", "kept": "kept  ", "reported": "report"}
# The matrix's cell suffix per action, and its legend line.
ACTION_TAGS = {"routed": ("(routed)", "(routed): capdispatch's kernel at SGLang's call site"),
               "kept": ("(kept)", "(kept): SGLang's own kernel runs"),
               "reported": ("(report)", "(report): decided and reported, not carried out")}


def whose(out) -> str:
    return (out.get("inventory") or {}).get("whose", "this machine's")


def matrix(out, *, color=None, width=None, ascii_only=None, stream=None) -> str:
    """The op x rank table of plan OUT (plan.build): per cell the backend and what
    SGLang does with it (routed / kept / report), fallbacks, downgrades and
    divergent rows marked as `dispatch explain` marks them; whose libraries below."""
    import capdispatch as cd
    Cell, Row = cd.Cell, cd.Row
    ranks = out.get("ranks") or []
    if not ranks:
        return ""
    cols = [f"cuda:{r['gpu_id']} (rank {r['rank']})\n{_short(r['device']['name'])}"
            + (f", cc {r['device']['cc']}" if r["device"].get("cc") else "") for r in ranks]
    rows, used = [], set()
    for op in out["ops"]:
        cs = [r["ops"][op] for r in ranks]
        used.update(c["action"] for c in cs)
        for c in cs:
            used.update(b["action"] for b in c.get("buckets") or ())
        cells = tuple(Cell(cell_text(c), c["kind"]) for c in cs)
        rows.append(Row(op, cells, diverges=len({c["backend"] for c in cs}) > 1))
    legend = [ACTION_TAGS[a][1] for a in ACTION_TAGS if a in used]
    caption = "\n".join(legend + [f"libraries: {whose(out)}"
                                  + (f"; {len(out['warnings'])} warning(s) below" if out["warnings"] else "")])
    return cd.render_matrix(cols, rows, caption=caption, color=color, width=width,
                            ascii_only=ascii_only, stream=stream)


def runs(c) -> str:
    """The kernel a cell names: what runs (SGLang's own where kept), else the decision."""
    return c.get("runs") or c["backend"] or "sglang"


def merged(c) -> list:
    """C's size buckets for people: adjacent buckets that run one kernel the same way
    merged, each as (label, runs, action, backend); one bucket or none: []."""
    out = []
    for b in c.get("buckets") or ():
        if out and (out[-1]["runs"], out[-1]["action"], out[-1]["backend"]) == (b["runs"], b["action"], b["backend"]):
            out[-1]["upper"] = b["upper"]
        else:
            out.append(dict(b))
    if len(out) < 2:
        return []
    return [((f"<={b['upper']}" if b["upper"] is not None else f">{b['lower']}" if b["lower"] is not None
              else "any"), b["runs"], b["action"], b["backend"]) for b in out]


def cell_text(c) -> str:
    """One op on one rank: the kernel that runs and how; with size buckets, per bucket
    ("<=64 triton_fp8 (routed), >64 flashmla (kept)"; one tag when all agree)."""
    bs = merged(c)
    if not bs:
        return f"{runs(c)} {ACTION_TAGS[c['action']][0]}"
    same = len({a for _, _, a, _ in bs}) == 1
    parts = [f"{label} {r}" + ("" if same else f" {ACTION_TAGS[a][0]}") for label, r, a, _ in bs]
    return ", ".join(parts) + (f" {ACTION_TAGS[bs[0][2]][0]}" if same else "")


def _short(name: str) -> str:
    for prefix in ("NVIDIA ", "GeForce "):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _inventory_lines(out) -> list:
    inv = out.get("inventory") or {}
    lines = [f"libraries: {whose(out)}"]
    if inv.get("note"):
        lines.append(f"note: {inv['note']}")
    return lines


def _shape_lines(out) -> list:
    """The model's rank shapes and every backend they put outside its declared range."""
    s = out.get("shapes")
    if not s:
        return []
    layout = f"tp {s['tp']}" + (f" ep {s['ep']}" if s["ep"] != 1 else "") + \
        (" dp-attention" if s["dp_attention"] else "")
    lines = [f"shapes: {s['model']} at {layout}, per rank: heads {s['heads']}, indexer heads "
             f"{s['indexer_heads']}, next_n {s['next_n']}, experts {s['experts']}, expert "
             f"intermediate {s['moe_intermediate']}"]
    rej = out.get("shape_rejections") or []
    if not rej:
        lines.append("  every backend's shape ranges admit these shapes")
    seen = set()
    for r in rej:
        key = (r["op"], r["backend"], r["code"])
        if key in seen:
            continue
        seen.add(key)
        on = sorted({x["device"] for x in rej if (x["op"], x["backend"], x["code"]) == key})
        lines.append(f"  not runnable: {r['op']}/{r['backend']} on {', '.join(on)}: {r['wording']}")
    return lines


def text(out, *, brief: bool = False, color=None, stream=None) -> str:
    """The plan for people: the op x rank matrix, then (unless BRIEF) the launch
    settings, each rank's choices and the SGLang settings."""
    s = out["sglang"]
    head = f"SGLang {s['version']}"
    if not s["installed"]:
        head += " (not installed: planning with its knob map)"
    lines = [f"{head}; tested range {s['tested']}"]
    if not s["in_range"]:
        lines.append(out["note"])
        return "\n".join(lines)
    m = out["model"]
    lines.append(f"model: {m['architecture']}" + (" (assumed; pass `-- SGLANG ARGS` to plan a real launch)"
                                                   if m["assumed"] else "")
                 + f"; capdispatch ops: {', '.join(out['ops']) or 'none'} ({out['reason']})")
    lines.append(f"GPUs: {', '.join(f'cuda:{g}' for g in out['gpu_ids'])}")
    lines += _inventory_lines(out)
    lines += _shape_lines(out)
    lines.append("")
    table = matrix(out, color=color, stream=stream)
    if brief:
        return "\n".join([table] + _inventory_lines(out)[1:]) if table else "\n".join(lines).rstrip("\n")
    if table:
        lines += [table, ""]
    lines.append("launch (main process; every rank inherits it):")
    if not out["launch"]:
        lines.append("  nothing to set")
    for x in out["launch"]:
        label = f"{x['name']}={x['value']}" if x["kind"] == "field" else f"env {x['name']}={x['value']}"
        if x["action"] == "kept" and x["value"] == x["wants"]:
            lines.append(f"  kept  {label}  (set by the user; capdispatch wants the same)")
        elif x["action"] == "kept":
            lines.append(f"  kept  {label}  (set by the user; capdispatch wants {x['wants']} for "
                         f"{', '.join(x['devices'])}: {x['why']})")
        else:
            lines.append(f"  set   {label}  ({x['why']})")
    for r in out["ranks"]:
        dev = r["device"]
        how = "simulated" if dev["probe"] == "sim" else f"probed: {dev['probe']}"
        lines.append("")
        lines.append(f"rank {r['rank']}: cuda:{r['gpu_id']} {dev['name']}, cc {dev['cc']} ({how})")
        width = max((len(op) for op in r["ops"]), default=0)
        bwidth = max([10] + [len(_named(c)) for c in r["ops"].values()])
        for op, c in r["ops"].items():
            lines.append(f"  {op:<{width}}  {_named(c):<{bwidth}}  {MARKS[c['action']]}  {c['why']}")
            key = c.get("size_key") or "size"
            for label, ran, a, backend in merged(c):
                lines.append(f"  {'':<{width}}    {key} {label}: {ran} {MARKS[a].strip()}"
                             + (f" (capdispatch decided {backend})" if ran != backend else ""))
        facts = " ".join(f"{k}={v}" for k, v in r["arch"].items())
        lines.append(f"  architecture facts set for this rank: {facts}")
    if out.get("sglang_settings"):
        lines.append("")
        lines.append("SGLang settings each rank's choice needs (reported, not set; SGLang takes one "
                     "value per launch):")
        for x in out["sglang_settings"]:
            label = x["name"] if x["kind"] == "field" else f"env {x['name']}"
            if x["action"] == "kept":
                head = f"kept   {label}={x['user']}  (set by the user)"
            elif x["action"] == "agree":
                head = f"agree  {label}={next(iter(x['wants']))}"
            elif x["action"] == "split":
                head = f"split  {label}"
            else:
                head = f"none   {label}"
            lines.append(f"  {head}  ({x['why']})")
    if out.get("sglang_resolved"):
        lines.append("")
        lines.append("SGLang resolved: " + ", ".join(f"{k}={v}" for k, v in out["sglang_resolved"].items()))
    if out["warnings"]:
        lines.append("")
        lines.append("warnings:")
        lines += [f"  {w}" for w in out["warnings"]]
    return "\n".join(lines)


def _named(c) -> str:
    """The rank line's kernel: the decision where routed or reported, what runs where
    kept; "by <size>" where buckets follow."""
    if merged(c):
        return f"by {c.get('size_key') or 'size'}"
    if c["action"] == "kept":
        return c.get("runs") or c["backend"] or "-"
    return c["backend"] or "-"


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
            parts.append(f"kept the user's {s.setting.name}={s.value}")
        elif s.setting.routed:
            parts.append(f"set {s.setting.label} for {', '.join(s.devices)} ({s.setting.why})")
        else:
            parts.append(f"set {s.setting.label} ({s.setting.why})")
    return "; ".join(parts)
