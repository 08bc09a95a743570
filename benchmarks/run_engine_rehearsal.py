"""SGLang's own launcher with capdispatch's plugin, on a generated checkpoint: the engine
rehearsal (docs/rehearse.md, "Engine rehearsal") as a benchmark.

    python benchmarks/run_engine_rehearsal.py --out DIR [--layers 4] [--checkpoint DIR]
        [--device cuda:0] [--start-timeout 1800] [--timeout 300] [-- SGLANG ARGS...]

Writes the checkpoint (`dispatch checkpoint`, full width, into --checkpoint or DIR's
`checkpoint/`; an existing checkpoint folder with a config.json is reused), runs `dispatch
rehearse --engine sglang` on it with the plugin on and then off, and writes
`engine_<card>_<stamp>.json/.md` (the rehearsal's report with the environment and the
versions of SGLang and the libraries it loads) beside the rehearsal's own files
(`engine/`: both SGLang logs, the rank reports). Exit status: the rehearsal's (0 passed,
3 failed, 2 bad input).

SGLang's arguments default to what a one-GPU first run needs: `--mem-fraction-static 0.85
--cuda-graph-max-bs 4 --sampling-backend pytorch`. The start timeout defaults to 1800 s:
SGLang 0.5.17's first start on an H100 compiled its TileLang mHC kernels for 527 s before
serving (benchmarks/results/h100-engine-2026-12-07).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import report
from results_dir import add_out

DEFAULT_SGLANG = ("--mem-fraction-static", "0.85", "--cuda-graph-max-bs", "4", "--sampling-backend", "pytorch")
LIBRARIES = ("sglang", "sglang-kernel", "sgl-deep-gemm", "flashinfer-python", "tilelang", "transformers",
             "torch", "triton", "capdispatch")


def _args(argv):
    p = argparse.ArgumentParser(prog="run_engine_rehearsal.py", description=__doc__.split("\n\n")[0])
    add_out(p, required=True, help="the folder the report, the checkpoint (unless --checkpoint) and the "
                                   "rehearsal's files (engine/) are written into")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the checkpoint (default 4)")
    p.add_argument("--model", default="deepseek-v4-flash", help="the model whose checkpoint is written")
    p.add_argument("--checkpoint", help="the checkpoint folder (default: OUT/checkpoint)")
    p.add_argument("--device", default="cuda:0", help="the rank's device (default cuda:0)")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds for SGLang's start (default 1800)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds each request may take (default 300: a first request may compile kernels)")
    p.add_argument("sglang", nargs=argparse.REMAINDER, help="after --: SGLang's own arguments")
    a = p.parse_args(argv)
    if a.layers < 1:
        p.error(f"--layers {a.layers}: expected 1 or more")
    extra = a.sglang[1:] if a.sglang[:1] == ["--"] else a.sglang
    a.sglang = tuple(extra) or DEFAULT_SGLANG
    return a


def _dispatch(*args) -> list:
    return [sys.executable, "-m", "capdispatch", *args]


def main(argv=None) -> int:
    a = _args(sys.argv[1:] if argv is None else argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    ckpt = os.path.abspath(a.checkpoint or os.path.join(out, "checkpoint"))
    if not os.path.isfile(os.path.join(ckpt, "config.json")):
        rc = subprocess.call(_dispatch("checkpoint", "--model", a.model, "--layers", str(a.layers), "--out", ckpt))
        if rc != 0:
            return rc
    engine = os.path.join(out, "engine")
    rc = subprocess.call(_dispatch("rehearse", "--engine", "sglang", "--model", ckpt, "--device", a.device,
                                   "--start-timeout", f"{a.start_timeout:g}", "--timeout", f"{a.timeout:g}", "--out", engine, "--",
                                   *a.sglang))
    path = os.path.join(engine, "engine-rehearsal.json")
    if not os.path.isfile(path):
        return rc
    with open(path, encoding="utf-8") as fh:
        rehearsal = json.load(fh)
    with open(os.path.join(engine, "engine-rehearsal.txt"), encoding="utf-8") as fh:
        text = fh.read().rstrip().splitlines()
    env = report.environment(int(a.device.split(":")[1]) if a.device.startswith("cuda:") else None)
    versions = report.versions(LIBRARIES)
    md_lines = ["| library | version |", "|---|---|"] + [f"| {k} | {v or '—'} |" for k, v in versions.items()]
    md_lines += ["", f"`dispatch rehearse --engine sglang` exit status {rc}; SGLang arguments: "
                     f"`{' '.join(a.sglang)}`; checkpoint: {a.model}, {a.layers} layers", "", "```", *text, "```"]
    report.write(out, "engine", env, {"exit_status": rc, "versions": versions, "sglang_args": list(a.sglang),
                                      "layers": a.layers, "rehearsal": rehearsal}, md_lines,
                 title="Engine rehearsal: SGLang's launcher with capdispatch's plugin, on and off")
    return rc


if __name__ == "__main__":
    sys.exit(main())
