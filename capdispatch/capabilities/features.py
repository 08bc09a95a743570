"""Feature rules: raw facts -> named features, each rule with its source."""
from __future__ import annotations

import functools
from typing import Optional

import attrs
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import _data
from .spec import DeviceSpec


@attrs.frozen
class Rule:
    name: str
    source: str
    cc: Optional[SpecifierSet] = None
    smem: Optional[int] = None
    cc_text: str = ""      # the rule as written (SpecifierSet sorts its parts)

    def holds(self, spec: DeviceSpec) -> bool:
        if spec.platform != "cuda":
            return False
        if self.cc is not None:
            if spec.cc is None or Version(spec.cc_str) not in self.cc:
                return False
        if self.smem is not None:
            if spec.smem_optin_per_block is None or spec.smem_optin_per_block < self.smem:
                return False
        return True

    @property
    def need(self) -> str:
        parts = []
        if self.cc is not None:
            parts.append(f"cc {self.cc_text or self.cc}")
        if self.smem is not None:
            parts.append(f"opt-in smem >= {self.smem} B")
        return " and ".join(parts)

    def found(self, spec: DeviceSpec) -> str:
        if spec.platform != "cuda":
            return f"{spec.platform} device"
        parts = []
        if self.cc is not None:
            parts.append(f"cc {spec.cc_str or 'unknown'}")
        if self.smem is not None:
            parts.append(f"opt-in smem {spec.smem_optin_per_block if spec.smem_optin_per_block is not None else 'unknown'} B")
        return ", ".join(parts)


@functools.lru_cache(maxsize=None)
def rules() -> dict:
    table = {}
    for name, body in _data.load("features.yaml")["rules"].items():
        table[name] = Rule(
            name=name,
            source=body["source"],
            cc=SpecifierSet(body["cc"]) if "cc" in body else None,
            cc_text=body.get("cc", ""),
            smem=body.get("smem"),
        )
    return table


def derive(spec: DeviceSpec) -> frozenset:
    """The features this device has, by the rules."""
    return frozenset(name for name, rule in rules().items() if rule.holds(spec))
