"""The resolver: capabilities x requirements x policies -> a decision with its trace."""
from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Optional

import attrs
from packaging.utils import canonicalize_name

from .. import policies as _policies
from ..backends import Check, Facts, Registry, builtin, failed_checks
from ..backends.base import SHAPE_FIELDS
from ..capabilities import (AssumeCudaError, DeviceSpec, Inventory, UnknownDeviceError, derive_features,
                            lib_profiles, probe)
from ..capabilities import catalog as _catalog
from ..capabilities.libraries import AssumeLibError
from ..proof import open_card
from ..safe_io import printable
from .errors import BadInput, NoBackendError, StrictFallbackError
from .inputs import FLAG_OFF, FLAG_ON, check_cache_dir, env_flag, shown, warn_unknown_variables  # noqa: F401

if TYPE_CHECKING:
    from ..models import RankShape

log = logging.getLogger("capdispatch")


@attrs.frozen
class Hosted:
    """A backend of an op that the host engine runs itself, at its own call site, with a
    kernel that is not the library capdispatch's adapter of that backend calls (e.g. SGLang
    0.5.17's decode is sglang-kernel's sgl_kernel.flash_mla, capdispatch's `flashmla` adapter
    calls sgl-flash-mla). The decision judges it by REQUIRES (the host's statement, in the
    requirement vocabulary of backends.base) instead of the adapter's, and capdispatch never
    binds it: its winner is the host's call left alone. SPLIT: the host's call can stay for
    some size buckets while capdispatch serves the others; without it the host's kernel runs
    only where it wins every size, and elsewhere the next candidate is taken."""
    host: str                # who runs it, for people: "SGLang"
    requires: tuple = attrs.field(converter=tuple)
    split: bool = True

    def label(self, checks=()) -> str:
        """"SGLang's own kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla)": each library with
        the version CHECKS found (its range where none was found)."""
        found = {c.code: c for c in checks}
        libs = []
        for r in self.requires:
            if not hasattr(r, "dist"):
                continue
            c = found.get(f"library:{r.dist}")
            version = c.found.split(",")[0].split(" (")[0] if c is not None and c.ok else ""
            name = f"{r.dist} {version}" if version[:1].isdigit() else f"{r.dist}{r.spec}"
            libs.append(f"{name} {r.module}" if r.module else name)
        return f"{self.host}'s own kernel" + (f" ({', '.join(libs)})" if libs else "")


HOST_NOT_VERIFIED = "not verified by capdispatch"


@attrs.frozen
class Candidate:
    backend: str
    ok: bool
    checks: tuple
    preferred: bool          # named by the layer that spoke (not an implicit fallback)
    # Context.hosted: the host engine runs this backend itself (its label, e.g. "SGLang's own
    # kernel (sglang-kernel 0.4.5 sgl_kernel.flash_mla)"); judged by the host's statement,
    # never bound by capdispatch. None: capdispatch's adapter.
    host: Optional[str] = None

    @property
    def verification(self) -> Optional[str]:
        """'verified', 'failed' or 'not verified' on this card ('not verified by capdispatch'
        for a host's own kernel, whose canary capdispatch does not have); None where the
        cache was not read (simulated devices, `verify: off`)."""
        for c in self.checks:
            if c.code == "canary":
                if self.host is not None:
                    return HOST_NOT_VERIFIED
                return "not verified" if c.found == "not verified" else "verified" if c.found.startswith("pass") \
                    else "failed"
        return None

    def why_not(self, *, exact: bool = False) -> str:
        """Its failed checks in the one wording (backends.base.failed_checks)."""
        return failed_checks(self.checks, exact=exact)

    def to_dict(self) -> dict:
        d = {"backend": self.backend, "ok": self.ok, "checks": [c.to_dict() for c in self.checks]}
        if self.host is not None:
            d["host"] = self.host
        if self.verification is not None:
            d["verification"] = self.verification
        return d


