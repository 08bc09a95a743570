"""The one report writer of the benchmark runner: what machine a run measured, and its files.

A report is a file pair `<kind>_<card>_<YYYYMMDDTHHMMSS>.json` / `.md` (UTC) in the output
folder, the naming benchmarks/results/ keeps (results_dir.py): its series is
`<kind>_<card>`, and when the folder is benchmarks/results/ the series' earlier report
moves to archive/ first. Every report carries the environment: card, driver, compute
capability, torch / Triton / CUDA versions, capdispatch's version, Python, host and date.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess

from results_dir import archive_previous  # the script's own folder

CPU_CARD = "cpu-host"     # the card's name in file names when no GPU is measured


def card_slug(name: str | None) -> str:
    """A card's name as file names carry it: `NVIDIA H200` -> `nvidia_h200`; no card -> cpu-host."""
    if not name:
        return CPU_CARD
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or CPU_CARD


def now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def stamp(when: _dt.datetime | None = None) -> str:
    when = when or now()
    return when.astimezone(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")


def _version(dist: str):
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver():
    """The NVIDIA driver's version: NVML when nvidia-ml-py is installed, else nvidia-smi, else None."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 (no NVML library, no driver: try the command)
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def versions(dists) -> dict:
    """Each distribution's installed version, None where it is not installed."""
    return {d: _version(d) for d in dists}


def environment(cuda_index: int | None) -> dict:
    """What the run measured on: the CUDA device CUDA_INDEX (None: no GPU), its driver and the
    software versions. Imports torch (and Triton's metadata only); never initialises a context
    beyond what reading the device's properties takes."""
    env = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "host": platform.node(), "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "python": platform.python_version(),
           "capdispatch": _version("capdispatch"), "triton": _version("triton"),
           "card": None, "compute_capability": None, "memory_gib": None, "driver": None,
           "torch": None, "cuda": None}
    try:
        import torch
    except ImportError:
        return env
    env["torch"], env["cuda"] = torch.__version__, torch.version.cuda
    if cuda_index is not None:
        p = torch.cuda.get_device_properties(cuda_index)
        env.update(card=p.name, compute_capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1), driver=_driver())
    return env


def write(out_dir: str, kind: str, env: dict, data: dict, markdown: list, *, title: str,
          when: _dt.datetime | None = None) -> tuple:
    """Write `<kind>_<card>_<stamp>.json` and `.md` into OUT_DIR (created); the JSON holds
    {"schema": 1, "kind", "title", "environment": ENV, **DATA}, the markdown the title, the
    environment table and then MARKDOWN's lines. Never overwrites a file. Returns (json path,
    md path)."""
    os.makedirs(out_dir, exist_ok=True)
    series = f"{kind}_{card_slug(env.get('card'))}"
    archive_previous(out_dir, series)
    base = os.path.join(out_dir, f"{series}_{stamp(when)}")
    with open(base + ".json", "x", encoding="utf-8") as fh:
        json.dump({"schema": 1, "kind": kind, "title": title, "environment": env, **data}, fh, indent=1)
        fh.write("\n")
    with open(base + ".md", "x", encoding="utf-8") as fh:
        fh.write("\n".join([f"# {title}", ""] + environment_lines(env) + [""] + list(markdown)).rstrip() + "\n")
    return base + ".json", base + ".md"


def environment_lines(env: dict) -> list:
    card = env.get("card") or "no GPU (host only)"
    if env.get("compute_capability"):
        card += f" (cc {env['compute_capability']}, {env['memory_gib']} GiB)"
    rows = [("card", card), ("driver", env.get("driver")), ("torch", env.get("torch")),
            ("CUDA (torch's build)", env.get("cuda")), ("Triton", env.get("triton")),
            ("capdispatch", env.get("capdispatch")), ("Python", env.get("python")),
            ("host", f"{env.get('host')} ({env.get('cpu')}, {env.get('cpu_count')} CPUs)"),
            ("date (UTC)", env.get("date"))]
    return ["| | |", "|---|---|"] + [f"| {k} | {'—' if v is None else v} |" for k, v in rows]
