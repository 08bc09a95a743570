"""DeviceFacts: the facts a rank's kernels launch by, one record whether the card is real
or emulated.

A real card's record comes from its probed DeviceSpec; an emulated card's from the catalog
card's DeviceSpec, run on a real device. The kernels read only this record (compute
capability for their launch tables, SM count for their split counts, opt-in shared memory
per block for the launches they admit, native fp8 for their codec, memory for the cap on
the process), so a real device and an emulated one go through the same code."""
from __future__ import annotations

from typing import Optional

import attrs

from .features import derive
from .spec import DeviceSpec

__all__ = ["DeviceFacts", "facts_of"]


@attrs.frozen
class DeviceFacts:
    device: str                           # where the kernels run: "cuda:0" or "cpu"
    label: str                            # "cuda:0", or "emu:rtx-3080@cuda:0" for an emulated card
    cc: Optional[tuple]                   # (major, minor) the launch tables are read for
    sm_count: Optional[int]               # SMs the split counts are planned for
    smem_optin_per_block: Optional[int]   # bytes a launch may use
    memory: Optional[int]                 # bytes of device memory the process may use
    fp8: bool                             # native fp8 e4m3 (the fp8_e4m3 feature)
    card: Optional[str] = None            # the emulated card's catalog key, None for a real card

    @property
    def emulated(self) -> bool:
        return self.card is not None

    @property
    def index(self) -> Optional[int]:
        """The CUDA device index the kernels run on, None for the CPU."""
        return int(self.device[5:]) if self.device.startswith("cuda:") else None

    def to_dict(self) -> dict:
        d = attrs.asdict(self)
        d["cc"] = None if self.cc is None else f"{self.cc[0]}.{self.cc[1]}"
        d["emulated"] = self.emulated
        return d


def facts_of(spec: DeviceSpec, run: Optional[str] = None, *, fp8: Optional[bool] = None) -> DeviceFacts:
    """The facts of SPEC's card, its kernels running on RUN (default: SPEC's own device).
    A simulated SPEC run on a real device is an emulated card. FP8 overrides the feature
    rule where the platform says otherwise (ROCm's fp8 is not the e4m3fn Triton type)."""
    run = run or spec.id
    if not (run == "cpu" or (run.startswith("cuda:") and run[5:].isdigit())):
        raise ValueError(f"DeviceFacts run on cpu or cuda:N, got {run!r}")
    emulated = spec.simulated
    if spec.platform != "cuda":
        return DeviceFacts(device=run, label=run, cc=None, sm_count=None, smem_optin_per_block=None,
                           memory=None, fp8=False)
    native = "fp8_e4m3" in derive(spec) if fp8 is None else bool(fp8)
    key = spec.catalog_key or spec.id
    return DeviceFacts(device=run, label=f"emu:{key}@{run}" if emulated else run, cc=spec.cc,
                       sm_count=spec.sm_count, smem_optin_per_block=spec.smem_optin_per_block,
                       memory=spec.memory, fp8=native, card=key if emulated else None)
