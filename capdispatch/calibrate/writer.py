"""A calibration as a policy file: one `devices:` entry matched by the card's name and
compute capability, size buckets per op, the measured times as YAML comments."""
from __future__ import annotations

import re
from typing import Optional

import yaml


def fmt_ms(ms: float) -> str:
    if ms < 1.0:
        return f"{ms * 1000:.3g} us"
    return f"{ms:.4g} ms"


def device_match(spec, known_names=()) -> dict:
    """How the written entry finds this card again: by name and cc (the catalog's key
    when the card is in the catalog), by id for the CPU or a card the catalog lacks."""
    if spec.platform != "cuda":
        return {"id": spec.id}
    name = spec.catalog_key or spec.name
    if known_names and name.lower() not in known_names:
        return {"id": spec.id.split("#")[0], "cc": spec.cc_str}
    return {"name": name, "cc": spec.cc_str}


def incumbents(policy_file, match: dict):
    """(op -> size -> first backend) of POLICY_FILE's entry with exactly MATCH, and the
    entries for other cards (which a rewrite would lose)."""
    mine, others = None, []
    for e in policy_file.devices:
        if e.match == match:
            mine = e
        else:
            others.append(e)
    out = {}
    if mine is not None:
        for op, m in mine.ops.items():
            out[op] = _lookup(m)
    return out, others, mine


def _lookup(m):
    buckets = m.buckets or ()

    def first(size: int) -> Optional[str]:
        for b in buckets:
            if b.upper is None or size <= b.upper:
                return b.backends[0]
        return m.value[0]
    return first


MARK = "# Calibrated by `dispatch bench`"


def op_blocks(text: str) -> dict:
    """op -> its lines (comments included) in a file this module wrote; {} for any other,
    and for one edited to hold YAML anchors or aliases: a kept block copied as text may
    name an anchor the rewrite drops, so such a file's kept ops are written from their
    values (`render_policy` with an OpPreference), which hold no aliases."""
    if not text.startswith(MARK) or _has_aliases(text):
        return {}
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^      (\w+):", line)
        if m:
            current = m.group(1)
            out[current] = []
        elif not line.startswith("        "):
            current = None
        if current is not None:
            out[current].append(line)
    return out


def _has_aliases(text: str) -> bool:
    """Does TEXT (YAML) hold an anchor (&a) or an alias (*a)? Text that does not parse
    counts as holding one: its blocks are then not copied."""
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                return True
    except (yaml.YAMLError, RecursionError):
        return True
    return False


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_policy(match: dict, per_op: dict, *, key_of, header=(), kept_ops=None, excluded=None,
                  graphed=None, unmeasured=None, measured_with=None, settings=None) -> str:
    """PER_OP: op -> list of Runs (calibrate.choose.merge). KEY_OF: op -> bucket key.
    KEPT_OPS: op -> what the previous file said for an op not measured now: its lines
    (`op_blocks`) or, for a file written by hand, its OpPreference.
    EXCLUDED: op -> {backend: why} (runnable, but not measured or failed its check).
    GRAPHED: op -> sizes timed inside a CUDA graph.
    UNMEASURED: op -> backends this card could not run: each bucket names them, so the resolver
    keeps them at their default place (`unmeasured:`).
    MEASURED_WITH: library -> version ("absent") the run had: serving elsewhere warns.
    SETTINGS: the previous file's `mixed_group` / `on_unsupported` / `verify`, kept."""
    lines = [f"# {h}" if h else "#" for h in header]
    lines += ["schema: 1"]
    lines += [f"{k}: {v}" for k, v in (settings or {}).items()]
    lines += ["devices:"]
    m = ", ".join(f"{k}: {_q(str(v))}" for k, v in match.items())
    lines += [f"  - match: {{{m}}}"]
    if measured_with:
        libs = ", ".join(f"{k}: {_q(str(v))}" for k, v in sorted(measured_with.items()))
        lines.append(f"    measured_with: {{{libs}}}")
    lines.append("    ops:")
    for op, runs in per_op.items():
        key = key_of(op)
        lines.append(f"      {op}:")
        for why in (excluded or {}).get(op, {}).items():
            lines.append(f"        # not in the buckets: {why[0]} ({why[1]})")
        for run in runs:
            for c in run.choices:
                graph = " in a CUDA graph" if c.size in (graphed or {}).get(op, ()) else ""
                times = ", ".join(f"{b} {fmt_ms(c.times[b])}" for b in c.order)
                kept = f" ({c.winner} kept: within the noise band)" if c.kept else ""
                lines.append(f"        # {key} {c.size}{graph}: {times}{kept}")
            bound = f"{key}: \"<={run.upper}\", " if run.upper is not None else ""
            skip = (unmeasured or {}).get(op, ())
            tail = f", unmeasured: [{', '.join(skip)}]" if skip else ""
            lines.append(f"        - {{{bound}prefer: [{', '.join(run.order)}]{tail}}}")
    for op, pref in (kept_ops or {}).items():
        if isinstance(pref, list):      # the earlier calibration's own lines, times included
            lines += pref
            continue
        key = key_of(op)
        lines.append(f"      {op}:    # kept from the earlier calibration (not measured in this run)")
        if not pref.buckets:
            lines.append(f"        - {{prefer: [{', '.join(pref.value)}]}}")
        for b in pref.buckets:
            bound = f"{key}: \"<={b.upper}\", " if b.upper is not None else ""
            lines.append(f"        - {{{bound}prefer: [{', '.join(b.backends)}]}}")
    return "\n".join(lines) + "\n"
