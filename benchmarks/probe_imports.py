"""List every module an import chain needs that this machine lacks, in one run.

    python benchmarks/probe_imports.py sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe

A machine without a package index that learns only the first missing module of a deep
chain (SGLang's CUDA import path, say) needs one install round per module. This imports the
target; on ModuleNotFoundError it records the name, puts a placeholder module in
its place (any name imported from it is an empty class) and tries again, until the import succeeds or something other than a missing
module stops it. Probe only: nothing it imports is run, and it prints the list of
packages to add to the wheel folder (benchmarks/README.md, "Offline installs") before the real run.
"""
from __future__ import annotations

import importlib
import sys
import types


class _Placeholder(type):
    """`from missing import Name` gets a class; its attributes are placeholders too, calling
    it accepts anything, and as a decorator it hands back what it decorates (probe only)."""

    def __getattr__(cls, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(attr, cls.__module__)

    def __iter__(cls):
        return iter(())

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return cls


def _placeholder(name: str, module: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (), {"__module__": module,
                                   "__init_subclass__": classmethod(lambda cls, **kw: None)})


def probe(target: str, limit: int = 60) -> tuple[list[str], str]:
    missing: list[str] = []
    for _ in range(limit):
        try:
            importlib.import_module(target)
            return missing, "imported"
        except ModuleNotFoundError as exc:
            name = exc.name or str(exc)
            if name in missing or name == target or target.startswith(name + "."):
                return missing, f"stopped: {type(exc).__name__}: {exc}"
            missing.append(name)
            for part in range(1, name.count(".") + 2):     # parents first, each a package
                mod = ".".join(name.split(".")[:part])
                if mod not in sys.modules:
                    m = types.ModuleType(mod)
                    m.__path__ = []
                    m.__getattr__ = lambda attr, _m=mod: _placeholder(attr, _m)
                    sys.modules[mod] = m
            for k in [k for k in sys.modules if k == target.split(".")[0] or k.startswith(target.split(".")[0] + ".")]:
                del sys.modules[k]                          # retry the chain from its top
        except Exception as exc:                            # not a missing module: report and stop
            return missing, f"stopped: {type(exc).__name__}: {str(exc)[:300]}"
    return missing, "gave up"


if __name__ == "__main__":
    for t in sys.argv[1:]:
        miss, how = probe(t)
        print(f"{t}: {how}")
        print("  missing: " + (" ".join(miss) if miss else "nothing"))
