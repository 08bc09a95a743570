"""Time `dispatch verify --all` on one card with cold JIT caches: wall time per backend
(its child process: import and compile, then the canary's run) and for the whole card.

    python benchmarks/bench_verify.py [--device cuda:0] [--out DIR] [--timeout 300] [--op OP]... [--jobs N]
                                      [--cold triton,tilelang,deepgemm,flashinfer] [--no-warm]

Each run gets fresh, empty directories for the verdict cache (so every canary runs) and
for the JIT caches named by --cold (default: triton and tilelang; FlashInfer's and
DeepGEMM's are cold only when named, as their first builds take minutes). A second run
with the same JIT caches, warm by then, separates compile time from run time: per
backend, compile ~= cold wall - warm wall. Writes verify_<card>_<time>.json and .md to
--out (default benchmarks/results/). Target: the whole card verified in under 60 s cold.

It drives the documented interface only: `dispatch verify --all --device D --format json`
(top level: `results`, each {device, op, backend, cached, verdict: {outcome, seconds:
{load, run, wall}, detail, ...}}, and `passed`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata

from results_dir import add_out, archive_previous  # the script's own folder
from report import card_slug  # noqa: E402 (the script's own folder)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_S = 60.0
LIBS = ("torch", "triton", "tilelang", "sgl-deep-gemm", "sgl-flash-mla", "flashinfer-python", "sglang-kernel")

# JIT caches by name: the environment variables that point each library's cache elsewhere.
CACHES = {
    "triton": ("TRITON_CACHE_DIR",),
    "tilelang": ("TILELANG_CACHE_DIR", "TILELANG_TMP_DIR"),
    "deepgemm": ("DG_JIT_CACHE_DIR", "DJ_JIT_CACHE_DIR"),
    "flashinfer": ("FLASHINFER_WORKSPACE_BASE",),
}


def cache_env(root: str, cold) -> dict:
    """Fresh directories under ROOT for the verdict cache and each cold JIT cache."""
    env = {"CAPDISPATCH_CACHE_DIR": os.path.join(root, "verdicts")}
    for name in cold:
        if name not in CACHES:
            raise SystemExit(f"bench_verify: unknown cache {name!r} (valid: {', '.join(CACHES)})")
        for var in CACHES[name]:
            env[var] = os.path.join(root, name, var.lower())
    for path in env.values():
        os.makedirs(path, exist_ok=True)
    return env


def run_verify(device: str, timeout: float, env: dict, ops=(), jobs=None) -> dict:
    """One `dispatch verify --all` in a fresh process; its JSON, exit code and wall time."""
    cmd = [sys.executable, "-m", "capdispatch", "verify", "--all", "--device", device,
           "--format", "json", "--timeout", str(timeout)] + [a for op in ops for a in ("--op", op)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, full.get("PYTHONPATH", "")) if p)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=full, cwd=ROOT)
    wall = time.perf_counter() - t0
    try:
        body = json.loads(p.stdout)
    except ValueError:
        raise SystemExit(f"bench_verify: `{' '.join(cmd[2:])}` gave no JSON (exit {p.returncode}):\n"
                         f"{p.stderr[-3000:]}")
    return {"rc": p.returncode, "wall": wall, "body": body, "stderr_tail": p.stderr[-2000:]}


def rows(cold: dict, warm=None) -> list:
    """Per (op, backend): outcome and the cold (and warm) child wall, load and run times."""
    warm_by = {}
    for r in (warm or {}).get("body", {}).get("results", []):
        warm_by[(r["device"], r["op"], r["backend"])] = r
    out = []
    for r in cold["body"]["results"]:
        v = r.get("verdict") or {}
        s = v.get("seconds") or {}
        row = {"device": r["device"], "op": r["op"], "backend": r["backend"],
               "outcome": v.get("outcome", "not run"), "cold_wall": s.get("wall"),
               "cold_load": s.get("load"), "cold_run": s.get("run"),
               "detail": (v.get("detail") or "").strip().splitlines()[:1]}
        w = warm_by.get((r["device"], r["op"], r["backend"]))
        ws = ((w or {}).get("verdict") or {}).get("seconds") or {}
        row["warm_wall"] = ws.get("wall")
        row["compile_est"] = (row["cold_wall"] - row["warm_wall"]) \
            if row["cold_wall"] is not None and row["warm_wall"] is not None else None
        out.append(row)
    return out


def _f(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def render(meta: dict, table: list) -> str:
    lines = [f"# `dispatch verify --all` on {meta['card']} ({meta['device']}), {meta['date']}", "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
             f"Cold caches: {', '.join(meta['cold'])} (and the verdict cache); the others as found.",
             f"Ops: {meta['ops'] if isinstance(meta.get('ops', 'all'), str) else ', '.join(meta['ops'])}.", "",
             f"Whole card, cold: **{meta['cold_wall']:.1f} s** (target {TARGET_S:.0f} s: "
             f"{'met' if meta['cold_wall'] < TARGET_S else 'missed'}); exit {meta['cold_rc']}."]
    if meta.get("warm_wall") is not None:
        lines.append(f"Whole card, warm JIT caches: {meta['warm_wall']:.1f} s.")
    lines += ["", "| op | backend | verdict | cold wall s | import+compile s | run s | warm wall s | compile ~ s |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in table:
        verdict = r["outcome"] + (f": {r['detail'][0][:80]}" if r["detail"] and r["outcome"] != "pass" else "")
        lines.append(f"| {r['op']} | {r['backend']} | {verdict} | {_f(r['cold_wall'])} | {_f(r['cold_load'])} | "
                     f"{_f(r['cold_run'])} | {_f(r['warm_wall'])} | {_f(r['compile_est'])} |")
    lines += ["", "Per backend: the canary's child process (`seconds.wall`), its import of the kernel "
              "module and first compile (`seconds.load`), and the canary's run with its own compiles "
              "(`seconds.run`). compile ~ = cold wall - warm wall."]
    return "\n".join(lines) + "\n"


def _card(device: str, env: dict) -> str:
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, full.get("PYTHONPATH", "")) if p)
    p = subprocess.run([sys.executable, "-m", "capdispatch", "devices", "--device", device, "--format", "json"],
                       capture_output=True, text=True, env=full, cwd=ROOT)
    try:
        return json.loads(p.stdout)["devices"][0]["name"]
    except (ValueError, KeyError, IndexError):
        return device


def _versions() -> dict:
    out = {}
    for name in LIBS:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    add_out(ap)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one canary may take (default 300)")
    ap.add_argument("--cold", default="triton,tilelang", help="JIT caches to start empty (comma list; "
                    f"valid: {', '.join(CACHES)})")
    ap.add_argument("--no-warm", action="store_true", help="skip the second, warm-cache run")
    ap.add_argument("--op", action="append", default=[], help="only this op (repeatable; default: every op)")
    ap.add_argument("--jobs", type=int, help="canaries at once (dispatch verify --jobs; default: its own)")
    args = ap.parse_args(argv)
    cold = [c for c in args.cold.split(",") if c]
    root = tempfile.mkdtemp(prefix="capdispatch-bench-verify-")
    try:
        env = cache_env(root, cold)
        card = _card(args.device, env)
        first = run_verify(args.device, args.timeout, env, args.op, args.jobs)
        second = None
        if not args.no_warm:
            warm_env = dict(env, CAPDISPATCH_CACHE_DIR=os.path.join(root, "verdicts-warm"))
            os.makedirs(warm_env["CAPDISPATCH_CACHE_DIR"], exist_ok=True)
            second = run_verify(args.device, args.timeout, warm_env, args.op, args.jobs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {"device": args.device, "card": card, "date": now.strftime("%Y-%m-%d %H:%M UTC"),
            "versions": _versions(), "cold": cold, "cold_wall": first["wall"], "cold_rc": first["rc"],
            "warm_wall": second["wall"] if second else None, "target_s": TARGET_S,
            "ops": list(args.op) or "all", "jobs": args.jobs}
    table = rows(first, second)
    slug = card_slug(card)
    stem = os.path.join(args.out, f"verify_{slug}_{now.strftime('%Y%m%dT%H%M%S')}")
    os.makedirs(args.out, exist_ok=True)
    archive_previous(args.out, f"verify_{slug}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": table, "cold": first, "warm": second}, f, indent=1)
    text = render(meta, table)
    with open(stem + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