@attrs.frozen
class BucketResolution:
    """The decision for one size bucket: sizes in (LOWER, UPPER] of the op's leading
    dimension (LOWER None: from 1; UPPER None: the catch-all, every larger size)."""
    lower: Optional[int]
    upper: Optional[int]
    backend: str
    source: str
    fallback: bool
    downgraded_from: Optional[str]
    candidates: tuple
    wanted: str

    def label(self, key: str) -> str:
        if self.upper is not None:
            return f"<={self.upper}"
        return f">{self.lower}" if self.lower is not None else "any"

    def to_dict(self, key: str) -> dict:
        return {key: self.label(key), "upper": self.upper, "backend": self.backend,
                "source": self.source, "fallback": self.fallback,
                "downgraded_from": self.downgraded_from,
                "candidates": [c.to_dict() for c in self.candidates]}


@attrs.frozen
class Resolution:
    op: str
    device: DeviceSpec
    backend: str             # the catch-all bucket's winner (every size when no buckets)
    source: str              # which layer of which file made the choice
    fallback: bool           # the winner is not the first preference of that layer
    downgraded_from: Optional[str]   # the explicit / user choice that could not run
    candidates: tuple
    wanted: str              # first preference of the layer that spoke
    warnings: tuple = ()
    buckets: tuple = ()      # BucketResolution..., ascending, the last the catch-all; () if none
    size_key: Optional[str] = None   # what the buckets measure ("tokens", "rows")
    layer: str = "default"   # the kind of that layer: "default" | "policy" | "device" | "selection"
    user: bool = False       # that layer is the user's (a selection or a user policy file)

    def host_of(self, backend: Optional[str]) -> Optional[str]:
        """The host's label where BACKEND is a candidate the host engine runs itself
        (Context.hosted), else None: capdispatch's adapter."""
        cands = list(self.candidates) + [c for b in self.buckets for c in b.candidates]
        return next((c.host for c in cands if c.backend == backend and c.host is not None), None)

    def backend_for(self, size: int) -> str:
        """The backend that runs a problem of SIZE (the op's leading dimension)."""
        for b in self.buckets:
            if b.upper is None or size <= b.upper:
                return b.backend
        return self.backend

    def to_dict(self) -> dict:
        return {"backend": self.backend, "source": self.source, "fallback": self.fallback,
                "downgraded_from": self.downgraded_from,
                "candidates": [c.to_dict() for c in self.candidates],
                "buckets": [b.to_dict(self.size_key) for b in self.buckets]}


@attrs.frozen
class Context:
    """Everything one decision reads, gathered once: registry, policy stack, libraries, env."""
    registry: Registry
    stack: _policies.PolicyStack
    inventory: Inventory
    env: dict
    strict: bool
    cards: dict = attrs.field(factory=dict, eq=False)   # device id -> CardCache, read once
    # The rank's shapes (capdispatch.models.RankShape) the decision is for: backends' shape
    # ranges are checked against them; None: no model given, shape ranges not evaluated.
    shapes: Optional[RankShape] = None
    # False: nothing said of libraries (no libs=, no assume_libs=); the devices decided for
    # choose them (for_devices), once per decision.
    libraries_settled: bool = True
    # (op, backend) -> Hosted: candidates the host engine runs itself, judged by its
    # statement (an engine adapter's; empty for capdispatch's own decisions).
    hosted: dict = attrs.field(factory=dict)

    def for_devices(self, specs) -> "Context":
        """This context with the library inventory SPECS are planned with: unchanged when
        libraries were named, else the one rule (capabilities.lib_profiles.target_libs): the
        default profile for simulated and emulated devices, this machine's for real ones."""
        if self.libraries_settled:
            return self
        libs = lib_profiles.target_libs(list(specs))
        inventory = self.inventory if libs is None else Inventory.with_assumptions(libs=libs)
        return attrs.evolve(self, inventory=inventory, libraries_settled=True)

    @property
    def verify_mode(self) -> str:
        """CAPDISPATCH_VERIFY when set, else the policy's `verify`."""
        return self.env.get("CAPDISPATCH_VERIFY") or self.stack.setting("verify").value

    def card(self, device: DeviceSpec):
        """The device's canary verdicts, read from the cache once for this context
        (None for simulated devices, or when the policy says `verify: off`)."""
        if device.simulated or self.verify_mode == "off":
            return None
        if device.id not in self.cards:
            self.cards[device.id] = open_card(device, inventory=self.inventory, env=self.env)
        return self.cards[device.id]

    @property
    def strict_effective(self) -> bool:
        return self.strict or self.stack.setting("on_unsupported").value == "error" \
            or env_flag(self.env, "CAPDISPATCH_STRICT")


