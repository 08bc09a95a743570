"""`dispatch verify`: run each op's canary for the chosen (or every runnable) backend
on each device, in child processes; a table of verdicts; exit 0 when all passed, 3 not."""
from __future__ import annotations

import json
import os
import sys

from ..processes import terminate_as_interrupt
from .errors import ExitCode


def add_parser(subparsers):
    from .options import add
    v = subparsers.add_parser(
        "verify", help="run each chosen backend's canary on the card, in a child process",
        description="Run each op's canary for the chosen (or every runnable) backend on each "
                    "device, each in a child process against the op's torch reference; cache "
                    "the verdicts the decisions then read.",
        epilog="examples:\n"
               "  dispatch verify                             every local card, the chosen backends\n"
               "  dispatch verify --device cuda:1 --all       every runnable backend of cuda:1\n"
               "  dispatch verify --device cpu --op kv_quant,kv_dequant --format json\n"
               "  dispatch verify --clear-cache               forget the cached verdicts first\n")
    add(v, "device", help="the cards to verify on (a simulated device has no card)")
    add(v, "op")
    v.add_argument("--backend", metavar="B", help="verify this backend (of each op that has it)")
    v.add_argument("--all", action="store_true", dest="every",
                   help="every candidate whose requirements hold, not only the chosen one")
    v.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds one canary may take, compile included (default 120)")
    v.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="canaries at once, each in its own process (default: the CPU count, "
                        "at most 8; a canary's time is mostly its process start and compile)")
    add(v, "policy", "set")
    v.add_argument("--clear-cache", action="store_true",
                   help="forget every cached verdict first")
    add(v, "format", "probe")
    add(v, "lock", help="after verifying")
    return v


class _Progress:
    """Progress on stderr: rich's bar on a terminal, else one line per backend verified."""

    def __init__(self, total: int):
        from .progress import Progress
        self.p = Progress("verifying", total)

    def __enter__(self):
        self.p.__enter__()
        return self

    def __exit__(self, *exc):
        self.p.__exit__(*exc)

    def start(self, job):
        self.p.update(f"{job.device.id} {job.op}/{job.backend}")

    def done(self, result):
        j = result.job
        how = ("not run (the time budget ran out)" if result.verdict is None
               else result.verdict.describe() + (" (cached)" if result.cached else ""))
        self.p.advance(f"{j.device.id} {j.op}/{j.backend}: {how}")


def run(args) -> int:
    from ..capabilities import local_devices
    from .resolver import context
    from . import verify
    verify.check_timeout(args.timeout)
    from .lock import load, lock_path
    lock = lock_path(args.lock)   # an empty --lock is refused before any canary runs
    if lock is not None:          # and so is a lock that cannot be read (a FIFO, a directory, bad YAML)
        load(lock)
    if args.jobs is not None and args.jobs < 1:
        from .errors import BadInput
        raise BadInput(f"--jobs: {args.jobs} is not a number of canaries at once (valid: 1 or more)")
    if args.clear_cache:
        from ..proof import clear
        root, existed = clear()
        print(f"cleared the verification cache {root}" if existed else
              f"no verification cache at {root}: nothing to clear", file=sys.stderr)
    ctx = context(policy=args.policy or None, selections=args.set_ or None, selection_origin="--set")
    from .group import device_specs
    from .inputs import needs_torch, op_list
    specs = device_specs(args.device, "--device", via=args.probe) or local_devices(via=args.probe)
    needs_torch("dispatch verify runs the backends' canaries")
    ops = op_list(args.op, "--op", ctx.registry) or list(ctx.registry.ops)
    todo = verify.jobs(ctx, specs, ops, backend=args.backend, every=args.every)
    with _Progress(len(todo)) as progress, terminate_as_interrupt():
        results = verify.run(ctx, todo, timeout=args.timeout,
                             workers=default_jobs() if args.jobs is None else args.jobs,
                             on_start=progress.start, on_done=progress.done)
    failed = [r for r in results if r.verdict is None or not r.verdict.passed]
    if args.format == "json":
        print(json.dumps({"schema": 1, "results": [r.to_dict() for r in results],
                          "passed": not failed}, indent=2))
    else:
        print(render(results))
    from .lock import check_after_verify
    check_after_verify(specs, ops, args)
    return ExitCode.OK if not failed else ExitCode.UNSATISFIABLE


def render(results) -> str:
    rows = [("op", "device", "backend", "verdict", "seconds")]
    details = []
    for r in results:
        v = r.verdict
        secs = "" if v is None else f"{v.seconds.get('wall', 0):.1f}"
        rows.append((r.job.op, r.job.device.id, r.job.backend, "not run" if v is None else v.describe(), secs))
        if v is not None and not v.passed and v.detail:
            from ..safe_io import printable
            lines = printable(v.detail.strip()).splitlines()[:4]
            details.append(f"{r.job.device.id} {r.job.op}/{r.job.backend} ({v.outcome}, seed {v.seed}):\n"
                           + "\n".join(f"    {ln[:160]}" for ln in lines))
    short = [(a, b, c, d if len(d) <= 90 else d[:87] + "...", e) for a, b, c, d, e in rows]
    widths = [max(len(row[i]) for row in short) for i in range(4)]
    out = ["  ".join(row[i].ljust(widths[i]) for i in range(4)) + "  " + row[4] for row in short]
    n_bad = sum(1 for r in results if r.verdict is None or not r.verdict.passed)
    out.append("")
    out.append(f"{len(results) - n_bad} of {len(results)} passed")
    if details:
        out.append("")
        out.extend(details)
    return "\n".join(out)


def default_jobs() -> int:
    """Canaries at once when --jobs is not given: each child spends most of its time
    importing torch and compiling on the CPU, so the CPU count bounds the gain."""
    return max(1, min(8, os.cpu_count() or 1))


