"""Which ranks' MoE layers are routed, and why (no SGLang, no torch here).

SGLang takes one `moe_runner_backend` for the whole launch: the user's, or
its DeepSeek-V4 default, decided from device 0's architecture. Each rank then
builds the method SGLang picks for that value on ITS card (knobs.yaml, the moe
route's `native_by`). Where that method's kernel (the capdispatch backend with
the same requirements) runs on the card, SGLang's own method is kept; where it
cannot, or where the value has no MXFP4 method at all, the rank's MoE layers
are routed to the capdispatch backend decided for the card. A value the user
set that cannot run on a rank is said at WARNING (an error under strict).
"""
from __future__ import annotations

from typing import Optional

import attrs

from .records import SglangSetting, family

OTHER = "other"        # a device family, or a value, not listed


@attrs.frozen
class NativeBy:
    """The moe route's `native_by` block of knobs.yaml, checked."""
    field: str
    default: tuple            # ((family, value), ...): SGLang's default, by device 0's family
    values: tuple             # ((value, ((family, backend or None), ...)), ...)
    methods: tuple            # ((value, name or ((family, name), ...)), ...): what SGLang builds
    why: tuple = ()           # ((value, text), ...): why a None backend cannot run

    def _lookup(self, rows, key, fallback=None):
        d = dict(rows)
        return d.get(key, d.get(OTHER, fallback))

    def default_for(self, device) -> str:
        return self._lookup(self.default, family(device), "auto")

    def native(self, value: str, device) -> Optional[str]:
        """The capdispatch backend SGLang's method for VALUE runs on DEVICE (None: none)."""
        return self._lookup(self._lookup(self.values, value, ()), family(device))

    def method(self, value: str, device=None) -> str:
        m = self._lookup(self.methods, value, "its method")
        return m if isinstance(m, str) else self._lookup(m, family(device), "its method")

    def reason(self, value: str) -> str:
        return self._lookup(self.why, value, "")

    def names(self, backend: str) -> bool:
        """Does some launch value's method run BACKEND on some card family?"""
        return any(b == backend for _, per in self.values for _, b in per)

    def where(self, backend: str, value: str) -> tuple:
        """The families (`other` included) on which VALUE's method runs BACKEND."""
        return tuple(f for f, b in self._lookup(self.values, value, ()) if b == backend)


@attrs.frozen
class Builds:
    """A requirement (backends.base vocabulary) of a statement of SGLang's own MoE kernel
    (knobs.yaml `needs` of a backend `native_by` names): SGLang runs that kernel only where
    the launch's value builds the method that runs BACKEND on the card's family. VALUE: the
    launch's value (None: unknown, so the kernel is not believed to run anywhere)."""
    native_by: NativeBy
    backend: str
    value: Optional[str] = None

    def evaluate(self, f):
        from capdispatch.extend import Check
        nb, fam = self.native_by, family(f.device) or "no CUDA family"
        wanted = "; ".join(f"{nb.field}={v} on {', '.join(fs)}" for v, _ in nb.values
                           if (fs := nb.where(self.backend, v)))
        need = f"{wanted} (SGLang's method that runs {self.backend})"
        if self.value is None:
            return Check(f"sglang:{nb.field}", need, f"the launch's {nb.field} unknown", False,
                         f"the launch's {nb.field} is unknown, so SGLang's {self.backend} method is not known to run")
        found = f"{nb.field}={self.value} on {fam} ({nb.method(self.value, f.device)})"
        ok = nb.native(self.value, f.device) == self.backend
        return Check(f"sglang:{nb.field}", need, found, ok,
                     "" if ok else f"{f.device.id}: SGLang builds {nb.method(self.value, f.device)} under "
                                   f"{nb.field}={self.value} on {fam}, which does not run {self.backend}")


def route_of(release):
    """The moe route (the one with `native_by`), or None."""
    return next((r for r in release.routes if getattr(r, "native_by", None) is not None), None)


