"""Library profiles: the inventory of a serving stack, kept as data (lib_profiles.yaml)."""
from __future__ import annotations

import difflib
import functools
from typing import Optional

import attrs
from packaging.utils import canonicalize_name

from ..errors import CapdispatchError
from . import _data


class UnknownProfileError(CapdispatchError, ValueError):
    """A --libs name that is not a profile."""


@attrs.frozen
class ProfileLib:
    name: str                   # canonical distribution name
    version: Optional[str]      # None: installed by the stack without a pin
    via: Optional[str] = None   # the listed library that brings an unpinned one


@attrs.frozen
class Profile:
    name: str
    summary: str
    stack: str                  # the requirement the profile describes, e.g. sglang==0.5.23
    libraries: tuple            # ProfileLib, in file order

    def get(self, dist: str) -> Optional[ProfileLib]:
        dist = canonicalize_name(dist)
        return next((lib for lib in self.libraries if lib.name == dist), None)


@functools.lru_cache(maxsize=None)   # static package data
def profiles() -> dict:
    out = {}
    for name, body in (_data.load("lib_profiles.yaml").get("profiles") or {}).items():
        libs = tuple(ProfileLib(canonicalize_name(k), None if v.get("version") is None
                                else str(v["version"]), v.get("via"))
                     for k, v in (body.get("libraries") or {}).items())
        out[name] = Profile(name, str(body.get("summary", "")), str(body.get("stack", "")), libs)
    return out


def names() -> list:
    return sorted(profiles())


# Keywords --libs takes besides a profile's name.
LOCAL = "local"        # this machine's libraries
DEFAULT = "default"    # default_name(): what plans simulated devices when nothing is said


def default_name() -> str:
    """The profile that plans simulated devices when neither --libs nor --assume-lib is given."""
    return str(_data.load("lib_profiles.yaml").get("default") or names()[-1])


def target_libs(specs, libs=None, assume_libs=()):
    """Whose libraries plan SPECS, as a --libs value: the one rule of every command and of the
    API. LIBS when given; DEFAULT (the default profile) for a group of simulated or emulated
    devices when neither LIBS nor ASSUME_LIBS says what the target has, since this machine's
    libraries say nothing of a simulated card's machine; else None: this machine's."""
    if libs is None and not assume_libs and specs and all(s.simulated for s in specs):
        return DEFAULT
    return libs


def lookup(name: str) -> Profile:
    by_lower = {k.lower(): v for k, v in profiles().items()}
    found = by_lower.get(name.strip().lower())
    if found is None:
        close = difflib.get_close_matches(name.strip(), names(), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownProfileError(f"unknown library profile {name!r}{hint} "
                                  f"(known: {', '.join(names())}; or {LOCAL}: this machine's "
                                  f"libraries, {DEFAULT}: {default_name()})")
    return found


def dists() -> set:
    """Every distribution some profile lists."""
    return {lib.name for p in profiles().values() for lib in p.libraries}
