"""The benchmark runner: `python -m benchmarks --suite SUITE [options]` from the repository root.

Runs the benchmarks of the suites named (benchmarks/suites.py lists them), each in its own
process with its own time limit and log, hands each the shared options in its own flags,
and writes one report per suite (report.py): `<suite>_<card>_<stamp>.json/.md` in the
output folder, beside the files the benchmarks write there themselves. A suite run's logs
and intermediate files go into the folder of the same name.

Exit status: 0 every benchmark ran (or was skipped, saying why), 1 one failed or ran out
of time, 2 bad input, 3 a benchmark needs a CUDA device and none is visible.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import attrs

import report
import suites as S
from results_dir import add_out

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TILES = ("card", "99kb", "both")
# What a benchmark's exit status 1 means (a run that measured, against a target or a check).
EXIT1 = ": a target missed or a check failed, see its log"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run capdispatch's benchmarks by suite and write one report per suite "
                    "(JSON and Markdown, named by suite, card and UTC time) into --out.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="suites:\n" + "\n".join(f"  {k:<10} {v}" for k, v in S.SUITES.items()) +
               "\n\nexamples:\n"
               "  python -m benchmarks --list\n"
               "  python -m benchmarks --suite host --out bench-out\n"
               "  python -m benchmarks --suite kernels --tiles both --ops decode_mla,moe --out bench-out\n"
               "  python -m benchmarks --suite calibrate --device cuda:1 --out bench-out\n")
    p.add_argument("--suite", action="append", default=[], choices=tuple(S.SUITES), metavar="SUITE",
                   help=f"a suite to run (repeatable): {', '.join(S.SUITES)}")
    p.add_argument("--list", action="store_true", help="list the suites and their benchmarks, then exit")
    p.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]",
                   help="run only these benchmarks of the suites (names from --list)")
    p.add_argument("--skip", action="append", default=[], metavar="NAME[,NAME]",
                   help="leave these benchmarks out")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="cuda:N or cpu (default: cuda:0 when a CUDA device is visible, else cpu)")
    p.add_argument("--ops", action="append", default=[], metavar="OP[,OP]",
                   help="the ops to measure (default: every op capdispatch registers); a benchmark "
                        "of other ops only is left out")
    p.add_argument("--sizes", default=None, metavar="N[,N]",
                   help="token counts for the benchmarks that take them (default: each one's own)")
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="also time inside CUDA graphs where a benchmark can (default: on)")
    p.add_argument("--tiles", choices=TILES, default="card",
                   help="the Triton kernels' launch tables: this card's own (card), the 99 KB "
                        "shared-memory cards' (99kb: SM86/SM89/SM120), or both runs (default: card)")
    p.add_argument("--seed", type=int, default=None, help="seed of the random inputs (default: fresh, printed)")
    add_out(p, default="benchmark-results", help="output folder (default: ./benchmark-results)")
    p.add_argument("--quick", action="store_true", help="short runs (fewer shapes and repeats) to check a setup")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds each benchmark may run (default: each one's own limit)")
    p.add_argument("--args", action="append", default=[], metavar="NAME=ARGS",
                   help="more arguments for one benchmark, e.g. --args attention='--peer-max-tokens 4096'")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


@attrs.frozen
class Run:
    """One benchmark process: its label in the report, its table entry, its command, its op."""
    label: str
    bench: S.Bench
    argv: tuple
    op: str | None


@attrs.frozen
class Plan:
    """What a suite run will do: the benchmarks' runs, and (name, why) for each left out."""
    suite: str
    runs: tuple
    skipped: tuple


def _names(values, flag) -> list:
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    known = S.by_name()
    for n in names:
        if n not in known:
            import capdispatch as cd
            from capdispatch import extend
            raise cd.BadInput(f"{flag} {n}: no such benchmark{extend.did_you_mean(n, list(known))} "
                              f"(valid: {', '.join(known)})")
    return names


def _sizes(value) -> list:
    if value is None:
        return []
    import capdispatch as cd
    out = []
    for part in value.split(","):
        if not part.strip().isdigit() or int(part) < 1:
            raise cd.BadInput(f"--sizes {value!r}: {part.strip()!r} is not a positive integer "
                              "(valid: N[,N...], e.g. 1,8,64)")
        out.append(int(part))
    return out


