"""Lock files: the decisions of a plan frozen per device, and what differs from them now.

A lock is YAML (written with `yaml.safe_dump`, read with the safe loader, line marks kept
for errors), schema 1:

    schema: 1
    capdispatch: 0.1.0                 # the version that wrote it
    written: '2026-12-01T19:40:00Z'
    inputs: {policy: [...], set: [...], assume_lib: [...], libs: [...]}   # what the decision was told
    devices:
      - id: cuda:0
        name: NVIDIA H200
        cc: '9.0'
        uuid: GPU-...                  # null where the probe gives none
        ops:
          indexer:
            backend: tilelang
            libraries: {tilelang: 0.1.12, torch: 2.11.0}    # the backend's, null: not installed,
                                       # 'installed (no version)': no version known
            verified: pass             # | "failed: <class ...>" | "not verified"
            buckets:                   # only where a policy gives size buckets: each bucket's
            - {upper: 64, backend: triton}     # backend, ascending; upper null: the catch-all
            - {upper: null, backend: tilelang}

`compare(plan, lock)` gives one `Drift` per difference: a backend, a library version of the
backend both choose, a card (name, compute capability, UUID), a device or op on one side
only. `check(plan, path)` loads the lock named by PATH or CAPDISPATCH_LOCK (read at each
call), logs each drift as one WARNING line and, under strict, raises LockDriftError.
"""
from __future__ import annotations

import datetime
import logging
import os
from typing import Optional

import attrs
import yaml

from ..marked_yaml import Reader, line_of, read_text
from ..version import __version__
from .errors import BadInput, Unsatisfiable

log = logging.getLogger("capdispatch")

SCHEMA = 1
ENV_LOCK = "CAPDISPATCH_LOCK"
NOT_VERIFIED = "not verified"
MAX_BYTES = 1 << 20          # a lock is a few lines per device and op

HEADER = """\
# capdispatch lock file: which backend runs each op on each device, with the versions of
# the libraries it needs and its canary state on that card, as decided when it was written.
# Written by `dispatch lock -o FILE`. Compared with today's decisions by
# `dispatch lock --check FILE`, `dispatch explain --lock FILE`, and CAPDISPATCH_LOCK=FILE
# (explain, verify, the SGLang plugin): each difference is one WARNING line; under strict
# (--strict, CAPDISPATCH_STRICT=1) a difference is an error. Edit with care: schema 1.
"""


class LockError(BadInput):
    """A lock file that cannot be read or does not follow the schema (exit 2)."""

    def __init__(self, path: str, line: Optional[int], message: str):
        from ..safe_io import shown      # a path from argv or the environment: escaped, bounded
        self.path, self.line = path, line
        where = f"{shown(path)}:{line}" if line else shown(path)
        super().__init__(f"{where}: {message}")


class LockDriftError(Unsatisfiable):
    """Today's decisions differ from the lock and strict is in force (exit 3)."""

    def __init__(self, path: str, drifts):
        self.path, self.drifts = path, tuple(drifts)
        from ..safe_io import shown
        lines = [f"strict: {len(self.drifts)} difference(s) from the lock {shown(path)}:"]
        lines += [f"  {d}" for d in self.drifts]
        super().__init__("\n".join(lines))


@attrs.frozen
class LockedOp:
    backend: str
    libraries: Optional[dict]  # dist -> version (None: not installed; UNVERSIONED), of every backend it runs;
                               # None: not recorded (a hand-written lock), not compared
    verified: str             # "pass", "failed: ...", "not verified"
    buckets: tuple = ()       # ((upper or None, backend), ...) where a policy gives size buckets
    line: Optional[int] = attrs.field(default=None, eq=False)

    def to_dict(self) -> dict:
        d = {"backend": self.backend}
        if self.libraries is not None:
            d["libraries"] = dict(self.libraries)
        d["verified"] = self.verified
        if self.buckets:
            d["buckets"] = [{"upper": u, "backend": b} for u, b in self.buckets]
        return d


@attrs.frozen
class LockedDevice:
    id: str
    name: str
    cc: Optional[str]
    uuid: Optional[str]
    ops: dict                 # op -> LockedOp
    line: Optional[int] = attrs.field(default=None, eq=False)


