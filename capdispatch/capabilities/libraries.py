"""Installed libraries as facts: versions from package metadata, never by import.

Importing a library is a separate, lazy check (`import_check`) whose failure is
recorded, never raised.
"""
from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
import threading
from importlib import metadata
from typing import TYPE_CHECKING, Optional

import attrs
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..errors import CapdispatchError

if TYPE_CHECKING:
    from .lib_profiles import Profile


class AssumeLibError(CapdispatchError, ValueError):
    """A bad --assume-lib value."""


@attrs.frozen
class LibraryFact:
    name: str                       # canonical distribution name
    version: Optional[str]          # None: not installed (or assumed without a version)
    installed: bool
    assumed: bool = False
    source: str = "this machine"    # "this machine", "assumed", or "profile NAME"

    def describe(self) -> str:
        profile = self.source.startswith("profile ")
        where = f" ({self.source[len('profile '):]})" if profile else ""
        if not self.installed:
            return f"not installed{where}"
        if self.version is None:
            return f"installed, version not pinned{where}" if profile else "assumed (no version given)"
        return f"{self.version}{' (assumed)' if self.assumed and not profile else where}"


MAX_ASSUME = 200    # characters: a name and a version are far shorter


def _shown(text) -> str:
    return ascii(text) if len(text) <= 80 else f"{ascii(text[:60])}... ({len(text)} characters)"


def parse_assume(text: str) -> tuple:
    """'triton' -> ('triton', None); 'flashinfer-python==0.6.14' -> (name, '0.6.14')."""
    if not isinstance(text, str):
        raise AssumeLibError(f"bad --assume-lib {text!r}: expected a string NAME or NAME==VERSION")
    if len(text) > MAX_ASSUME:
        raise AssumeLibError(f"bad --assume-lib {_shown(text)}: longer than {MAX_ASSUME} "
                             f"characters; expected NAME or NAME==VERSION")
    try:
        req = Requirement(text)
    except (InvalidRequirement, ValueError) as exc:
        # packaging's message goes on to draw the value with a caret under it: its first line only
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise AssumeLibError(f"bad --assume-lib {_shown(text)}: {why}; expected NAME or "
                             f"NAME==VERSION") from None
    if req.url or req.extras or req.marker:
        raise AssumeLibError(f"bad --assume-lib {_shown(text)}: expected NAME or NAME==VERSION "
                             f"(no extras, URL or environment marker)")
    specs = list(req.specifier)
    if not specs:
        return canonicalize_name(req.name), None
    if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
        raise AssumeLibError(f"bad --assume-lib {_shown(text)}: give one exact version, NAME==VERSION")
    try:
        Version(specs[0].version)
    except (InvalidVersion, ValueError):
        raise AssumeLibError(f"bad --assume-lib {_shown(text)}: {_shown(specs[0].version)} is not "
                             f"a version (e.g. 3.4.0)") from None
    return canonicalize_name(req.name), specs[0].version


@attrs.frozen
class Inventory:
    """Libraries of the machine a decision is for: this one's, or a profile's (the
    whole inventory of a target machine), plus assumptions on top."""

    assumed: tuple = ()     # ((name, version-or-None), ...)
    profile: Optional[Profile] = None   # None: this machine's
    default: bool = False   # the profile is the default for simulated devices (nothing was said)
    # This machine's versions as read once for this inventory (one decision, one run): a
    # plan of 128 cards asks for the same few distributions thousands of times.
    _read: dict = attrs.field(factory=dict, eq=False, repr=False, alias="_read")

    @classmethod
    def with_assumptions(cls, assume_libs=None, *, libs=None, known=None) -> "Inventory":
        """KNOWN (distribution names): refuse any other name with a did-you-mean.
        LIBS: a profile name (see lib_profiles.yaml), "local" or None for this
        machine's, "default" for the default profile of simulated devices."""
        from . import lib_profiles
        profile, default = None, False
        if libs is not None:
            key = libs.strip().lower() if isinstance(libs, str) else None
            try:
                if isinstance(libs, lib_profiles.Profile):
                    profile = libs
                elif key == lib_profiles.DEFAULT:
                    profile, default = lib_profiles.lookup(lib_profiles.default_name()), True
                elif key != lib_profiles.LOCAL:
                    profile = lib_profiles.lookup(str(libs))
            except lib_profiles.UnknownProfileError as exc:
                raise AssumeLibError(f"--libs: {exc}") from None
        assumed = tuple(parse_assume(a) if isinstance(a, str) else tuple(a) for a in (assume_libs or ()))
        if known is not None:
            # KNOWN may map import names to distributions ({"flash-mla": "sgl-flash-mla"}).
            modules = dict(known) if isinstance(known, dict) else {}
            dists = {d for d in (modules.values() if modules else known)} | lib_profiles.dists()
            for name, _ in assumed:
                if name not in dists and name in modules:
                    raise AssumeLibError(f"--assume-lib {name!r} is an import name; the distribution "
                                         f"that installs it is {modules[name]!r}: "
                                         f"--assume-lib {modules[name]}")
                _check_known(name, dists)
        return cls(assumed=assumed, profile=profile, default=default)

    @property
    def whose(self) -> str:
        """Whose libraries the decisions use, for people."""
        base = f"the {self.profile.name} profile's" if self.profile else "this machine's"
        if self.default:
            base += " (the default for simulated devices)"
        return f"{base}, with assumptions" if self.assumed else base

    @property
    def local(self) -> bool:
        """Only this machine's libraries, nothing assumed."""
        return self.profile is None and not self.assumed

    def get(self, name: str) -> LibraryFact:
        name = canonicalize_name(name)
        for assumed_name, version in reversed(self.assumed):
            if assumed_name == name:
                return LibraryFact(name, version, True, assumed=True, source="assumed")
        if self.profile is not None:
            lib = self.profile.get(name)
            # assumed: a profile describes another machine, so nothing is import-checked here.
            return LibraryFact(name, lib.version if lib else None, lib is not None, assumed=True,
                               source=f"profile {self.profile.name}")
        if name not in self._read:
            try:
                self._read[name] = LibraryFact(name, metadata.version(name), True)
            except metadata.PackageNotFoundError:
                self._read[name] = LibraryFact(name, None, False)
        return self._read[name]

    def to_dict(self, dists=()) -> dict:
        return {"whose": self.whose, "profile": self.profile.name if self.profile else None,
                "default": self.default,
                "assumed": {n: v for n, v in self.assumed},
                "versions": {d: self.get(d).describe() for d in dists}}