def known_device_names() -> dict:
    """Every name a policy's `match: {name: ...}` may use (lower case) -> its catalog key."""
    return dict(sorted(_catalog.known_names().items()))


def library_names(registry) -> set:
    """Every distribution some registered backend declares."""
    return {r.dist for op in registry.ops for b in registry.backends(op)
            for r in b.requires if hasattr(r, "dist")}


def library_modules(registry, hosted=None) -> dict:
    """Canonical import name (and distribution name) -> distribution, for every library
    a registered backend declares, or a host's statement of its own kernel (HOSTED, as
    `context` takes it) names: flash_mla -> sgl-flash-mla."""
    out = {}
    stated = [b.requires for op in registry.ops for b in registry.backends(op)]
    stated += [getattr(h, "requires", ()) for h in dict(hosted or {}).values()]
    for requires in stated:
        for r in requires:
            if hasattr(r, "dist"):
                out[r.dist] = r.dist
                if getattr(r, "module", None):
                    out.setdefault(canonicalize_name(r.module.split(".")[0]), r.dist)
    return out


def context(*, policy=None, selections=None, assume_libs=None, strict=False, registry=None,
            env=None, selection_origin="selections=", libs=None, settings=None,
            settings_origin="settings=", shapes=None, hosted=None) -> Context:
    """Read the environment and policies now, for the decisions about to be made.
    LIBS: a library profile naming the target's software, "local" for this machine's;
    with neither LIBS nor ASSUME_LIBS the devices decided for choose
    (capdispatch.target_libs: the default profile for simulated devices, else this machine's).

    One Context holds one policy stack and one library inventory; every decision
    made with it (`plan_in`, `resolve_in`) sees the same assumptions. SHAPES: a rank's
    shapes (`capdispatch.load_model(name).for_rank(tp, ep, ...)`) that the backends' shape
    ranges are checked against; None: they are not evaluated. HOSTED: {(op, backend): Hosted}
    for an engine that runs those backends itself with its own kernels (see Hosted)."""
    _check_shapes(shapes)
    env = dict(os.environ if env is None else env)
    for k, v in env.items():     # what os.environ could hold: text only
        if not isinstance(k, str) or not isinstance(v, str):
            raise BadInput(f"env: {printable(repr(k), 60)} = {printable(repr(v), 60)}: environment "
                           f"variables and their values are strings")
    registry = registry or builtin()
    try:
        inventory = Inventory.with_assumptions(assume_libs, libs=libs, known=library_modules(registry, hosted))
    except AssumeLibError as exc:
        raise BadInput(str(exc)) from None
    try:
        stack = _policies.build(registry, policy=policy, selections=selections, env=env,
                                known_devices=known_device_names(),
                                selection_origin=selection_origin, settings=settings,
                                settings_origin=settings_origin)
    except _policies.SelectionError as exc:
        raise BadInput(str(exc)) from None
    # Bad values are refused now, not at the first fallback or the first canary.
    env_flag(env, "CAPDISPATCH_STRICT")
    warn_unknown_variables(env)
    check_cache_dir(env)
    verify = env.get("CAPDISPATCH_VERIFY")
    if verify and verify not in _policies.VERIFY:
        raise BadInput(f"CAPDISPATCH_VERIFY={shown(verify)} is not valid{_policies.did_you_mean(verify, _policies.VERIFY)} "
                       f"(valid: {', '.join(_policies.VERIFY)}; unset: the policy's verify)")
    return Context(registry, stack, inventory, env, strict, shapes=shapes,
                   libraries_settled=libs is not None or bool(assume_libs),
                   hosted=_check_hosted(registry, hosted))