@attrs.frozen
class Lock:
    devices: tuple            # LockedDevice, in group order
    capdispatch: str = ""
    written: str = ""
    inputs: dict = attrs.field(factory=dict)
    path: Optional[str] = attrs.field(default=None, eq=False)

    def device(self, device_id: str) -> Optional[LockedDevice]:
        return next((d for d in self.devices if d.id == device_id), None)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "capdispatch": self.capdispatch, "written": self.written,
            "inputs": {k: list(v) for k, v in self.inputs.items()},
            "devices": [{"id": d.id, "name": d.name, "cc": d.cc, "uuid": d.uuid,
                         "ops": {op: o.to_dict() for op, o in d.ops.items()}}
                        for d in self.devices],
        }

    def dumps(self) -> str:
        return HEADER + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False,
                                       allow_unicode=True)

    def write(self, path) -> None:
        """Replace (or create) the regular file PATH without a window in which it is
        partial: written beside it, synced, renamed; a rewritten lock keeps its mode.
        Anything but a regular file (a directory, a FIFO, a device) is refused."""
        from ..safe_io import FileError, write_atomic
        try:
            write_atomic(path, self.dumps())
        except FileError as exc:
            raise BadInput(f"cannot write the lock {exc.path}: {exc.reason}") from None


@attrs.frozen
class Drift:
    kind: str                 # "backend" | "buckets" | "library" | "card" | "device" | "op"
    device: str
    op: Optional[str]
    locked: str
    now: str
    where: str                # file:line of the locked value

    def __str__(self) -> str:
        subject = f"{self.device} {self.op}" if self.op else self.device
        return (f"lock drift: {subject}: {self.kind} was {self.locked} ({self.where}), "
                f"now {self.now}")


# --------------------------------------------------------------------------- #
# Freezing a plan
# --------------------------------------------------------------------------- #
def _backend_dists(registry, op: str, backend: str) -> list:
    b = registry.backend(op, backend)
    return list(dict.fromkeys(r.dist for r in b.requires if hasattr(r, "dist")))


def _verification(spec, op: str, backend: str, plan, env) -> str:
    if spec.simulated:
        return NOT_VERIFIED
    from ..backends import builtin
    from ..proof import open_card
    card = open_card(spec, inventory=plan.inventory, env=env)
    b = (plan.registry or builtin()).backend(op, backend)
    verdict = card.get(b)
    if verdict is None:
        why = card.suspect(b)
        return f"failed: untrusted cache entry ({why[:120]})" if why else NOT_VERIFIED
    return "pass" if verdict.passed else f"failed: {verdict.describe()}"


def _versions(plan, op: str, backends) -> dict:
    from ..backends import builtin
    from ..capabilities import Inventory
    inventory = plan.inventory or Inventory()
    registry = plan.registry or builtin()
    dists = dict.fromkeys(d for b in dict.fromkeys(backends) for d in _backend_dists(registry, op, b))
    return {dist: _version(inventory.get(dist)) for dist in dists}


# A library installed without a known version (a profile's unpinned triton, `--assume-lib
# NAME`): null would read as not installed.
UNVERSIONED = "installed (no version)"


def _version(fact):
    return fact.version if fact.version is not None else (UNVERSIONED if fact.installed else None)


def _buckets(r) -> tuple:
    return tuple((b.upper, b.backend) for b in r.buckets)


def _effective(buckets, backend) -> tuple:
    """BUCKETS as they dispatch: adjacent buckets running one backend merged; buckets that
    all run BACKEND (the catch-all's) are no buckets."""
    out = []
    for upper, b in buckets:
        if out and out[-1][1] == b:
            out[-1] = (upper, b)
        else:
            out.append((upper, b))
    return () if len(out) <= 1 and all(b == backend for _, b in out) else tuple(out)


def _runs(r) -> list:
    """Every backend a resolution runs: the catch-all's and each size bucket's."""
    return [r.backend] + [b.backend for b in r.buckets]


def _bucket_text(buckets, key) -> str:
    return ", ".join(f"{key or 'size'} <= {u}: {b}" if u is not None else f"rest: {b}" for u, b in buckets)


def freeze(plan, *, inputs=None, env=None, now=None) -> Lock:
    """The lock of PLAN: per device and op the backend, its libraries' versions and its
    canary state on that card (from the verification cache; simulated: not verified)."""
    devices = []
    for spec in plan.devices:
        ops = {}
        for op, g in plan.ops.items():
            r = g.per_device[spec.id]
            ops[op] = LockedOp(r.backend, _versions(plan, op, _runs(r)),
                               _verification(spec, op, r.backend, plan, env), _buckets(r))
        devices.append(LockedDevice(spec.id, spec.name, spec.cc_str, spec.uuid, ops))
    when = now or datetime.datetime.now(datetime.timezone.utc)
    inputs = {k: list(v or ()) for k, v in (inputs or {}).items()}
    return Lock(tuple(devices), __version__, when.strftime("%Y-%m-%dT%H:%M:%SZ"), inputs)


# --------------------------------------------------------------------------- #
# Reading a lock file
# --------------------------------------------------------------------------- #
_KIND = "lock file"
_DEVICE_KEYS = dict(required=("id", "name", "ops"), optional={"cc": None, "uuid": None})
_OP_KEYS = dict(required=("backend",), optional={"libraries": None, "verified": NOT_VERIFIED, "buckets": ()})


