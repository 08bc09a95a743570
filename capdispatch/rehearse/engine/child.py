"""The server's first process: `python -m capdispatch.rehearse.engine.child PARENT -m MODULE
ARGS...` (or `PARENT SCRIPT ARGS...`) watches PARENT (processes.watch_parent: once it is gone,
this process group is killed), then runs MODULE as `python -m MODULE ARGS...` would, in this
process, so SGLang's launcher and the schedulers it starts share this process group."""
from __future__ import annotations

import runpy
import sys


def main(argv) -> None:
    from ...processes import watch_parent
    watch_parent(int(argv[0]))
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