def launch_value(release, specs, *, explicit_fields=(), field_values=None) -> Optional[SglangSetting]:
    """What SGLang's launch runs before SGLang resolved it (the launcher, `dispatch
    sglang plan`): the user's value, else SGLang's DeepSeek-V4 default for device 0
    (MXFP4 experts, no all-to-all backend: the case its default rule covers). A rank
    reads SGLang's resolved value instead (record_value)."""
    route = route_of(release)
    if route is None:
        return None
    nb = route.native_by
    given = (field_values or {}).get(nb.field)
    if nb.field in set(explicit_fields or ()) and given is not None and str(given) != "auto":
        return SglangSetting("field", nb.field, str(given), origin=f"set by the user (--{nb.field.replace('_', '-')})",
                             user=True)
    if not specs:
        return None
    d0 = specs[0]
    return SglangSetting("field", nb.field, nb.default_for(d0),
                         origin=f"SGLang's DeepSeek-V4 default from device 0 ({d0.id}, {d0.name})")


def route_by_method(route, res, spec, launch: Optional[SglangSetting], strict: bool = False):
    """(routed, why, warning) for moe on SPEC by the method SGLang builds there for the
    launch's value (LAUNCH), resolved as RES (a capdispatch selection
    included: where it names the kernel SGLang's method runs, that method is kept).
    Raises capdispatch.Unsatisfiable under STRICT where the user's value cannot run."""
    import capdispatch as cd
    site = ".".join(route.target.rsplit(".", 2)[-2:])
    if res.downgraded_from:     # the resolver warned (or refused under strict) already
        said = f"the explicit choice {res.downgraded_from} cannot run there (see the warning); "
    elif res.user:
        said = f"explicit choice ({res.source}); "
    else:
        said = ""
    if launch is None:
        return True, (f"{said}capdispatch {res.backend} runs at {site} (the launch's "
                      f"{route.native_by.field} is unknown)"), None
    nb = route.native_by
    setting = f"{nb.field}={launch.value} ({launch.origin})"
    method = nb.method(launch.value, spec)
    native = nb.native(launch.value, spec)
    cand = next((c for c in res.candidates if c.backend == native), None) if native else None
    if native is not None and res.backend == native and cand is not None and cand.host:
        # SGLang's own kernel by the release's statement (knobs.yaml `needs`), not capdispatch's adapter.
        from capdispatch.extend import HOST_NOT_VERIFIED
        return False, (f"{said}SGLang's own {method} kept under {setting}: it runs {cand.host}, judged by "
                       f"the knob map's statement of what it needs; {HOST_NOT_VERIFIED}"), None
    if native is not None and res.backend == native:
        return False, (f"{said}SGLang's own {method} kept under {setting}: it runs {native}'s kernel, "
                       f"and this card has what that needs"), None
    if native is not None and cand is not None and cand.ok:
        # SGLang's method could run; the decision (explicit choice, mixed_group: uniform) is another.
        return True, (f"{said}capdispatch {res.backend} ({res.source}) runs at {site} in place of SGLang's "
                      f"{method} under {setting}"), None
    cannot = (cand.why_not(exact=True) if cand is not None else nb.reason(launch.value)) or "no kernel for this card"
    what = (cand.host if cand is not None and cand.host else f"{native}'s kernel") if native else \
        "no MXFP4 kernel here"
    why = (f"{said}SGLang's {method} under {setting} cannot run on this card ({what}: {cannot}); "
           f"capdispatch {res.backend} runs at {site} instead, with its weights prepared at load")
    warning = None
    if launch.user and not res.downgraded_from:
        warning = (f"{nb.field}={launch.value} was set by the user, but SGLang's {method} cannot run on "
                   f"this card ({spec.name}; {what}: {cannot}); running capdispatch {res.backend} instead")
        if strict:
            raise cd.Unsatisfiable(f"strict: moe on {spec.id}: {warning.replace('; running', '; would run')}")
    return True, why, warning


def record_value(server_args, release, explicit_fields=()) -> Optional[SglangSetting]:
    """A rank: the launch's value as SGLang resolved it on the record, and whether
    the user set it (EXPLICIT_FIELDS: the fields of the launch command, as the
    launcher recorded them); None where the record holds no resolved value."""
    from . import compat

    route = route_of(release)
    if route is None:
        return None
    field = route.native_by.field
    try:
        value = str(compat.of(release).resolved(server_args, field))
    except Exception:       # an unresolved record: the launcher did not run SGLang's resolution
        return None
    explicit = field in set(explicit_fields or ()) and value != "auto"
    origin = f"set by the user (--{field.replace('_', '-')})" if explicit else "as SGLang resolved it"
    return SglangSetting("field", field, value, origin=origin, user=explicit)
