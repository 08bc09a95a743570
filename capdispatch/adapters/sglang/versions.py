"""Which SGLang releases the adapter acts on (the knob map's `tested` range; the caller
loads the knob map and hands it in)."""
from __future__ import annotations

from typing import NamedTuple, Optional
from importlib import metadata

from packaging.version import InvalidVersion, Version


class Verdict(NamedTuple):
    ok: bool
    version: Optional[str]
    tested: str
    message: str


def installed() -> Optional[str]:
    """The installed SGLang's version, from package metadata (no import)."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check(version: Optional[str], knobs) -> Verdict:
    """Is VERSION (None: the installed SGLang) one the adapter was tested with, by the
    knob map KNOBS (knobs.Knobs)?"""
    k = knobs
    tested = k.tested_text or str(k.tested)
    version = version if version is not None else installed()
    if version is None:
        return Verdict(False, None, tested, "capdispatch: SGLang is not installed; the SGLang "
                       "adapter has nothing to act on")
    try:
        v = Version(version)
    except InvalidVersion:
        return Verdict(False, version, tested, f"capdispatch: cannot read the SGLang version "
                       f"{version!r}; the SGLang adapter changes nothing")
    if not k.tested.contains(v, prereleases=True) or k.release(version) is None:
        return Verdict(False, version, tested, (
            f"capdispatch: SGLang {version} is outside the tested range {tested}; the capdispatch "
            f"plugin changes nothing in this process (no server arguments, environment, "
            f"architecture facts or kernel routes). Install a tested SGLang release to "
            f"use it."))
    return Verdict(True, version, tested, f"SGLang {version} (tested range {tested})")
