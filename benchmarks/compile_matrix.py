"""Compile every Triton kernel of every op, in each variant a card's policy can choose,
offline for each catalog architecture (no GPU), and write the table of registers,
spills and shared memory to benchmarks/results/compile_matrix.md.

    python -m benchmarks.compile_matrix [--targets sm_86,sm_90] [--cover] [--out PATH] [--json]

Exits 1 when a row is not ok (a kernel that does not compile for a target, or needs
more shared memory than the target has).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)    # the interpreter's triton.jit compiles nothing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from capdispatch import bench  # noqa: E402

M = bench.compile_matrix

DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results", "compile_matrix.md")


def _cell(v) -> str:
    return "-" if v is None else str(v)


def markdown(rows, seconds: float, cover: bool = False) -> str:
    import triton
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    bad = [r for r in rows if not r.ok]
    lines = [
        "# Triton compile matrix",
        "",
        f"Triton {triton.__version__}, {day}; offline compiles (`triton.compile` for a `GPUTarget`, no GPU), "
        f"{len(rows)} rows in {seconds:.0f} s. Written by `python -m benchmarks.compile_matrix"
        + (" --cover`: the covering set, each (kernel, variant) once on the tightest target that can "
           "choose it (least opt-in shared memory, then lowest compute capability)." if cover else
           "`: every target.")
        ,
        "",
        "Each row is one kernel in one variant that the target's policy can choose: native-fp8 variants only "
        "where `fp8_e4m3` holds (cc >= 8.9), the attention tiles of `configs_for` for that compute "
        "capability, every MoE size class. `smem` is the shared memory the launch requests, `limit` the "
        "target's opt-in shared memory per block (catalog), `spills` the bytes of spill stores ptxas reports.",
        "",
        f"Not ok: {len(bad)}." + ("" if not bad else " " + "; ".join(
            f"{r.target} {r.kernel} {r.variant}: {r.problem}" for r in bad)),
        "",
        "| target | op | kernel | variant | regs | spills | smem | limit | ok |",
        "|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        arch = M.target(r.target).arch
        lines.append(f"| {arch} | {r.op} | `{r.kernel}` | {r.variant} | {_cell(r.regs)} | {_cell(r.spills)} | "
                     f"{_cell(r.smem)} | {r.limit} | {'ok' if r.ok else 'NO: ' + r.problem} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import time
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default=",".join(M.TARGETS),
                    help=f"comma-separated catalog architectures (default: {','.join(M.TARGETS)})")
    # A file, not the results folder of results_dir.add_out.
    ap.add_argument("--out", default=DEFAULT_OUT, metavar="FILE", help="markdown table to write ('-' for none)")
    ap.add_argument("--cover", action="store_true",
                    help="only the covering set: each (kernel, variant) once, on its tightest target")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines")
    a = ap.parse_args(argv)
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in M.TARGETS]
    if unknown:
        print(f"compile_matrix: unknown target(s) {', '.join(unknown)}; valid: {', '.join(M.TARGETS)}",
              file=sys.stderr)
        return 2
    start = time.perf_counter()

    def show(row):
        if a.json:
            print(json.dumps(dict(_asdict(row), ok=row.ok)),
                  flush=True)
        else:
            print(f"{row.target:7} {row.kernel:22} {row.variant:32} regs={_cell(row.regs):>4} "
                  f"spills={_cell(row.spills):>5} smem={_cell(row.smem):>6}/{row.limit} "
                  f"{'ok' if row.ok else 'NO: ' + row.problem}", file=sys.stderr, flush=True)

    rows = M.run(targets, progress=show, cover=a.cover)
    if a.out != "-":
        with open(a.out, "w") as f:
            f.write(markdown(rows, time.perf_counter() - start, a.cover))
    return 0 if all(r.ok for r in rows) else 1


def _asdict(row):
    import attrs
    return attrs.asdict(row)


if __name__ == "__main__":
    raise SystemExit(main())