def _check_known(name: str, known: set) -> None:
    if name in known:
        return

    from . import lib_profiles
    profiles = {canonicalize_name(p): p for p in lib_profiles.names()}
    if name in profiles:
        raise AssumeLibError(f"--assume-lib {name!r} names a library profile, not a library: "
                             f"use --libs {profiles[name]}")
    close = [k for k in sorted(known) if k.startswith(name) or name in k] \
        or difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close[:3])}?" if close else ""
    raise AssumeLibError(f"--assume-lib: unknown library {name!r}{hint} (libraries a backend "
                         f"needs: {', '.join(sorted(known))})")


@attrs.frozen
class ImportCheck:
    module: str
    ok: bool
    error: Optional[str] = None


DEFAULT_IMPORT_TIMEOUT = 60.0   # seconds; a cold import of torch or triton takes a few


def import_timeout(env) -> float:
    """Seconds one import check may take: CAPDISPATCH_IMPORT_TIMEOUT (checked), else the default."""
    raw = env.get("CAPDISPATCH_IMPORT_TIMEOUT", "")
    if not raw.strip():
        return DEFAULT_IMPORT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:
        raise ImportTimeoutError(f"CAPDISPATCH_IMPORT_TIMEOUT={ascii(raw[:40])} is not a number "
                                 f"of seconds in (0, 3600] (default {DEFAULT_IMPORT_TIMEOUT:g})")
    return value


class ImportTimeoutError(CapdispatchError, ValueError):
    """A bad CAPDISPATCH_IMPORT_TIMEOUT value."""


# Imports still running after their check gave up, by module: a second check
# must not wait on the same import lock.
_pending: dict = {}
_pending_lock = threading.Lock()


def import_check(module: str, *, timeout: Optional[float] = None, env=None) -> ImportCheck:
    """Try importing MODULE within TIMEOUT seconds (default CAPDISPATCH_IMPORT_TIMEOUT or
    60); a failure or a hang is recorded in the result, never raised or waited out.

    The import runs on a daemon thread so that a library that hangs at import
    (a driver call, a lock, a network mount) costs the decision TIMEOUT seconds
    instead of the whole command.
    """
    if module in sys.modules and module not in _pending:
        return ImportCheck(module, True)
    if timeout is None:
        timeout = import_timeout(os.environ if env is None else env)
    with _pending_lock:
        worker = _pending.get(module)
        if worker is None:
            worker = _pending[module] = _ImportThread(module)
            worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return ImportCheck(module, False, f"timed out after {timeout:g} s (the import is left "
                                          f"running in the background; CAPDISPATCH_IMPORT_TIMEOUT "
                                          f"sets the limit)")
    with _pending_lock:
        _pending.pop(module, None)
    if worker.error is not None:
        return ImportCheck(module, False, worker.error)
    return ImportCheck(module, True)


class _ImportThread(threading.Thread):
    def __init__(self, module: str):
        super().__init__(name=f"capdispatch-import-{module}", daemon=True)
        self.module, self.error = module, None

    def run(self):
        try:
            importlib.import_module(self.module)
        except BaseException as exc:  # any failure of a foreign import is a fact, not a crash
            self.error = re.sub(r"\s+", " ", f"{type(exc).__name__}: {exc}")[:300]