def _check_hosted(registry, hosted) -> dict:
    out = {}
    for key, h in dict(hosted or {}).items():
        op, name = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        if op not in registry.ops or name not in [b.name for b in registry.backends(op)]:
            raise BadInput(f"hosted: {printable(repr(key), 80)} is not an (op, backend) of the registry")
        if not isinstance(h, Hosted):
            raise BadInput(f"hosted[{op!r}, {name!r}]: expected a Hosted record, found {type(h).__name__}")
        out[(op, name)] = h
    return out


def _check_shapes(shapes) -> None:
    if shapes is None:
        return
    missing = [f for f in SHAPE_FIELDS if not isinstance(getattr(shapes, f, None), int)]
    if missing:
        raise BadInput(f"shapes={type(shapes).__name__} is not a rank's shapes: it lacks integer "
                       f"{', '.join(missing)} (valid: a RankShape, from "
                       f"capdispatch.load_model(name).for_rank(tp, ep))")


def policy_from_dict(data, origin: str = "policy_from_dict", *, registry=None):
    """An in-memory policy (the schema of a policy file, as Python data), checked
    against the registry; pass it as `policy=` like a path. Raises PolicyError."""
    return _policies.from_dict(data, origin, registry or builtin(), known_devices=known_device_names())


def _check_op(ctx: Context, op: str) -> None:
    if op not in ctx.registry.ops:
        raise BadInput(f"unknown op {op!r}{_policies.did_you_mean(op, ctx.registry.ops)} "
                       f"(valid: {', '.join(ctx.registry.ops)})")


def _with_fallbacks(ctx: Context, op: str, first) -> list:
    """FIRST, then the rest of the built-in policy's order (policies.default_order)."""
    names = list(first)
    names += [n for n in _policies.default_order(ctx.stack.default, ctx.registry, op) if n not in names]
    return names


def order(ctx: Context, op: str, device: DeviceSpec):
    """(preference, candidate names): the speaking layer's list, then implicit fallbacks."""
    pref = ctx.stack.preference(op, device)
    if pref is None:   # an op the built-in policy does not name (a plugin's): its backends by name
        pref = _policies.Preference(_policies.default_order(ctx.stack.default, ctx.registry, op),
                                    "registered backends, by name", "default", False)
    return pref, _with_fallbacks(ctx, op, placed(ctx, op, pref.backends, pref.unmeasured))


def placed(ctx: Context, op: str, backends, unmeasured) -> tuple:
    """BACKENDS (a calibration's measured order) with each of UNMEASURED (what it could not run)
    at its default place: before the first backend that the default order puts after it."""
    if not unmeasured:
        return tuple(backends)
    default = _policies.default_order(ctx.stack.default, ctx.registry, op)
    rank = {n: i for i, n in enumerate(default)}
    out = list(backends)
    for u in sorted(unmeasured, key=lambda n: rank.get(n, len(rank))):
        ru = rank.get(u, len(rank))
        at = next((i for i, n in enumerate(out) if rank.get(n, len(rank)) > ru and n not in unmeasured), len(out))
        out.insert(at, u)
    return tuple(out)


def _measured_elsewhere(ctx: Context, device: DeviceSpec, pref) -> tuple:
    """A warning when the calibration that speaks for DEVICE had other libraries than this
    decision's inventory (its buckets were the fastest for those)."""
    if not pref.measured_with:
        return ()
    where, libs = pref.measured_with
    diff = []
    for name, want in sorted(libs.items()):
        fact = ctx.inventory.get(name)
        have = fact.version if fact.installed and fact.version else ("installed" if fact.installed else "absent")
        if have != want:
            diff.append(f"{name} {want} there, {have} here")
    if not diff:
        return ()
    return (f"{device.id} ({device.name}): the calibration at {where} was measured with other libraries "
            f"({'; '.join(diff)}): its buckets may not pick the fastest kernels here (run `dispatch bench "
            f"--check` with it, or calibrate again)",)