def parse(text: str, path: str = "<lock>", registry=None) -> Lock:
    """Parse a lock document; names of ops and backends are checked against REGISTRY
    (the built-in one by default)."""
    from ..backends import builtin
    r = Reader(path, text, error=LockError, kind=_KIND)
    return _lock(r, r.root(), registry or builtin())


def _lock(r: Reader, root, registry) -> Lock:
    if root is None:
        raise LockError(r.path, None, "empty file: a lock needs `schema: 1` and `devices:`")
    top = r.fields(root, "the lock", required=("schema", "devices"),
                   optional={"capdispatch": "", "written": "", "inputs": None}, top=True)
    schema = r.integer(top["schema"], "schema")
    if schema != SCHEMA:
        raise r.err(top["schema"], f"schema {schema!r} is not supported (valid: {SCHEMA}); "
                                   f"write the lock again with this capdispatch")
    inputs = {}
    if "inputs" in top:
        given = r.fields(top["inputs"], "inputs", optional=("policy", "set", "assume_lib", "libs"))
        inputs = {key: [r.text(x, f"inputs.{key} entry") for x in r.sequence(given[key], f"inputs.{key}")]
                  for key in given}
    dnodes = r.sequence(top["devices"], "devices")
    if not dnodes:      # a lock of nothing would match every plan
        raise r.err(top["devices"], "devices is empty: a lock holds at least one device "
                                    "(write one with `dispatch lock -o FILE`)")
    devices, seen = [], {}
    for dnode in dnodes:
        device = _device(r, dnode, registry)
        if device.id in seen:
            raise r.err(device.line, f"device {device.id!r} is listed twice (first at line {seen[device.id]})")
        seen[device.id] = device.line
        devices.append(device)
    return Lock(tuple(devices), top.get("capdispatch", r.text, what="capdispatch"),
                top.get("written", r.text, what="written"), inputs, r.path)


def _device(r: Reader, node, registry) -> LockedDevice:
    d = r.fields(node, "a device", **_DEVICE_KEYS)
    did = r.text(d["id"], "device id")
    ops = {}
    for op, knode, onode in r.mapping(d["ops"], f"{did}: ops"):
        r.name(knode, did, list(registry.ops), noun="op")
        ops[op] = _op(r, onode, f"{did} {op}", [b.name for b in registry.backends(op)])
    return LockedDevice(did, r.text(d["name"], f"{did}: name"),
                        d.get("cc", r.text, what=f"{did}: cc", null=True),
                        d.get("uuid", r.text, what=f"{did}: uuid", null=True), ops, line_of(d["id"]))


def _op(r: Reader, node, what: str, names) -> LockedOp:
    o = r.fields(node, what, **_OP_KEYS)

    def backend_of(bnode, where):
        return r.name(bnode, where, names, noun="backend")
    buckets = []
    for bnode in (r.sequence(o["buckets"], f"{what}: buckets") if "buckets" in o else ()):
        b = r.fields(bnode, f"{what}: a bucket", required=("upper", "backend"))
        buckets.append((r.integer(b["upper"], f"{what}: bucket upper", null=True),
                        backend_of(b["backend"], f"{what}: bucket backend")))
    libs = None          # not recorded: not compared
    if "libraries" in o:
        libs = {dist: r.text(vnode, f"{what}: libraries.{dist}", null=True)
                for dist, _, vnode in r.mapping(o["libraries"], f"{what}: libraries")}
    return LockedOp(backend_of(o["backend"], f"{what}: backend"), libs,
                    o.get("verified", r.text, what=f"{what}: verified"), tuple(buckets), line_of(o["backend"]))


def load(path, registry=None) -> Lock:
    try:
        exists = os.path.lexists(path)
    except (TypeError, ValueError):
        exists = True     # let read_text name the problem (NUL byte, not a path)
    if not exists:
        raise LockError(os.fsdecode(path) if isinstance(path, (str, bytes)) else str(path), None,
                        "no such lock file (write one with `dispatch lock -o FILE`)")
    text = read_text(path, limit=MAX_BYTES, kind=_KIND, error=LockError)   # bounded, UTF-8, failures named
    return parse(text, os.fsdecode(os.fspath(path)), registry)


# --------------------------------------------------------------------------- #
# Comparing
# --------------------------------------------------------------------------- #
def _card(name, cc, uuid) -> str:
    return f"{name} cc {cc or '?'}" + (f" {uuid}" if uuid else "")


