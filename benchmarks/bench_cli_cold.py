"""Cold `dispatch explain` on simulated devices: wall time of a fresh process.

    python benchmarks/bench_cli_cold.py [--runs 21] [--out DIR | --file PATH]

Each run starts a new interpreter (nothing cached), explains the mixed rig
(an RTX 5090 beside two RTX 3080s) for every op, and is timed with a monotonic host clock. Target: median <= 0.5 s.
The result goes to a new file, DIR/cli_cold_<UTC timestamp>.json (DIR: benchmarks/results),
or to PATH: a measurement never rewrites an earlier one.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata

from results_dir import add_out, archive_previous  # the script's own folder

ARGS = ["explain", "--device", "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080", "--assume-lib", "triton",
        "--format", "json"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=21, help="timed runs (default 21)")
    add_out(ap, help="folder for a new timestamped result file (default benchmarks/results)")
    ap.add_argument("--file", help="write the result to this path instead")
    a = ap.parse_args()
    cmd = [sys.executable, "-m", "capdispatch", *ARGS]
    subprocess.run(cmd, capture_output=True, check=True)   # warm the OS file cache only
    times = []
    for _ in range(a.runs):
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True)
        times.append(time.perf_counter() - t0)
        if p.returncode != 0:
            print(p.stderr.decode(), file=sys.stderr)
            return 1
    med = statistics.median(times)
    res = {
        "benchmark": "cold dispatch explain (3 simulated devices, all ops)",
        "command": "dispatch " + " ".join(ARGS),
        "runs": a.runs, "median_s": round(med, 4), "min_s": round(min(times), 4),
        "max_s": round(max(times), 4), "target_s": 0.5,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "python": platform.python_version(),
        "versions": {d: _v(d) for d in ("capdispatch", "attrs", "PyYAML", "packaging")},
        "date": _dt.date.today().isoformat(),
    }
    path = a.file or result_path(a.out)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if not a.file:
        archive_previous(a.out, "cli_cold")
    with open(path, "x") as fh:      # "x": an existing result is never overwritten
        json.dump(res, fh, indent=2)
    print(json.dumps(res, indent=2))
    return 0 if med <= 0.5 else 1


def result_path(folder: str, now=None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return os.path.join(folder, f"cli_cold_{now.strftime('%Y%m%dT%H%M%SZ')}.json")


def _v(dist):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
