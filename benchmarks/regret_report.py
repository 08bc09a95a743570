"""One report of policies' regret from `dispatch bench --check ... --format json` runs.

    python benchmarks/regret_report.py --label "calibration run" RUN.json ... \
        [--label "re-check" RUN.json ...] --card nvidia_h200 [--out DIR]

Each --label starts a group of JSON files (one per op, as the runner's calibrate suite
writes them). Per group, per checked policy: the worst picked / fastest ratio of every op and
the sizes above the threshold, then per op and size the times of every backend (served form:
per layer, per-batch work included) and each policy's pick. Writes
regret_<card>_<stamp>.md and .json into --out (default: benchmarks/results).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys

from results_dir import add_out, archive_previous  # the script's own folder


def load(path: str) -> dict:
    """A `dispatch bench --format json` document; lines a library printed before it are skipped."""
    text = open(path, encoding="utf-8").read()
    start = 0 if text.startswith("{") else text.index("\n{\n") + 1
    return json.loads(text[start:])


def _us(ms):
    return "" if ms is None else f"{ms * 1000:.1f}"


def group_lines(label: str, docs: list, threshold_default: float = 1.05) -> list:
    out = [f"## {label}", ""]
    first = docs[0]
    out += [f"- device: {first['device']['name']} (cc {first['device']['cc']}); shapes: {first.get('shapes')}",
            f"- served form: {first.get('served_form')}", f"- timer: {first['timer']}", ""]
    policies = list(dict.fromkeys(p for d in docs for p in (d.get("check") or {}).get("policies", ())))
    threshold = next(((d.get("check") or {}).get("threshold") for d in docs if d.get("check")), threshold_default)
    out += ["| op | " + " | ".join(f"{p}: worst" for p in policies) + " | sizes above " + f"{threshold:g} |",
            "|---|" + "---:|" * len(policies) + "---|"]
    for d in docs:
        rows = (d.get("check") or {}).get("rows", [])
        for op in d["ops"]:
            cells, above = [], []
            for p in policies:
                rs = [r for r in rows if r["policy"] == p and r["op"] == op]
                worst = max((r["ratio"] if r["ratio"] is not None else float("inf") for r in rs), default=None)
                cells.append("" if worst is None else f"{worst:.2f}")
                above += [f"{p}: {r['key']} {r['size']} {r['picked']} {r['ratio']:.2f}x {r['fastest']}"
                          if r["ratio"] is not None else f"{p}: {r['key']} {r['size']} {r['picked']} not timed"
                          for r in rs if r["ratio"] is None or r["ratio"] > threshold]
            out.append(f"| {op} | " + " | ".join(cells) + " | " + ("; ".join(above) or "none") + " |")
    out.append("")
    # What a caller pays outside batch(): every call does the per-batch work (served form
    # otherwise, i.e. checks off and in a graph where served so).
    outside = []
    for d in docs:
        for op, o in d["ops"].items():
            for r in o["rows"]:
                if r["ms"] and r.get("batch_ms") and r["batch_ms"] > 0.05 * r["ms"]:
                    outside.append(f"| {op} | {r['backend']} | {o['key']} {r['size']} | {_us(r['ms'])} | "
                                   f"{_us(r['layer_ms'] + r['batch_ms'])} | {(r['layer_ms'] + r['batch_ms']) / r['ms']:.2f} |")
    if outside:
        out += ["Called outside `capdispatch.batch()`, every call pays the per-batch work (backends where "
                "it is over 5% of the served time):", "",
                "| op | backend | size | served us | per call us | per call / served |",
                "|---|---|---|---:|---:|---:|"] + outside + [""]
    for d in docs:
        rows = (d.get("check") or {}).get("rows", [])
        for op, o in d["ops"].items():
            backends = list(dict.fromkeys(r["backend"] for r in o["rows"]))
            out += [f"### {op} (us per layer; per-batch work in brackets, once per forward)", "",
                    f"| {o['key']} | graph | " + " | ".join(backends) + " | " + " | ".join(policies) + " |",
                    "|---:|---|" + "---:|" * len(backends) + "---|" * len(policies)]
            for size in sorted({r["size"] for r in o["rows"]}):
                by = {r["backend"]: r for r in o["rows"] if r["size"] == size}
                g = any(r["graph"] for r in by.values())
                cells = []
                for b in backends:
                    r = by.get(b)
                    if r is None or r["ms"] is None:
                        cells.append("failed" if r is not None else "")
                        continue
                    extra = f" ({_us(r['batch_ms'])})" if r.get("batch_ms") else ""
                    cells.append(_us(r["ms"]) + extra)
                picks = []
                for p in policies:
                    r = next((r for r in rows if r["policy"] == p and r["op"] == op and r["size"] == size), None)
                    picks.append("" if r is None else f"{r['picked']} {r['ratio']:.2f}" if r["ratio"] is not None
                                 else f"{r['picked']} not timed")
                out.append(f"| {size} | {'yes' if g else 'no'} | " + " | ".join(cells) + " | " + " | ".join(picks) + " |")
            out.append("")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--card", required=True, help="the card's name in the file name, e.g. nvidia_h200")
    add_out(p)
    p.add_argument("--title", default="Regret of policies in the served form")
    p.add_argument("--label", action="append", default=[], help="starts a group of runs (repeatable)")
    p.add_argument("runs", nargs="*", metavar="RUN.json")
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = p.parse_known_args(argv)      # the runs after a second --label come back unparsed
    # The groups, in the order given: each --label takes the runs after it.
    groups, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--card", "--out", "--title"):
            i += 2
            continue
        if a == "--label":
            groups.append((argv[i + 1], []))
            i += 2
            continue
        if not groups:
            groups.append(("runs", []))
        groups[-1][1].append(a)
        i += 1
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    lines = [f"# {args.title}", "", f"Written {stamp} UTC by benchmarks/regret_report.py from "
             f"`dispatch bench --check` runs.", ""]
    obj = {"schema": 1, "groups": []}
    for label, paths in groups:
        docs = [load(path) for path in paths]
        lines += group_lines(label, docs)
        obj["groups"].append({"label": label, "runs": [{"file": os.path.basename(path), **d}
                                                       for path, d in zip(paths, docs)]})
    os.makedirs(args.out, exist_ok=True)
    series = f"regret_{args.card}"
    archive_previous(args.out, series)
    base = os.path.join(args.out, f"{series}_{stamp}")
    with open(base + ".md", "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines).rstrip() + "\n")
    with open(base + ".json", "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
    print(base + ".md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