def canary_check(verdict, mode: str, device: DeviceSpec, op: str, name: str,
                 suspect: Optional[str] = None) -> Check:
    """The `canary` check: what the verification cache says of this backend on this card.
    SUSPECT: why its cache file was not trusted; such a backend fails (closed) until
    `dispatch verify` runs its canary again."""
    need = "pass" if mode == "required" else "pass, or not verified (verify: warn)"
    if verdict is None and suspect:
        why = printable(suspect, 160)
        return Check("canary", need, f"untrusted cache entry: {why}", False,
                     f"{device.id}: {op}/{name}: its cached verdict cannot be trusted ({why}); "
                     f"run `dispatch verify` to verify it again")
    if verdict is None:
        ok = mode != "required"
        return Check("canary", need, "not verified", ok,
                     "" if ok else f"{device.id}: {op}/{name} has not passed its canary on this card "
                                   f"(verify: required; run `dispatch verify`)")
    if verdict.passed:
        when = f" ({verdict.at})" if verdict.at else ""
        return Check("canary", need, f"pass{when}", True)
    # The verdict is a cached one: the message says how to run the canary again or forget it.
    dev = re.sub(r"@\d+$", "", device.id.split("#")[0])
    return Check("canary", need, verdict.describe(), False,
                 f"{device.id}: {op}/{name} failed its canary on this card: {verdict.describe()} "
                 f"(a cached verdict: `dispatch verify --device {dev} --op {op} --backend {name}` runs "
                 f"its canary again; `dispatch verify --clear-cache` forgets every verdict)")


def evaluate(ctx: Context, op: str, device: DeviceSpec, names, preferred) -> list:
    feats = derive_features(device)
    cheap = Facts(device, feats, ctx.inventory, ctx.env, check_imports=False, shapes=ctx.shapes)
    card = ctx.card(device)
    out = []
    for name in names:
        backend = ctx.registry.backend(op, name)
        hosted = ctx.hosted.get((op, name))
        if hosted is not None:
            out.append(_hosted_candidate(ctx, op, device, name, hosted, cheap, card, name in preferred))
            continue
        checks = backend.evaluate(cheap)
        # Importing is the costly proof: only for a real device, only when all else holds.
        if all(c.ok for c in checks) and not device.simulated:
            checks = backend.evaluate(attrs.evolve(cheap, check_imports=True))
        if card is not None:
            checks = list(checks) + [canary_check(card.get(backend), ctx.verify_mode, device, op, name,
                                                  card.suspect(backend))]
        out.append(Candidate(name, all(c.ok for c in checks), tuple(checks), name in preferred))
    return out


def _hosted_candidate(ctx: Context, op: str, device: DeviceSpec, name: str, hosted: Hosted, cheap, card,
                      preferred: bool) -> Candidate:
    """A backend the host runs itself: its statement's checks; where the card's verdicts are read,
    a canary check saying capdispatch has none for it (ok but under `verify: required`)."""
    checks = [c for c in (r.evaluate(cheap) for r in hosted.requires) if c is not None]
    if all(c.ok for c in checks) and not device.simulated:
        checks = [c for c in (r.evaluate(attrs.evolve(cheap, check_imports=True)) for r in hosted.requires)
                  if c is not None]
    label = hosted.label(checks)
    if card is not None:
        ok = ctx.verify_mode != "required"
        checks.append(Check("canary", "pass, or not verified (verify: warn)" if ok else "pass",
                            f"{HOST_NOT_VERIFIED} ({label}: capdispatch's canary runs its own adapter)", ok,
                            "" if ok else f"{device.id}: {op}/{name} is {label}, which capdispatch cannot "
                                          f"verify (verify: required)"))
    return Candidate(name, all(c.ok for c in checks), tuple(checks), preferred, host=label)