def compare(plan, lock: Lock, *, partial: bool = False) -> tuple:
    """Every difference between PLAN's decisions and LOCK's, in device and op order.
    PARTIAL: PLAN covers only some of the lock's devices and ops (one SGLang rank):
    what PLAN does not decide is not a difference."""
    from ..safe_io import shown
    where = shown(lock.path) if lock.path else "<lock>"
    out = []
    for spec in plan.devices:
        ld = lock.device(spec.id)
        if ld is None:
            out.append(Drift("device", spec.id, None, "not in the lock",
                             _card(spec.name, spec.cc_str, spec.uuid), where))
            continue
        at = f"{where}:{ld.line}" if ld.line else where
        uuid_differs = ld.uuid and spec.uuid and ld.uuid != spec.uuid
        if ld.name != spec.name or (ld.cc or None) != spec.cc_str or uuid_differs:
            out.append(Drift("card", spec.id, None, _card(ld.name, ld.cc, ld.uuid),
                             _card(spec.name, spec.cc_str, spec.uuid), at))
        for op, g in plan.ops.items():
            r = g.per_device[spec.id]
            lo = ld.ops.get(op)
            if lo is None:
                if not partial:
                    out.append(Drift("op", spec.id, op, "not in the lock", r.backend, at))
                continue
            oat = f"{where}:{lo.line}" if lo.line else where
            if lo.backend != r.backend:
                out.append(Drift("backend", spec.id, op, lo.backend, r.backend, oat))
                continue
            if _effective(lo.buckets, lo.backend) != _effective(_buckets(r), r.backend):
                key = r.size_key
                out.append(Drift("buckets", spec.id, op, _bucket_text(lo.buckets, key) or "no buckets",
                                 _bucket_text(_buckets(r), key) or "no buckets", oat))
                continue
            if lo.libraries is None:
                continue
            now = _versions(plan, op, _runs(r))
            for dist in dict.fromkeys(list(lo.libraries) + list(now)):
                was, is_ = lo.libraries.get(dist, "absent"), now.get(dist, "absent")
                if was != is_:
                    out.append(Drift("library", spec.id, op, f"{dist} {was or 'not installed'}",
                                     f"{dist} {is_ or 'not installed'}", oat))
        if not partial:
            for op in ld.ops:
                if op not in plan.ops:
                    out.append(Drift("op", spec.id, op, ld.ops[op].backend, "not decided", at))
    if not partial:
        now_ids = {s.id for s in plan.devices}
        for ld in lock.devices:
            if ld.id not in now_ids:
                at = f"{where}:{ld.line}" if ld.line else where
                out.append(Drift("device", ld.id, None, _card(ld.name, ld.cc, ld.uuid), "not in the group", at))
    return tuple(out)


def lock_path(path=None, env=None) -> Optional[str]:
    """PATH, else CAPDISPATCH_LOCK (read now), else None. An empty PATH is refused (it
    would silently skip the check); an empty CAPDISPATCH_LOCK means unset."""
    if path is not None:
        path = os.fspath(path)
        if not (path.strip() if isinstance(path, str) else path.strip(b" \t")):
            raise BadInput("--lock: an empty file name (give a lock file path, or leave "
                           "--lock out to use $CAPDISPATCH_LOCK)")
        return path
    env = os.environ if env is None else env
    return env.get(ENV_LOCK) or None


def strict_in(env=None) -> bool:
    from .resolver import env_flag
    env = os.environ if env is None else env
    return env_flag(env, "CAPDISPATCH_STRICT")


def check(plan, path=None, *, strict: bool = False, partial: bool = False, env=None,
          registry=None, log_drift: bool = True) -> tuple:
    """Compare PLAN with the lock at PATH (default: CAPDISPATCH_LOCK; none: nothing to do).
    Each drift is logged as one WARNING; under STRICT or CAPDISPATCH_STRICT=1 any drift
    raises LockDriftError. A malformed lock raises LockError."""
    path = lock_path(path, env)
    if path is None:
        return ()
    lock = load(path, registry or plan.registry)
    drifts = compare(plan, lock, partial=partial)
    if log_drift:
        for d in drifts:
            log.warning("%s", d)
    if drifts and (strict or strict_in(env)):
        raise LockDriftError(path, drifts)
    return drifts


def check_after_verify(specs, ops, args) -> tuple:
    """`dispatch verify --lock FILE` (or CAPDISPATCH_LOCK): decide again, with the verdicts
    just recorded, and compare with the lock; under CAPDISPATCH_STRICT=1 drift exits 3."""
    path = lock_path(getattr(args, "lock", None))
    if path is None:
        return ()
    from .explain import plan
    p = plan(specs, ops, policy=args.policy or None, selections=args.set_ or None,
             selection_origin="--set", log_warnings=False)
    return check(p, path, partial=bool(args.op or getattr(args, "device", None)))