def _cuda_index(device: str) -> int:
    import capdispatch as cd
    idx = device.split(":", 1)[1] if device.startswith("cuda:") else ""
    if not idx.isdigit():
        raise cd.BadInput(f"--device {device!r}: not a device the benchmarks run on (valid: cuda:N or cpu)")
    return int(idx)


def _visible(index: int) -> str:
    """CUDA_VISIBLE_DEVICES for a child that sees only device INDEX (of what this process sees)."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent is None or not parent.strip():
        return str(index)
    ids = [x.strip() for x in parent.split(",") if x.strip()]
    return ids[index]


def _flags(b: S.Bench, a, ops, sizes, tiles, device) -> list:
    """The shared options B takes, in its own flags."""
    out = []
    for key in b.takes:
        if key == "out":
            out += ["--out", a.out]
        elif key == "seed" and a.seed is not None:
            out += ["--seed", str(a.seed)]
        elif key == "seed-next":
            out += ["--seed", str(1 if a.seed is None else a.seed + 1)]
        elif key == "graphs" and a.graphs:
            out += ["--graphs"]
        elif key == "tiles":
            out += ["--tiles", tiles]
        elif key == "device":
            out += ["--device", "cpu" if device == "cpu" else "cuda:0"]
        elif key == "device-index":
            out += ["--device", "0"]
        elif key == "ops" and ops:
            out += ["--ops", *ops]
        elif key == "op" and ops:
            for op in ops:
                out += ["--op", op]
        elif key == "tokens" and sizes:
            out += ["--tokens", *map(str, sizes)]
        elif key == "decode-tokens" and sizes:
            out += ["--decode-tokens", *map(str, sizes)]
        elif key == "sizes" and sizes:
            out += ["--sizes", ",".join(map(str, sizes))]
    return out


def plan(suite: str, a, *, device: str, card: str, run_dir: str, registry_ops, chosen_ops,
         only, skip, sizes, extra) -> Plan:
    runs, skipped = [], []
    tiles_list = ("card", "99kb") if a.tiles == "both" else (a.tiles,)
    for b in S.of_suite(suite):
        if (only and b.name not in only) or b.name in skip:
            continue
        covered = list(b.ops) if b.ops is not None else list(registry_ops)
        ops = [o for o in covered if o in chosen_ops] if chosen_ops else covered
        if b.ops is not None and not ops:
            skipped.append((b.name, f"measures {', '.join(b.ops)}, none of --ops"))
            continue
        missing = [m for m in b.needs if not _importable(m)]
        if missing:
            skipped.append((b.name, f"needs {', '.join(missing)}, not importable here "
                                    "(benchmarks/README.md, 'On a machine with one GPU', says how to add it)"))
            continue
        # Ops go to the benchmark only when they narrow what it runs by default.
        pass_ops = ops if chosen_ops else []
        for tiles in (tiles_list if "tiles" in b.takes else ("card",)):
            for op in (ops if b.per_op else [None]):
                fill = dict(out=a.out, run=run_dir, card=card, op=op or "")
                argv = [sys.executable] + [_expand(x.format(**fill)) for x in b.command]
                argv = [y for x in argv for y in (x if isinstance(x, list) else [x])]
                argv += _flags(b, a, [] if b.per_op else pass_ops, sizes, tiles, device)
                argv += list(b.quick) if a.quick else []
                argv += extra.get(b.name, [])
                label = b.name + (f" {op}" if op else "") + (f" (tiles {tiles})" if tiles != "card" else "")
                runs.append(Run(label, b, tuple(argv), op))
    return Plan(suite, tuple(runs), tuple(skipped))


def _expand(arg: str):
    """An argument with `*`: the files it matches (sorted), resolved when the run starts."""
    return ["@glob", arg] if "*" in arg else arg


def _importable(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _resolve_globs(argv):
    out, missing, i = [], [], 0
    while i < len(argv):
        if argv[i] == "@glob":
            found = sorted(glob.glob(argv[i + 1]))
            if not found:
                missing.append(argv[i + 1])
            out += found
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out, missing


def _run_one(run: Run, *, log_path, limit, device_env) -> dict:
    label, b, op = run.label, run.bench, run.op
    argv, missing = _resolve_globs(list(run.argv))
    row = {"name": label, "benchmark": b.name, "command": shlex.join(argv[1:]), "log": log_path}
    if missing:
        return dict(row, status="skipped", reason=f"no file matches {', '.join(missing)} (an earlier step wrote none)")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **dict(b.env), **device_env)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    before = _listing(argv, os.path.dirname(log_path))
    print(f"=== {label}: {row['command']} (limit {limit:.0f} s)", flush=True)
    t0 = time.monotonic()
    stdout_path = b.stdout and os.path.join(os.path.dirname(log_path), b.stdout.format(op=op or ""))
    with open(log_path, "w", encoding="utf-8") as log:
        out = open(stdout_path, "w", encoding="utf-8") if stdout_path else log
        try:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=log, start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                status = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                rc, status = None, "timeout"
            finally:
                # Its own process group goes whole (over its limit, when this runner is
                # interrupted, or what it left running), so nothing of it skews the next timing.
                _kill(proc)
        finally:
            if stdout_path:
                out.close()
                if os.path.getsize(stdout_path) == 0:   # nothing written: no file for the later steps
                    os.remove(stdout_path)
    row.update(status=status, exit=rc, seconds=round(time.monotonic() - t0, 1),
               files=sorted(_listing(argv, os.path.dirname(log_path)) - before))
    tail = _tail(log_path)
    print(f"    {status}" + (f" (exit {rc})" if rc not in (0, None) else "") + f", {row['seconds']} s"
          + (f": {tail[-1]}" if status != "ok" and tail else ""), flush=True)
    if status != "ok":
        row["tail"] = tail
    return row


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _listing(argv, run_dir) -> set:
    """Files in the folders a benchmark writes to (its --out, and the suite run's folder; not logs)."""
    dirs = {argv[i + 1] for i, x in enumerate(argv[:-1]) if x == "--out"} | {run_dir}
    found = set()
    for d in dirs:
        d = d if os.path.isdir(d) else os.path.dirname(d)
        if d and os.path.isdir(d):
            found |= {os.path.join(d, n) for n in os.listdir(d)
                      if os.path.isfile(os.path.join(d, n)) and not n.endswith(".log")}
    return found


def _tail(path, n=8) -> list:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return [line.rstrip() for line in fh.readlines()[-n:] if line.strip()]
    except OSError:
        return []


def _markdown(suite, options, rows, skipped, out_dir) -> list:
    lines = [S.SUITES[suite], "",
             "Options: " + ", ".join(f"{k} {v}" for k, v in options.items() if v not in (None, [], False)), "",
             "| benchmark | status | seconds | files |", "|---|---|---:|---|"]
    for r in rows:
        files = ", ".join(f"`{os.path.relpath(f, out_dir)}`" for f in r.get("files", []))
        status = r["status"] + (f" (exit {r['exit']}{EXIT1 if r.get('exit') == 1 else ''})"
                                if r.get("exit") not in (0, None) else "")
        if r.get("reason"):
            status += f": {r['reason']}"
        lines.append(f"| {r['name']} | {status} | {r.get('seconds', '')} | {files} |")
    for name, why in skipped:
        lines.append(f"| {name} | skipped: {why} | | |")
    for r in rows:
        if r.get("tail"):
            lines += ["", f"`{r['name']}` ({r['command']}), the end of its log:", "", "```", *r["tail"], "```"]
    return lines


def _list() -> int:
    for suite, text in S.SUITES.items():
        print(f"{suite}: {text}")
        for b in S.of_suite(suite):
            need = ("CUDA" if b.cuda else "no GPU") + (", " + ", ".join(b.needs) if b.needs else "")
            print(f"  {b.name:<20} [{need}] {b.what}")
    return 0


def main(argv=None) -> int:
    import capdispatch as cd
    a = _parser().parse_args(argv)
    try:
        return _main(a)
    except cd.CapdispatchError as exc:
        print(f"python -m benchmarks: {exc}", file=sys.stderr)
        return 3 if isinstance(exc, cd.Unsatisfiable) else 2
    except KeyboardInterrupt:
        print("python -m benchmarks: interrupted; the running benchmark was stopped, no report written",
              file=sys.stderr)
        return 130


def _main(a) -> int:
    import capdispatch as cd
    from capdispatch import extend
    if a.list:
        return _list()
    if not a.suite:
        raise cd.BadInput(f"--suite: none given (valid: {', '.join(S.SUITES)}; --list shows every benchmark)")
    only, skip = _names(a.only, "--only"), _names(a.skip, "--skip")
    reg = extend.registry.builtin()
    chosen = extend.op_list(a.ops, "--ops", reg) if a.ops else []
    sizes = _sizes(a.sizes)
    extra = {}
    for item in a.args:
        name, sep, rest = item.partition("=")
        if not sep:
            raise cd.BadInput(f"--args {item!r}: expected NAME=ARGS (e.g. attention='--peer-max-tokens 4096')")
        _names([name], "--args")
        extra.setdefault(name, []).extend(shlex.split(rest))
    selected = [b for s in a.suite for b in S.of_suite(s)
                if not (only and b.name not in only) and b.name not in skip]
    if only and not selected:
        raise cd.BadInput(f"--only {', '.join(only)}: none of these is in suite {', '.join(a.suite)} "
                          "(python -m benchmarks --list shows which suite holds each)")

    cuda_count = _cuda_count()
    device = a.device or ("cuda:0" if cuda_count else "cpu")
    index = None if device == "cpu" else _cuda_index(device)
    need_gpu = [b.name for b in selected if b.cuda]
    if need_gpu and not a.dry_run:
        if index is None or not cuda_count:
            why = "no CUDA device is visible here" if not cuda_count else f"--device {device}"
            raise cd.Unsatisfiable(
                f"{', '.join(need_gpu)} need a CUDA device; {why} (run --suite host or compile here, "
                f"or --only the benchmarks marked 'no GPU' in --list)")
        if index >= cuda_count:
            raise cd.BadInput(f"--device {device}: this machine shows {cuda_count} CUDA device(s) "
                              f"(valid: cuda:0 ... cuda:{cuda_count - 1}, or cpu)")
    env = report.environment(index if cuda_count and index is not None else None)
    card = report.card_slug(env["card"])
    device_env = {} if index is None else {"CUDA_VISIBLE_DEVICES": _visible(index)}
    a.out = os.path.abspath(a.out)
    failed = False
    for suite in a.suite:
        when = report.now()
        stamp = report.stamp(when)
        run_dir = os.path.join(a.out, f"{suite}_{card}_{stamp}")
        p = plan(suite, a, device=device, card=card, run_dir=run_dir, registry_ops=list(reg.ops),
                 chosen_ops=chosen, only=only, skip=skip, sizes=sizes, extra=extra)
        if a.dry_run:
            for run in p.runs:
                print(f"{run.label}: {shlex.join(run.argv[1:]).replace('@glob ', '')}")
            for name, why in p.skipped:
                print(f"{name}: skipped ({why})")
            continue
        os.makedirs(run_dir, exist_ok=True)     # the output folder too
        rows = []
        for run in p.runs:
            log = os.path.join(run_dir, re.sub(r"[^\w.-]+", "_", run.label).strip("_") + ".log")
            rows.append(_run_one(run, log_path=log, limit=a.timeout or run.bench.limit, device_env=device_env))
        for name, why in p.skipped:
            print(f"=== {name}: skipped ({why})")
        options = dict(device=device, ops=chosen or "all", sizes=sizes, graphs=a.graphs, tiles=a.tiles,
                       seed=a.seed, quick=a.quick)
        data = {"suite": suite, "card": card, "options": options, "run_folder": run_dir,
                "benchmarks": rows, "skipped": [{"name": n, "reason": w} for n, w in p.skipped]}
        js, md = report.write(a.out, suite, env, data, _markdown(suite, options, rows, p.skipped, a.out),
                              title=f"Suite `{suite}` on {env['card'] or 'the host (no GPU)'}", when=when)
        print(f"report: {md}")
        failed |= any(r["status"] in ("failed", "timeout") for r in rows)
    return 1 if failed else 0


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
