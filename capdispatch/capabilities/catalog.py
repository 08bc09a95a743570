"""The catalog of known GPUs and bare architectures (catalog.yaml)."""
from __future__ import annotations

import difflib
import functools
import re
from typing import Optional

from ..errors import CapdispatchError
from . import _data
from .spec import DeviceSpec


class UnknownDeviceError(CapdispatchError, ValueError):
    """A device name that is neither in the catalog nor a bare architecture."""


@functools.lru_cache(maxsize=None)   # static package data
def _entries() -> dict:
    data = _data.load("catalog.yaml")
    table = {}
    for section in ("gpus", "archs"):
        for key, body in (data.get(section) or {}).items():
            table[key] = dict(body, key=key, section=section)
    return table


def names() -> list:
    return sorted(_entries())


@functools.lru_cache(maxsize=None)
def _aliases() -> dict:
    """Every name that means a catalog entry, lower case: key, aliases, driver name."""
    out = {}
    for key, body in _entries().items():
        out[key] = key
        for alias in body.get("aliases") or ():
            out[str(alias).lower()] = key
        if body.get("name"):
            out.setdefault(str(body["name"]).lower(), key)
    return out


def known_names() -> dict:
    """Lower-case name (key, alias or driver name) -> catalog key."""
    return dict(_aliases())


def canonical_key(name: str) -> Optional[str]:
    """The catalog key NAME means (key, alias or driver name, any case), else None."""
    try:
        return lookup(name)["key"]
    except UnknownDeviceError:
        return None


def lookup(name: str) -> dict:
    """The catalog entry for NAME (key, alias or driver name; case-insensitive)."""
    if not isinstance(name, str):
        raise UnknownDeviceError(f"a simulated device name is text, not {type(name).__name__}")
    norm = " ".join(name.split()).lower()
    aliases = _aliases()
    key = aliases.get(norm) or aliases.get(norm.replace("_", "-"))
    if key is None:
        m = re.fullmatch(r"sm_?(\d{2,3})[af]?", norm)
        if m and f"sm_{m.group(1)}" in aliases:
            key = f"sm_{m.group(1)}"
    if key is None:
        close = difflib.get_close_matches(norm[:100], list(aliases), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        shown = ascii(name) if len(name) <= 80 else ascii(name[:60]) + f"... ({len(name)} characters)"
        raise UnknownDeviceError(
            f"unknown simulated device {shown}{hint} "
            f"(known: {', '.join(names())}; their aliases and driver names also work)"
        )
    return _entries()[key]


def match_name(device_name: str) -> Optional[dict]:
    """The catalog GPU whose driver-reported name equals DEVICE_NAME, if any."""
    want = device_name.strip().lower()
    for body in _entries().values():
        if body["section"] == "gpus" and str(body.get("name", "")).lower() == want:
            return body
    return None


def arch_entry(cc: tuple) -> Optional[dict]:
    return _entries().get(f"sm_{cc[0]}{cc[1]}")


def simulate(name: str, *, cuda: Optional[str] = None) -> DeviceSpec:
    entry = lookup(name)
    return DeviceSpec(
        id=f"sim:{entry['key']}",   # one id per card model, whichever name was given
        name=entry.get("name") or entry["key"],
        platform="cuda",
        vendor="NVIDIA",
        cc=str(entry["cc"]),
        sm_count=entry.get("sm_count"),
        smem_optin_per_block=entry.get("smem_optin_per_block"),
        memory=entry.get("memory"),
        cuda=cuda,
        probe="sim",
        catalog_key=entry["key"],
    )
