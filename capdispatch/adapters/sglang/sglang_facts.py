"""Correct SGLang's architecture facts to this rank's card.

SGLang computes them once per process, from device 0 (NVML, while CUDA is not
initialised) or the current device, and caches them; on a mixed node every rank
would otherwise answer for another card. What to correct is data (knobs.yaml,
`arch`); only the scheduler process of the rank is changed.
"""
from __future__ import annotations

import importlib
import sys

from packaging.version import InvalidVersion, Version


def facts(spec, arch: dict) -> dict:
    """Fact name -> value for SPEC: every probe of the knob map, plus `sm` and `cc`."""
    cc = tuple(spec.cc) if spec.platform == "cuda" and spec.cc else None
    sm = cc[0] * 10 + cc[1] if cc else 0
    try:
        cuda = Version(spec.cuda) if spec.cuda else None
    except InvalidVersion:
        cuda = None
    out = {"sm": sm, "cc": cc}
    for name, rule in arch["probes"].items():
        if "value" in rule:
            out[name] = out[rule["value"]]
        elif "cc" in rule:
            major, _, minor = str(rule["cc"]).partition(".")
            out[name] = cc == (int(major), int(minor or 0))
        else:
            # An unknown CUDA toolkit (a simulated card) is not held against the card.
            out[name] = bool(cc) and cc[0] in rule["majors"] and (
                cuda is None or cuda >= Version(str(rule["min_cuda"])))
    return out


class PinnedProbe:
    """A probe that answers for this rank's card. Keeps lru_cache's helpers so
    callers of cache_clear()/cache_info() still work."""

    def __init__(self, name: str, value, original):
        self.__name__ = self.__qualname__ = name
        self.value = value
        self.__wrapped__ = original

    def __call__(self, *args, **kwargs):
        return self.value

    def cache_clear(self) -> None:
        pass

    def cache_info(self):
        info = getattr(self.__wrapped__, "cache_info", None)
        return info() if info else None

    def __repr__(self) -> str:
        return f"<capdispatch pinned {self.__name__}() -> {self.value!r}>"


def _original(obj):
    return obj.__wrapped__ if type(obj) is PinnedProbe else obj


def _cached_value(fn):
    """The value SGLang had cached, without computing one."""
    info = getattr(fn, "cache_info", None)
    if isinstance(fn, PinnedProbe):
        return fn.value
    if info is not None and info().currsize:
        return fn()
    return "(not computed)"


def _rebind(replacements: dict) -> int:
    """Replace every module global that is one of the originals (by identity),
    or an earlier PinnedProbe of it, across loaded modules: from-import copies too."""
    count = 0
    for mod in list(sys.modules.values()):
        try:
            d = vars(mod)
        except Exception:      # odd objects in sys.modules (lazy proxies)
            continue
        if not isinstance(d, dict):
            continue
        for attr, value in list(d.items()):
            # type() and id() only: module globals may be proxies that misbehave on access.
            new = replacements.get(id(value.__wrapped__ if type(value) is PinnedProbe else value))
            if new is not None and value is not new:
                try:
                    setattr(mod, attr, new)
                    count += 1
                except (AttributeError, TypeError):
                    pass
    return count


def correct(spec, arch: dict) -> list:
    """Make SGLang's probes, platform facade, import-time globals and JIT target
    answer for SPEC. Returns [(what, before, after)] for the facts that changed."""
    values = facts(spec, arch)
    changes = []
    common = importlib.import_module(arch["module"])
    replacements = {}
    for name in arch["probes"]:
        current = getattr(common, name, None)
        if current is None:
            continue
        before = _cached_value(current)
        pinned = PinnedProbe(name, values[name], _original(current))
        replacements[id(pinned.__wrapped__)] = pinned
        if before != "(not computed)" and before != values[name]:
            changes.append((name, before, values[name]))
    _rebind(replacements)

    if arch["platform"]:        # empty: this SGLang has no platform facade; readers call the probes
        from sglang.srt.runtime_context import override_platform
        platform = {fact: values[src] for fact, src in arch["platform"].items()}
        override_platform(**platform).install()

    for row in arch["globals"]:
        mod = sys.modules.get(row["module"])
        if mod is None or not hasattr(mod, row["name"]):
            continue       # imported later, it reads the corrected probes itself
        before, after = getattr(mod, row["name"]), values[row["fact"]]
        setattr(mod, row["name"], after)
        if before != after:
            changes.append((f"{row['module']}.{row['name']}", before, after))

    if values["cc"]:
        j = arch["jit_arch"]
        mod = importlib.import_module(j["module"])
        before = getattr(mod, j["value"], None)
        after = getattr(mod, j["make"])(*values["cc"])
        setattr(mod, j["value"], after)
        # Never re-detect from the current device (device 0 until the rank sets its own).
        setattr(mod, j["detect"], lambda: None)
        if before != after:
            changes.append(("jit arch", before, after))
    return changes
