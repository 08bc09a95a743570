"""What a verdict is valid for: the card and its software, and the backend's identity.

A verdict holds only for the exact card (name, compute capability, UUID where the
driver reports it), driver, CUDA, torch, Triton and capdispatch versions, and the
exact backend (op, name, implementation, declared requirements and the versions of
the libraries it declares). Any change makes a new key, so a stale verdict is never
read as today's.
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional

from ..capabilities import DeviceSpec, Inventory
from ..capabilities.probing import nvml_session
from ..version import __version__


def driver_version(spec: DeviceSpec) -> Optional[str]:
    """The NVIDIA driver version through NVML (never initialises CUDA); None off CUDA, and
    None where NVML cannot say (the key then says "unknown")."""
    if spec.platform != "cuda":
        return None
    try:
        with nvml_session() as nvml:
            v = nvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:   # noqa: BLE001 - no bindings, no driver, or a broken binding: unknown
        return None


def card_key(spec: DeviceSpec, inventory: Inventory, env, *, driver: Optional[str] = None) -> dict:
    """The card and the software every backend on it shares."""
    key = {
        "platform": spec.platform,
        "name": spec.name,
        "cc": spec.cc_str,
        "uuid": spec.uuid,
        "driver": driver if driver is not None else driver_version(spec),
        "cuda": spec.cuda,
        "torch": inventory.get("torch").version,
        "triton": inventory.get("triton").version,
        "capdispatch": __version__,
    }
    if spec.platform == "cpu":
        # On the CPU, Triton kernels run only under the interpreter: a different program.
        from ..backends.base import triton_interpret
        key["triton_interpret"] = triton_interpret(env)
    return key


def backend_key(backend, inventory: Inventory) -> dict:
    """The backend as declared, with the versions of the libraries it declares."""
    libs = {}
    for r in backend.requires:
        dist = getattr(r, "dist", None)
        if dist:
            libs[dist] = inventory.get(dist).version
    return {
        "op": backend.op,
        "name": backend.name,
        "impl": backend.impl,
        "requires": [repr(r) for r in backend.requires],
        "libraries": libs,
    }


def digest(obj) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]