def _decide(ctx: Context, op: str, device: DeviceSpec, wanted_list, origin: str, user: bool,
            candidates, where: str = ""):
    """(winner, source, fallback, downgraded_from, warnings) for one preference list."""
    winner = next((c for c in candidates if c.ok), None)
    if winner is None:
        raise NoBackendError(op, device.id, candidates)
    wanted = wanted_list[0]
    names = [c.backend for c in candidates]
    # A backend a calibration could not run, placed ahead of its first measured preference, that
    # runs here is taken without a fallback: the calibration never compared it.
    ahead = wanted in names and names.index(winner.backend) < names.index(wanted)
    fallback = winner.backend != wanted and not ahead
    source = origin if winner.preferred else f"implicit fallback after {origin}"
    if ahead:
        source = f"{origin} (unmeasured there, at its default place)"
    downgraded, warnings = None, ()
    if fallback and user:
        downgraded = wanted
        first = candidates[names.index(wanted)] if wanted in names else candidates[0]
        why = first.why_not()
        text = (f"{device.id} ({device.name}): {op}{where}={wanted} was asked for ({origin}) "
                f"but cannot run: {why}; running {winner.backend} instead")
        if ctx.strict_effective:
            raise StrictFallbackError(f"strict: {text.replace('; running', '; would run')}")
        warnings = (text,)
    # A kernel that failed on this card is replaced loudly, whoever preferred it.
    for c in candidates[:candidates.index(winner)]:
        if downgraded == c.backend:
            continue
        failed = [ch for ch in c.checks if ch.code == "canary" and not ch.ok]
        # Only a backend that would run but for its canary: one that cannot run on this
        # card anyway (a missing library, a feature) is no news of the canary's.
        if failed and all(ch.ok for ch in c.checks if ch.code != "canary"):
            what = ("has not passed its canary on this card (verify: required)"
                    if failed[0].found.startswith("not verified") else
                    f"failed its canary on this card ({failed[0].found})")
            warnings += (f"{device.id} ({device.name}): {op}{where}={c.backend} {what}; "
                         f"running {winner.backend} instead",)
    return winner.backend, source, fallback, downgraded, warnings


def _same_layout(op, catch_all: str, cand: Candidate) -> Candidate:
    """In a size bucket, a backend whose prepared inputs (weight layout) differ from the
    catch-all winner's cannot serve the same call site: a failed check, shown like any."""
    if not op.layouts:
        return cand
    need, found = op.layouts.get(catch_all), op.layouts.get(cand.backend)
    ok = need == found
    check = Check("layout", f"{need} (the layout of {catch_all}, the catch-all's backend)", str(found), ok,
                  "" if ok else f"{cand.backend} needs {op.name} inputs in layout {found}, the catch-all's "
                                f"{catch_all} in {need}: one call site holds one layout")
    return attrs.evolve(cand, ok=cand.ok and ok, checks=cand.checks + (check,))


def resolve_in(ctx: Context, op: str, device: DeviceSpec) -> Resolution:
    """One op on one device (each size bucket too). Logs nothing: warnings ride in the result.
    A host's own kernel that may not be split across sizes (Hosted.split False) and wins some
    sizes only is refused for every size, with a failed `host` check, and the op decided again."""
    _check_op(ctx, op)
    ctx = ctx.for_devices([device])
    pref, names = order(ctx, op, device)
    candidates = evaluate(ctx, op, device, names, pref.backends + tuple(pref.unmeasured))
    res = _resolve(ctx, op, device, pref, candidates)
    for _ in range(len(ctx.hosted)):
        split = _split_host(ctx, res)
        if split is None:
            break
        candidates = [_unsplit(c, res, split) if c.backend == split else c for c in candidates]
        res = _resolve(ctx, op, device, pref, candidates)
    return res


