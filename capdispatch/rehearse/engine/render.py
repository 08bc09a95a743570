"""The engine rehearsal for people."""
from __future__ import annotations

from . import verdict


def _num(v, unit) -> str:
    if v is None:
        return "-"
    return f"{v:.3f} {unit}" if unit == "GiB" else f"{v:.1f} {unit}" if unit != "tokens/s" else f"{v:.0f} {unit}"


def render(r) -> str:
    lines = [f"engine rehearsal of {r.model} ({r.checkpoint}) in SGLang {r.on.version or '?'}: tp {r.tp} on "
             f"{', '.join(r.devices)}; {r.requests} greedy request(s) of {r.prompt} prompt tokens + {r.steps} "
             f"output tokens (seed {r.seed}); {r.wall_s:.1f} s", ""]
    for run in (r.on, r.off, r.reference):
        if run is None:
            if run is r.off:
                lines.append("plugin off: not run (the plugin-on run failed)")
            continue
        state = "ok" if run.ok else f"FAILED at {run.step}"
        ready = f", ready in {run.ready_s:.0f} s" if run.ready_s is not None else ""
        what = f" ({', '.join(r.reference_ops)} on their torch references)" if run.reference else ""
        kept = f"; kept from {run.kept_from} (the same launch, --off-from)" if run.kept_from else ""
        lines.append(f"{run.label}{what}: {state}{ready}; log {run.log or 'not kept (no --out)'}{kept}")
        lines.append(f"  {' '.join(run.command)}")
        if run.error:
            lines.append(f"  error: {run.error}")
        if run.log_tail:
            lines += ["  | " + x for x in run.log_tail.splitlines()]
    lines.append("")
    for k in r.on.reports:
        agreed = {None: "not agreed yet", True: "agreed", False: "NOT agreed"}[k.agreed]
        lines.append(f"rank {k.rank}  cuda:{k.gpu_id} {k.device}  (group {agreed}; report {k.path})")
        if k.emulated:
            e = k.emulated
            lines.append(f"  emulated: decided as the {e.get('name')} (cc {e.get('cc')}) on {e.get('on')}, "
                         f"the {e.get('device')} (cc {e.get('device_cc')}): {e.get('note') or ''}")
        for o in k.ops:
            lines.append(f"  {o.op:<15} {str(o.backend):<24} runs {str(o.runs):<22} {str(o.action):<9} "
                         f"{o.install or ''}")
    if r.on.reports:
        lines.append("")
    for op, why in r.not_called.items():
        lines.append(f"not rehearsed: {op}: {why}")
    if r.routed:
        lines.append("routed to capdispatch's kernels (tokens may differ; logprobs compared within "
                     f"{r.tolerance:g}): " + ", ".join(r.routed))
    if r.reference is not None:
        lines.append(f"the logprobs missed {r.tolerance:g}, so the reference run judged whose kernels are off: "
                     f"capdispatch's may be at most {verdict.REF_FACTOR:g} x as far from the ops' torch references "
                     f"as SGLang's own (or within {r.tolerance:g})")
    if r.settings_differ:
        lines.append(f"SGLang settings the runs resolved apart (logprobs compared within {r.tolerance:g}; give "
                     f"a setting after -- to compare the kernels alone): " + "; ".join(r.settings_differ))
    if r.on.reports and not r.routed and not r.settings_differ and r.comparisons:
        lines.append("every rank keeps SGLang's own kernels under the same settings: tokens must be identical")
    for c in r.comparisons:
        lines.append(f"  {'ok  ' if c.ok else 'DIFF'} {c.detail}")
    lines += ["", "measured vs predicted (rank 0; `dispatch plan`, `dispatch plan --speed`):"]
    for m in r.measures:
        d = m.to_dict()
        miss = "" if d["miss"] is None else f", {d['miss'] * 100:+.1f}%"
        bar = "" if d["within"] is None else (f" (within {m.bound:.0%})" if d["within"] else
                                              f" (MISSES the {m.bound:.0%} bar)")
        lines.append(f"  {m.name:<22} {_num(m.measured, m.unit):>14} vs {_num(m.predicted, m.unit):>14}{miss}{bar}"
                     + (f"; {m.note}" if m.note else ""))
    lines.append("")
    if r.out:
        lines.append(f"written to {r.out}")
    if r.cause:
        lines.append(f"first failure: {r.cause}")
    how = ("identical greedy tokens" if not (r.routed or r.settings_differ) else
           f"logprobs within {r.tolerance:g} per position up to a near tie"
           + (", or as close to the ops' torch references as SGLang's own" if r.reference is not None else ""))
    lines.append(f"{'PASSED' if r.ok else 'FAILED'}: plugin-on against plugin-off replies ({how}); every rank's "
                 f"report read, its routes installed and the group agreed")
    return "\n".join(lines)
