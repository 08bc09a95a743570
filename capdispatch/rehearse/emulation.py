"""An emulated card on a real device: its facts installed for the rank's process, and what
each kernel that ran could and could not take from it.

`install(dev)` gives the rank its one DeviceFacts record (backends/device_facts): on a CUDA
device, the emulated card's launch tables (compute capability), shared-memory limit per
block (every Triton launch admitted under it), SM count (the split counts) and fp8 support
(the uint8 codec where it has none) for every thread of the process, and its memory as a
cap on the process (torch's per-process memory fraction). On the CPU nothing is installed:
the interpreter's tiles are the same for every card."""
from __future__ import annotations

from typing import Optional

import attrs

from ..capabilities.effective import DeviceFacts

__all__ = ["Installed", "install", "not_emulated"]


@attrs.frozen
class Installed:
    facts: DeviceFacts            # what the rank's kernels launch by
    memory_cap: Optional[int]     # bytes the process may allocate on the device, None uncapped
    note: Optional[str]           # what the installation could not do, for the report

    def to_dict(self) -> dict:
        d = self.facts.to_dict()
        d.update(memory_cap=self.memory_cap, note=self.note)
        return d


def install(dev) -> Installed:
    """The facts of rank device DEV (a RankDevice), installed where DEV is an emulated card
    on a CUDA device; a real device's own facts otherwise."""
    from ..capabilities import catalog
    from ..capabilities.effective import facts_of
    if dev.run == "cpu":
        spec = catalog.simulate(dev.decide[4:]) if dev.emulated else None
        if spec is None:
            return Installed(facts_of(_cpu_spec()), None, None)
        return Installed(facts_of(spec, "cpu"), None,
                         "on the CPU the kernels run the interpreter's tiles: the card's launch tables, "
                         "shared memory, SM count and memory do not apply")
    from ..backends import device_facts
    index = int(dev.run[5:])
    if not dev.emulated:
        return Installed(device_facts.real(index), None, None)
    f = device_facts.emulate_card(catalog.simulate(dev.decide[4:]), index)
    return Installed(f, _cap_memory(index, f.memory, device_facts.real(index).memory), None)


def _cpu_spec():
    from ..capabilities import probing
    return probing.probe_cpu()


def _cap_memory(index: int, card: Optional[int], total: Optional[int]) -> Optional[int]:
    """Cap the process's allocations on device INDEX at the card's memory (no cap where the
    device has less or either is unknown)."""
    if not card or not total or card >= total:
        return None
    import torch
    torch.cuda.set_per_process_memory_fraction(card / total, index)
    return card


# What a kernel takes from the card's facts where it runs on another card, by backend.
# Triton launches read all four; the libraries' kernels plan inside the library.
_TRITON = "compiled for the real card (its ISA, registers, occupancy)"
_LIBRARY = ("the library's own tile tables, SM count and shared-memory use are the real card's "
            "(planned inside the library)")
_NOT = {
    "torch": "runs on the real device: only the memory cap applies",
    "tilelang": "compiled for the real card; launch tables and shared-memory limit are TileLang's "
                "for the real card (the split count and the fp8/uint8 codec are the card's)",
    "marlin_w4a16": _LIBRARY,
}


def not_emulated(backend: str) -> str:
    """What of the card's limits the BACKEND's kernel does not take where it runs on another card."""
    if backend in _NOT:
        return _NOT[backend]
    if backend.startswith("triton"):
        return _TRITON
    return _LIBRARY
