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
--cuda-graph-max-bs 4 --sampling-backend pytorch --moe-runner-backend marlin` (the plugin-off
run needs a runner that serves the MXFP4 experts: 0.5.17's `auto` has none on SM90; Marlin's
serves SM90 and SM120), and with SGLang 0.5.17 `--fp8-gemm-backend triton` (DeepGEMM's fp8
linears JIT-compile per shape at first use). Unless set, the rehearsal runs with
SGLANG_DSV4_MHC_PREWARM=0 (the TileLang mHC kernels compile at first use instead of a 527 s
prewarm), SGLANG_JIT_DEEPGEMM_PRECOMPILE=0 and HF_HUB_OFFLINE=1 (benchmarks/results/
h100-engine-2026-12-07). The start timeout defaults to 1800 s.

`--name NAME` keeps several cases beside one checkpoint (OUT/NAME/, report NAME_<card>_...):
the engine suite runs the card itself, the MoE on capdispatch's Triton kernel (`--set
moe=triton_w4a16`: CAPDISPATCH_SET for the plugin) and the card emulating an RTX 3080
(`--device emu:rtx-3080@cuda:0`); those two compare against the first case's plugin-off run
(`--off-from-case engine`: SGLang alone is the same launch in all three).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import report
from results_dir import add_out

DEFAULT_SGLANG = ("--mem-fraction-static", "0.85", "--cuda-graph-max-bs", "4", "--sampling-backend", "pytorch",
                  "--moe-runner-backend", "marlin")
DEFAULT_BY_RELEASE = {"0.5.17": ("--fp8-gemm-backend", "triton")}
DEFAULT_ENV = {"SGLANG_DSV4_MHC_PREWARM": "0", "SGLANG_JIT_DEEPGEMM_PRECOMPILE": "0", "HF_HUB_OFFLINE": "1"}
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
    p.add_argument("--name", default="engine", help="the case's folder under OUT and its report's name "
                                                    "(default engine)")
    p.add_argument("--set", dest="selections", metavar="OP=BACKEND[,...]",
                   help="explicit choices for the plugin (CAPDISPATCH_SET), e.g. moe=triton_w4a16")
    p.add_argument("--off-from-case", metavar="NAME",
                   help="compare against case NAME's plugin-off run (OUT/NAME/engine-rehearsal.json, `dispatch "
                        "rehearse --off-from`) where it passed its start, instead of starting one: the cases "
                        "differ in the plugin alone, so SGLang alone is the same launch (the rehearsal refuses "
                        "it otherwise)")
    p.add_argument("sglang", nargs=argparse.REMAINDER, help="after --: SGLang's own arguments")
    a = p.parse_args(argv)
    if a.layers < 1:
        p.error(f"--layers {a.layers}: expected 1 or more")
    for flag, v in (("--name", a.name), ("--off-from-case", a.off_from_case)):
        if v is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,63}", v):
            p.error(f"{flag} {v!r}: expected lowercase letters, digits and dashes (a folder and report name)")
    if a.off_from_case == a.name:
        p.error(f"--off-from-case {a.off_from_case}: that is this case (--name)")
    extra = a.sglang[1:] if a.sglang[:1] == ["--"] else a.sglang
    a.sglang = tuple(extra) or default_sglang()
    return a


def default_sglang() -> tuple:
    """DEFAULT_SGLANG, and what the installed release adds (DEFAULT_BY_RELEASE)."""
    from capdispatch.adapters.sglang import versions
    return DEFAULT_SGLANG + DEFAULT_BY_RELEASE.get(versions.installed() or "", ())


def kept_off(out: str, case: str):
    """Case CASE's report where its plugin-off run answered every request, else None (said)."""
    path = os.path.join(out, case, "engine-rehearsal.json")
    try:
        with open(path, encoding="utf-8") as fh:
            off = json.load(fh).get("off")
    except (OSError, ValueError, AttributeError) as exc:
        print(f"run_engine_rehearsal.py: no plugin-off run of case {case} to compare against ({path}: "
              f"{type(exc).__name__}); this case starts its own", file=sys.stderr)
        return None
    if not (isinstance(off, dict) and off.get("ok")):
        print(f"run_engine_rehearsal.py: case {case}'s plugin-off run did not answer ({path}); this case starts "
              f"its own", file=sys.stderr)
        return None
    return path


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
    engine = os.path.join(out, a.name)
    run_env = {**DEFAULT_ENV, **os.environ}
    if a.selections:
        run_env["CAPDISPATCH_SET"] = a.selections
    kept = kept_off(out, a.off_from_case) if a.off_from_case else None
    rc = subprocess.call(_dispatch("rehearse", "--engine", "sglang", "--model", ckpt, "--device", a.device,
                                   "--start-timeout", f"{a.start_timeout:g}", "--timeout", f"{a.timeout:g}", "--out", engine,
                                   *(("--off-from", kept) if kept else ()), "--", *a.sglang), env=run_env)
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
    report.write(out, a.name, env, {"exit_status": rc, "versions": versions, "sglang_args": list(a.sglang),
                                    "device": a.device, "set": a.selections, "off_from": kept,
                                      "layers": a.layers, "rehearsal": rehearsal}, md_lines,
                 title="Engine rehearsal: SGLang's launcher with capdispatch's plugin, on and off")
    return rc


if __name__ == "__main__":
    sys.exit(main())
