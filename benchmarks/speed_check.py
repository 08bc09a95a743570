"""How well `dispatch plan --speed` predicts measured times: the predictions made from one
calibration run (`dispatch bench` JSON, one per op) against a second, independent measurement of
the same card in the served form (the re-check run `dispatch bench --check` writes).

For every op, backend and size the second run measured:
* same size: the first run's time at that size (run-to-run error);
* left out: the first run's times with that size removed, interpolated as the planner does
  (log-log between the neighbours; error of the interpolation plus run-to-run);
and per step (decode at batch 1, 8, 32 and a 4096-token prefill, at the runs' own shapes):
the planner's step from the first run against the same step from the second.

    python benchmarks/speed_check.py RUN_DIR [--out benchmarks/results]

RUN_DIR holds calibrate_<op>.json and recheck_<op>.json (as benchmarks/results/h200-2026-12-03/).
Writes speed_check_<card>_<stamp>.json and .md. Needs no GPU.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import statistics
import sys

from results_dir import add_out, archive_previous  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import capdispatch as cd  # noqa: E402 (after the path insertion)
from capdispatch import bench  # noqa: E402

speed = bench.speed


def _runs(run_dir, prefix):
    files = sorted(glob.glob(os.path.join(run_dir, f"{prefix}_*.json")))
    if not files:
        raise SystemExit(f"speed_check: no {prefix}_*.json in {run_dir}")
    return speed.merged([speed.load(f) for f in files])[0]


def points(first, second) -> list:
    rows = []
    for op, backends in second.times.items():
        for b, pts in backends.items():
            base = first.times.get(op, {}).get(b)
            if not base:
                continue
            for n, ms in pts:
                same = first.time(op, b, n)
                rest = tuple(p for p in base if p[0] != n)
                inside = rest and rest[0][0] < n < rest[-1][0]
                loo = speed.interpolate(rest, n) if inside else None
                rows.append({"op": op, "backend": b, "size": n, "measured_ms": ms, "same_ms": same,
                             "same_err": (same - ms) / ms, "left_out_ms": loo,
                             "left_out_err": (loo - ms) / ms if loo is not None else None})
    return rows


def steps(first, second) -> list:
    """The planner's step per phase from each run, at the runs' shapes, with every op's
    backend the fastest the first run measured."""
    import capdispatch as cd
    if not first.shapes_text:
        return []
    meta = _meta_shapes(first)
    model = cd.load_model(meta["model"])
    shapes = model.for_rank(meta["tp"], meta["ep"], meta["dp"])
    spec = cd.probe("sim:" + first.card)
    out = []
    for phase, sizes in (("decode", speed.DECODE_BATCHES), ("prefill", (speed.DEFAULT_PREFILL,))):
        for n in sizes:
            row = {"phase": phase, "size": n}
            for name, cal in (("first", first), ("second", second)):
                total = 0.0
                for op in first.times:
                    size = speed.call_size(op, phase, n, shapes.next_n)
                    if size is None:
                        continue
                    b, _ = first.fastest(op, size)
                    t = speed.op_time(op, b, size, shapes, spec, [cal])
                    total += t.ms
                row[name] = total
            row["err"] = (row["first"] - row["second"]) / row["second"]
            out.append(row)
    return out


def _meta_shapes(cal):
    import re
    m = re.match(r"^(?P<model>\S+) at tp (?P<tp>\d+), ep (?P<ep>\d+)(?P<dp>, dp-attention)?", cal.shapes_text)
    return {"model": m["model"], "tp": int(m["tp"]), "ep": int(m["ep"]), "dp": bool(m["dp"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    add_out(p)
    args = p.parse_args(argv)
    first, second = _runs(args.run_dir, "calibrate"), _runs(args.run_dir, "recheck")
    first_json = json.loads(_json_text(sorted(glob.glob(os.path.join(args.run_dir, "calibrate_*.json")))[0]))
    rows = points(first, second)
    st = steps(first, second)
    same = [abs(r["same_err"]) for r in rows]
    loo = [abs(r["left_out_err"]) for r in rows if r["left_out_err"] is not None]
    summary = {"points": len(rows), "same_median": statistics.median(same), "same_max": max(same),
               "left_out_points": len(loo), "left_out_median": statistics.median(loo) if loo else None,
               "left_out_p90": sorted(loo)[int(0.9 * (len(loo) - 1))] if loo else None,
               "step_max": max(abs(s["err"]) for s in st) if st else None}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"speed_check_{first_json['device']['name'].lower().replace(' ', '_')}"
    os.makedirs(args.out, exist_ok=True)
    archive_previous(args.out, name)
    base = os.path.join(args.out, f"{name}_{stamp}")
    result = {"run_dir": os.path.basename(os.path.normpath(args.run_dir)), "shapes": first_json.get("shapes"),
              "summary": summary, "steps": st, "points": rows}
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# Speed prediction vs measurement on {first_json['device']['name']}", "",
             f"Predictions from the calibration run of {result['run_dir']} against its re-check run "
             f"(the served form, {first_json.get('shapes')}).", "",
             f"- {summary['points']} op times: the first run's time at the same size is within "
             f"{100 * summary['same_median']:.1f}% (median), {100 * summary['same_max']:.1f}% (max) of the second's.",
             f"- {summary['left_out_points']} sizes left out of the first run and interpolated: "
             + (f"{100 * summary['left_out_median']:.1f}% median, {100 * summary['left_out_p90']:.1f}% "
                f"at the 90th percentile." if loo else "none."),
             "", "| step | from calibrate ms | from recheck ms | error |", "|---|---|---|---|"]
    for s in st:
        label = f"decode batch {s['size']}" if s["phase"] == "decode" else f"prefill {s['size']}"
        lines.append(f"| {label} | {s['first']:.3f} | {s['second']:.3f} | {100 * s['err']:+.1f}% |")
    lines += ["", "The step counts the ops' times only (the planner adds weight reads and all-reduces, which "
              "these runs do not measure).", ""]
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {base}.json and .md")
    return 0


def _json_text(path):
    text = open(path, encoding="utf-8").read()
    return text[0 if text.lstrip().startswith("{") else text.index("\n{") + 1:]


if __name__ == "__main__":
    sys.exit(main())
