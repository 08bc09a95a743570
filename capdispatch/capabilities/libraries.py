"""Installed libraries as facts: versions from package metadata, never by import.

Importing a library is a separate, lazy check (`import_check`) whose failure is
recorded, never raised.
"""
from __future__ import annotations

import importlib
import re
from importlib import metadata
from typing import Optional

import attrs
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..errors import CapdispatchError


class AssumeLibError(CapdispatchError, ValueError):
    """A bad --assume-lib value."""


@attrs.frozen
class LibraryFact:
    name: str                       # canonical distribution name
    version: Optional[str]          # None: not installed (or assumed without a version)
    installed: bool
    assumed: bool = False

    def describe(self) -> str:
        if not self.installed:
            return "not installed"
        if self.version is None:
            return "assumed (no version given)"
        return f"{self.version}{' (assumed)' if self.assumed else ''}"


def parse_assume(text: str) -> tuple:
    """'triton' -> ('triton', None); 'flashinfer-python==0.6.14' -> (name, '0.6.14')."""
    try:
        req = Requirement(text)
    except InvalidRequirement as exc:
        raise AssumeLibError(f"bad --assume-lib {text!r}: {exc}; expected NAME or NAME==VERSION")
    specs = list(req.specifier)
    if not specs:
        return canonicalize_name(req.name), None
    if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
        raise AssumeLibError(f"bad --assume-lib {text!r}: give one exact version, NAME==VERSION")
    try:
        Version(specs[0].version)
    except InvalidVersion:
        raise AssumeLibError(f"bad --assume-lib {text!r}: {specs[0].version!r} is not a version")
    return canonicalize_name(req.name), specs[0].version


@attrs.frozen
class Inventory:
    """Libraries of the machine a decision is for: this one's, plus assumptions."""

    assumed: tuple = ()    # ((name, version-or-None), ...)

    @classmethod
    def with_assumptions(cls, assume_libs=None) -> "Inventory":
        return cls(assumed=tuple(parse_assume(a) if isinstance(a, str) else tuple(a)
                                 for a in (assume_libs or ())))

    def get(self, name: str) -> LibraryFact:
        name = canonicalize_name(name)
        for assumed_name, version in reversed(self.assumed):
            if assumed_name == name:
                return LibraryFact(name, version, True, assumed=True)
        try:
            return LibraryFact(name, metadata.version(name), True)
        except metadata.PackageNotFoundError:
            return LibraryFact(name, None, False)


@attrs.frozen
class ImportCheck:
    module: str
    ok: bool
    error: Optional[str] = None


def import_check(module: str) -> ImportCheck:
    """Try importing MODULE; a failure is recorded in the result, never raised."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # any failure of a foreign import is a fact, not a crash
        msg = re.sub(r"\s+", " ", f"{type(exc).__name__}: {exc}")[:300]
        return ImportCheck(module, False, msg)
    return ImportCheck(module, True)