def _split_host(ctx: Context, res) -> Optional[str]:
    """The host-run backend that must not be split across sizes and wins some of RES's sizes
    but not all, or None."""
    if not res.buckets:
        return None
    winners = [b.backend for b in res.buckets]
    for name in dict.fromkeys(winners):
        hosted = ctx.hosted.get((res.op, name))
        if hosted is not None and not hosted.split and len(set(winners)) > 1:
            return name
    return None


def _unsplit(cand: Candidate, res, name: str) -> Candidate:
    won = [b.label(res.size_key) for b in res.buckets if b.backend == name]
    key = res.size_key or "size"
    check = Check("host", f"{cand.host} for every {key} or none (once capdispatch serves any {key}, the "
                          f"host's call is switched off for all of them)",
                  f"the decision for {key} {', '.join(won)} only", False,
                  f"{res.op}={name} is {cand.host}: it runs only where it wins every {key} (capdispatch "
                  f"cannot run it for the others)")
    return attrs.evolve(cand, ok=False, checks=cand.checks + (check,))


def _resolve(ctx: Context, op: str, device: DeviceSpec, pref, candidates) -> Resolution:
    backend, source, fallback, downgraded, warnings = _decide(
        ctx, op, device, pref.backends, pref.origin, pref.user, candidates)
    warnings = _measured_elsewhere(ctx, device, pref) + tuple(warnings)
    size = ctx.registry.ops[op].size
    key = size.key if size is not None else None
    buckets, lower = [], None
    if pref.buckets:
        by_name = {c.backend: c for c in candidates}    # every check evaluated once
        for bp in pref.buckets:
            if bp.upper is None:      # the catch-all: the decision above
                buckets.append(BucketResolution(lower, None, backend, source, fallback, downgraded,
                                                tuple(candidates), pref.backends[0]))
                break
            bcands = tuple(_same_layout(ctx.registry.ops[op], backend,
                                        attrs.evolve(by_name[n], preferred=n in bp.backends or n in bp.unmeasured))
                           for n in _with_fallbacks(ctx, op, placed(ctx, op, bp.backends, bp.unmeasured)))
            b_backend, b_source, b_fallback, b_down, b_warn = _decide(
                ctx, op, device, bp.backends, bp.origin, pref.user, bcands,
                where=f"[{key} <= {bp.upper}]")
            buckets.append(BucketResolution(lower, bp.upper, b_backend, b_source, b_fallback,
                                            b_down, bcands, bp.backends[0]))
            warnings += b_warn
            lower = bp.upper
    return Resolution(op, device, backend, source, fallback, downgraded,
                      tuple(candidates), pref.backends[0], warnings, tuple(buckets), key,
                      layer=pref.kind, user=pref.user)

def as_spec(device, *, via="auto", assume_cuda=None) -> DeviceSpec:
    if via not in ("auto", "torch", "nvml"):
        raise BadInput(f"probe {via!r} is not valid (valid: auto, torch, nvml)")
    try:
        return probe(device, via=via, assume_cuda=assume_cuda)
    except (UnknownDeviceError, AssumeCudaError) as exc:
        raise BadInput(str(exc)) from None


def resolve(op: str, device, *, policy=None, selections=None, assume_libs=None,
            strict: bool = False, registry=None, env=None, via: str = "auto",
            assume_cuda: Optional[str] = None, libs=None, shapes=None) -> Resolution:
    """Decide which backend runs OP on DEVICE, with the whole trace (SHAPES: a rank's
    RankShape, checked against the backends' shape ranges)."""
    ctx = context(policy=policy, selections=selections, assume_libs=assume_libs,
                  strict=strict, registry=registry, env=env, libs=libs, shapes=shapes)
    res = resolve_in(ctx, op, as_spec(device, via=via, assume_cuda=assume_cuda))
    for w in res.warnings:
        log.warning(w)
    return res
