"""`dispatch env`: one report to paste into a bug report.

capdispatch's version, Python, the platform, the NVIDIA driver and each card
(through NVML, which never initialises CUDA), torch's CUDA build (from its
metadata: torch is not imported), every library a backend declares with its
version (metadata, no import), and every environment variable capdispatch reads.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

from .errors import ExitCode
from .inputs import VARIABLES, unknown_note, unknown_variables

# capdispatch's own dependencies and helpers, besides the backends' libraries.
OWN = ("attrs", "pyyaml", "packaging", "platformdirs", "rich", "argcomplete", "nvidia-ml-py", "numpy")


def add_parser(sub):
    from .options import add
    p = sub.add_parser("env", help="a report of versions, driver, cards, libraries and variables "
                                   "to paste into a bug report",
                       description=__doc__.split("\n\n", 1)[1].strip(),
                       epilog="examples:\n  dispatch env\n  dispatch env --format json > env.json\n")
    add(p, "format")
    return p


def _version(dist: str):
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _nvml() -> dict:
    """Driver and cards through NVML, or why NVML cannot say: what it read before a query
    failed stays, with the failure."""
    from ..capabilities.probing import ProbeError, nvml_session

    def text(v):
        return v.decode() if isinstance(v, bytes) else str(v)
    out = {"ok": True, "error": None, "cards": []}
    try:
        with nvml_session() as nvml:
            out["driver"] = text(nvml.nvmlSystemGetDriverVersion())
            cuda = nvml.nvmlSystemGetCudaDriverVersion()
            out["cuda_driver"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
            for i in range(nvml.nvmlDeviceGetCount()):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
                out["cards"].append({"index": i, "name": text(nvml.nvmlDeviceGetName(h)),
                                     "cc": f"{major}.{minor}", "memory": nvml.nvmlDeviceGetMemoryInfo(h).total,
                                     "uuid": text(nvml.nvmlDeviceGetUUID(h))})
    except ProbeError as exc:     # no bindings, NVML that cannot start, or a query that failed
        out.update(ok=False, error=str(exc))
    return out


def report(env=None) -> dict:
    from ..backends import builtin
    from ..capabilities.probing import torch_cuda_version
    from .options import version
    from .resolver import library_names
    env = os.environ if env is None else env
    backend_libs = sorted(library_names(builtin()))
    variables = {k: env.get(k) for k in VARIABLES}
    variables.update({k: v for k, v in sorted(env.items())
                      if k.startswith("CAPDISPATCH_") and k not in VARIABLES})
    return {
        "schema": 1,
        "capdispatch": {"version": version(), "location": os.path.dirname(os.path.dirname(__file__))},
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.platform(), "machine": platform.machine()},
        "torch": {"version": _version("torch"), "cuda_build": torch_cuda_version()},
        "nvml": _nvml(),
        "libraries": {d: _version(d) for d in backend_libs},
        "own": {d: _version(d) for d in OWN},
        "variables": variables,
        "unknown_variables": [k for k, _ in unknown_variables(env)],
    }


def _text(r) -> str:
    def v(x):
        return "not installed" if x is None else x
    lines = [f"capdispatch {r['capdispatch']['version']}  ({r['capdispatch']['location']})",
             f"Python {r['python']['version']} ({r['python']['implementation']})  {r['python']['executable']}",
             f"platform: {r['platform']['system']}"]
    t = r["torch"]
    if t["version"] is None:
        lines.append("torch: not installed")
    else:
        lines.append(f"torch: {t['version']}, CUDA build {t['cuda_build'] or 'none (CPU build)'}")
    n = r["nvml"]
    if n.get("driver"):
        lines.append(f"NVIDIA driver {n['driver']} (CUDA driver API {n['cuda_driver']})")
    if not n["ok"]:
        lines.append(f"NVML: {n['error']}")
    if n["cards"]:
        lines.append("cards (NVML, bus order):")
        for c in n["cards"]:
            lines.append(f"  {c['index']}: {c['name']}, cc {c['cc']}, {c['memory'] / 2**30:.1f} GiB, {c['uuid']}")
    elif n["ok"]:
        lines.append("cards: none")
    lines.append("libraries the backends declare (package metadata; nothing imported):")
    width = max(len(k) for k in r["libraries"])
    lines += [f"  {k:<{width}}  {v(x)}" for k, x in r["libraries"].items()]
    lines.append("capdispatch's own dependencies:")
    width = max(len(k) for k in r["own"])
    lines += [f"  {k:<{width}}  {v(x)}" for k, x in r["own"].items()]
    lines.append("environment variables capdispatch reads:")
    width = max(len(k) for k in r["variables"])
    lines += [f"  {k:<{width}}  {'(unset)' if x is None else _value(x)}" for k, x in r["variables"].items()]
    if r["unknown_variables"]:
        lines.append(f"  note: {unknown_note(r['unknown_variables'], where=False)}")
    return "\n".join(lines)


def run(args) -> int:
    r = report()
    print(json.dumps(r, indent=2) if args.format == "json" else _text(r))
    return ExitCode.OK


def _value(x: str) -> str:
    """A variable's value as the report shows it: quoted, escaped, a long one cut (the JSON
    carries it whole)."""
    return repr(x) if len(x) <= 120 else f"{x[:120]!r}... ({len(x)} characters)"
