"""One canary in a process of its own, started by runner.run_canary (`python -I`, its own
session): OP BACKEND DEVICE SEED RESULT.

Runs BACKEND's kernel for OP on DEVICE against the op's canary and writes a verdict
(JSON) to RESULT. A compile error, an exception or a mismatch is written as such; a
crash (an abort, a poisoned CUDA context that kills the process) or a hang leaves no
result, and the parent records it from the exit status or its timeout.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
import traceback

from ..errors import ExitCode

# Exception classes (by name, anywhere in the chain) that mean "the kernel did not build".
_COMPILE_NAMES = ("CompilationError", "CompileError", "CompileTimeAssertionFailure",
                  "NVRTCError", "BuildError")
_COMPILE_TEXT = ("not supported in this architecture", "ptxas", "nvcc", "nvrtc", "failed to compile",
                 "compilation failed", "error: identifier")


READY = "capdispatch-canary-ready"


def classify(exc: BaseException) -> str:
    seen = set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for cls in type(e).__mro__:
            if any(n in cls.__name__ for n in _COMPILE_NAMES) or cls.__module__.startswith("triton.compiler"):
                return "compile"
        text = str(e).lower()
        if any(t in text for t in _COMPILE_TEXT):
            return "compile"
        e = e.__cause__ or e.__context__
    return "runtime"


def first_lines(exc: BaseException, n: int = 6) -> str:
    lines = [ln for ln in traceback.format_exception_only(type(exc), exc) for ln in ln.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    return "\n".join(lines[-n:] if len(lines) > n else lines)


def _write(path: str, body: dict) -> None:
    tmp = f"{path}.part"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(body, fh)
    os.replace(tmp, path)


def run(op: str, backend: str, device: str, seed: int) -> dict:
    from ..backends import builtin
    from ..backends.canary_checks import Mismatch
    reg = builtin()
    b = reg.backend(op, backend)
    canary = reg.ops[op].load_canary()
    seconds = {}
    t0 = time.perf_counter()
    body = {"outcome": "pass", "seed": seed, "seconds": seconds}
    try:
        import torch
        # The parent's timeout starts now: the interpreter and torch are up.
        print(READY, flush=True)
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        fn = b.load()
        seconds["load"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        report = canary(fn, dev, seed, backend)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds["run"] = time.perf_counter() - t1
        body["tolerance"] = str((report or {}).get("tolerance", ""))
    except Mismatch as exc:
        body.update(outcome="mismatch", detail=str(exc), max_err=exc.max_err, where=exc.where,
                    tolerance=exc.tolerance)
    except Exception as exc:   # noqa: BLE001 - every failure of the kernel is the verdict
        body.update(outcome=classify(exc), detail=first_lines(exc))
    seconds.setdefault("load", time.perf_counter() - t0)
    return body


def main(argv=None, parent=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 5:
        print("usage: python -I -m capdispatch.proof.child OP BACKEND DEVICE SEED RESULT", file=sys.stderr)
        return ExitCode.BAD_INPUT
    op, backend, device, seed, result = argv
    if parent is not None:
        from ..processes import watch_parent
        watch_parent(int(parent))
    faulthandler.enable()     # an abort or a segfault leaves its stack on stderr
    _write(result, run(op, backend, device, int(seed)))
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
