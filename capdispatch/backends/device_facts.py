"""The effective facts of the CUDA device a kernel launches on: the card's own, or those of
the card this process emulates on it (``emulate``).

Every launch decision that depends on the card reads ``facts(device)``: the launch tables
(compute capability), the split counts (SM count), the fp8 codec (native fp8), and, for an
emulated card, the shared-memory limit each launch is admitted under (launch_limits). An
emulation is process-wide and per device index: it holds for every thread of the process
that launches on that device, and never for another device. A real card's facts are probed
once per device index.

Launch plans computed from these facts are kept in dicts the kernel modules register here
(``plan_cache``); installing or removing an emulation empties them, so no plan computed for
one card answers for another.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["emulate", "emulate_card", "stop_emulating", "emulated", "facts", "for_index", "real", "plan_cache", "sm_count",
           "capability", "native_fp8"]

_emulated: dict = {}   # CUDA device index -> DeviceFacts of the card emulated on it
_real: dict = {}       # CUDA device index -> DeviceFacts probed from that card
_caches: list = []     # plan dicts derived from the facts


def plan_cache() -> dict:
    """A new dict for launch plans derived from device facts, emptied when an emulation changes."""
    d: dict = {}
    _caches.append(d)
    return d


def _forget_plans() -> None:
    for d in _caches:
        d.clear()
    from . import launch_limits
    launch_limits.set_device_targets({i: f for i, f in _emulated.items()})


def emulate(f) -> None:
    """Launch on F.device (cuda:N) as F's card, for every thread of this process."""
    from ..capabilities.effective import DeviceFacts
    if not isinstance(f, DeviceFacts):
        raise TypeError(f"emulate needs a DeviceFacts, got {type(f).__name__}")
    if f.index is None:
        raise ValueError(f"an emulated card runs on a CUDA device, got {f.device!r} (the CPU runs the "
                         f"interpreter's tiles whatever the card)")
    for field in ("cc", "sm_count", "smem_optin_per_block"):
        if getattr(f, field) is None:
            raise ValueError(f"{f.label}: the card's {field} is unknown; an emulated card needs it")
    _emulated[f.index] = f
    _forget_plans()


def emulate_card(spec, index: int):
    """Launch on cuda:INDEX as the catalog card SPEC (a simulated DeviceSpec), for every
    thread of this process. Returns the DeviceFacts installed."""
    from ..capabilities.effective import facts_of
    f = facts_of(spec, f"cuda:{int(index)}")
    if not f.emulated:
        raise ValueError(f"emulate_card needs a catalog card (sim:NAME), got {spec.id!r}")
    emulate(f)
    return f


def stop_emulating(index: Optional[int] = None) -> None:
    """End the emulation on device INDEX (every device when None)."""
    if index is None:
        _emulated.clear()
    else:
        _emulated.pop(index, None)
    _forget_plans()


def emulated(index: int):
    """The DeviceFacts emulated on device INDEX, or None."""
    return _emulated.get(index)


def for_index(index: int):
    """The effective DeviceFacts of CUDA device INDEX."""
    f = _emulated.get(index)
    if f is not None:
        return f
    return real(index)


def real(index: int):
    """The DeviceFacts of the card at CUDA device INDEX itself, emulated or not: what a
    kernel is compiled for (its code must run on the card that is there)."""
    f = _real.get(index)
    if f is None:
        import torch

        from ..capabilities.effective import facts_of
        from ..capabilities.probing import probe_torch
        f = _real[index] = facts_of(probe_torch(index), fp8=False if torch.version.hip else None)
    return f


def facts(device):
    """The effective DeviceFacts of torch device DEVICE (a CUDA device; a bare "cuda" is the current one)."""
    index = device.index
    if index is None:
        import torch
        index = torch.cuda.current_device()
    return for_index(index)


def sm_count(device) -> int:
    return facts(device).sm_count


def capability(device) -> tuple:
    return facts(device).cc


def native_fp8(device) -> bool:
    """Whether launches on DEVICE use native fp8 (False off CUDA)."""
    return device.type == "cuda" and facts(device).fp8
