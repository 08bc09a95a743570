"""DeviceSpec: the raw facts of one device, probed or simulated."""
from __future__ import annotations

from typing import Optional

import attrs


def _cc(value):
    if value is None or isinstance(value, tuple):
        return value
    if isinstance(value, str):
        major, _, minor = value.partition(".")
        return (int(major), int(minor or 0))
    return tuple(value)


@attrs.frozen
class DeviceSpec:
    """What a device *is*. Features are derived from these facts by rules
    (see features.py); nothing here is a preference."""

    id: str                              # "cuda:0", "cpu", "sim:rtx-3080"
    name: str                            # marketing name as the driver prints it
    platform: str                        # "cuda" or "cpu"
    vendor: str = ""
    cc: Optional[tuple] = attrs.field(default=None, converter=_cc)
    sm_count: Optional[int] = None
    smem_optin_per_block: Optional[int] = None   # bytes
    memory: Optional[int] = None                 # bytes
    cuda: Optional[str] = None           # CUDA toolkit the software stack was built for
    uuid: Optional[str] = None
    probe: str = "cpu"                   # how the facts were obtained: torch | nvml | cpu | sim
    catalog_key: Optional[str] = None    # catalog entry the facts came from or were matched to
    notes: tuple = attrs.field(default=(), converter=tuple)  # caveats of the probe, for people

    @property
    def cc_str(self) -> Optional[str]:
        return None if self.cc is None else f"{self.cc[0]}.{self.cc[1]}"

    @property
    def simulated(self) -> bool:
        return self.probe == "sim"

    def with_id(self, new_id: str) -> "DeviceSpec":
        return attrs.evolve(self, id=new_id)

    def to_dict(self) -> dict:
        d = attrs.asdict(self, recurse=False)
        d["cc"] = self.cc_str
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceSpec":
        fields = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})
