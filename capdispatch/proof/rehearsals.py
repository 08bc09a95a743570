"""The rehearsal cache: the verdicts of `dispatch rehearse`, per group of cards, software and
decisions, for a serving launch to find (and, when asked to, require).

Keyed as the canary cache keys a verdict: the cards and their software (`identity.card_key`
of every rank's card, in rank order: name, compute capability, UUID, driver, CUDA, torch,
Triton, capdispatch), and each rank's decided kernels as `identity.backend_key` gives them
(op, name, implementation, declared requirements, the versions of the libraries they
declare) with their size buckets, which is what the policy decided. A rank that ran an
emulated card is keyed as that card *on* its device, so such a rehearsal never answers for
a launch on real cards.

Layout: ``<cache dir>/rehearse/v1/<group digest>/<decisions digest>.json``, each file holding
its key and verdict and a keyed digest (HMAC-SHA256) of them under the verification cache's
secret; files are written and trusted as the verification cache's are (private, regular,
this user's; the digest checks out). A file that fails any check is skipped with a WARNING.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
from pathlib import Path
from typing import Optional

import attrs

from ..capabilities import Inventory
from ..errors import CapdispatchError
from ..safe_io import FileError, read_private, write_atomic
from .cache import CacheError, _folder_problem, _private_dirs, _reason, _secret, cache_dir
from .identity import digest

log = logging.getLogger("capdispatch")

SCHEMA = 1
MAX_BYTES = 256 * 1024

__all__ = ["RehearsalVerdict", "RehearsalRequiredError", "rank_card", "decisions_of", "store", "lookup",
           "rehearsal_verdict", "root"]


@attrs.frozen
class RehearsalVerdict:
    """One rehearsal's outcome, as a launch reads it."""
    ok: bool
    cause: Optional[str]              # the first failure, None when it passed
    devices: tuple = attrs.field(converter=tuple)     # the rehearsal's --device list, per rank
    model: str = ""
    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    max_rel_err: Optional[float] = None
    at: str = ""                      # when it ran (UTC, ISO 8601)

    def to_dict(self) -> dict:
        d = attrs.asdict(self)
        d["devices"] = list(self.devices)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "RehearsalVerdict":
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def root(env=None) -> Path:
    return cache_dir(env) / "rehearse" / f"v{SCHEMA}"


class RehearsalRequiredError(CapdispatchError, RuntimeError):
    """A launch that requires a passed rehearsal found none, or a failed one."""


def rank_card(run_spec, inventory=None, env=None, *, emulated_spec=None) -> dict:
    """One rank's part of the group key: its card (identity.card_key, the UUID written one
    way whether torch or NVML read it), or the emulated card on it."""
    from .identity import card_key
    env = dict(os.environ if env is None else env)
    own = card_key(run_spec, inventory or Inventory(), env)
    if own.get("uuid"):
        u = str(own["uuid"]).lower()
        own["uuid"] = u[4:] if u.startswith("gpu-") else u
    if emulated_spec is None:
        return own
    return {"emulated": emulated_spec.catalog_key or emulated_spec.id, "on": own}


def rehearsal_verdict(plan, ops=None, *, env=None) -> Optional[RehearsalVerdict]:
    """The recorded rehearsal verdict for PLAN's group (its devices' cards and software, in
    rank order) with PLAN's decisions for OPS (default: every op of the plan), or None: none
    recorded, or a simulated device (no card)."""
    if any(s.simulated for s in plan.devices):
        return None
    inv = Inventory()
    cards = [rank_card(s, inv, env) for s in plan.devices]
    return lookup(cards, decisions_of(plan, ops, inventory=inv), env)


def decisions_of(plan, ops=None, *, registry=None, inventory=None) -> dict:
    """op -> per rank (in the plan's device order) [backend key, size buckets] of PLAN's
    decisions (the ops OPS, default every op of the plan)."""
    from .identity import backend_key
    if registry is None:
        from ..backends import builtin
        registry = builtin()
    inventory = inventory or Inventory()
    out = {}
    for op, g in plan.ops.items():
        if ops is not None and op not in ops:
            continue
        row = []
        for r in g.per_device.values():
            key = backend_key(registry.backend(op, r.backend), inventory)
            # The host engine's own kernel (resolver.Hosted): no rehearsal of capdispatch's is of it.
            host = r.host_of(r.backend)
            if host is not None:
                key = f"{op}/{r.backend} run by the host: {host}"
            row.append([key, [[b.upper, b.backend] + ([f"run by the host: {r.host_of(b.backend)}"]
                                                      if r.host_of(b.backend) else []) for b in r.buckets]])
        out[op] = row
    return out


def _mac(secret: bytes, body: dict) -> str:
    text = json.dumps({k: body.get(k) for k in ("schema", "group", "decisions", "verdict")},
                      sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def store(cards: list, decisions: dict, verdict: RehearsalVerdict, env=None) -> Optional[Path]:
    """Record VERDICT for the group CARDS (rank_card per rank) with DECISIONS (decisions_of);
    the file, or None with a WARNING when the cache cannot be written."""
    env = dict(os.environ if env is None else env)
    group = {"cards": list(cards)}
    folder = root(env) / digest(group)
    path = folder / f"{digest(decisions)}.json"
    body = json.loads(json.dumps({"schema": SCHEMA, "group": group, "decisions": decisions,
                                  "verdict": verdict.to_dict()}, default=str))
    try:
        _private_dirs(cache_dir(env), folder)
        body["mac"] = _mac(_secret(env, create=True), body)
        write_atomic(path, json.dumps(body, indent=1, sort_keys=True), private=True)
    except (OSError, CacheError, FileError) as exc:
        log.warning("rehearsal cache %s cannot be written (%s); the verdict is not recorded", folder, _reason(exc))
        return None
    return path


def lookup(cards: list, decisions: dict, env=None) -> Optional[RehearsalVerdict]:
    """The newest trusted verdict for the group CARDS whose decisions include DECISIONS (the
    same kernels, identities and buckets on every rank for each op DECISIONS names), or None."""
    env = dict(os.environ if env is None else env)
    group = {"cards": list(cards)}
    folder = root(env) / digest(group)
    base = cache_dir(env)
    for f in (base / "rehearse", root(env), folder):
        why = _folder_problem(f)
        if why:
            log.warning("rehearsal cache %s is not trusted: %s; no rehearsal verdict is read", f, why)
            return None
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix == ".json")
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("rehearsal cache %s cannot be listed (%s)", folder, _reason(exc))
        return None
    if not files:
        return None
    try:
        secret = _secret(env, create=False)
    except CacheError as exc:
        log.warning("rehearsal cache: %s", exc)
        return None
    best = None
    want = json.loads(json.dumps(decisions, default=str))
    for p in files:
        try:
            body = _read(p, group, secret)
        except ValueError as exc:
            log.warning("ignoring rehearsal cache file %s: %s", p, exc)
            continue
        got = body["decisions"]
        if all(got.get(op) == row for op, row in want.items()):
            v = RehearsalVerdict.from_dict(body["verdict"])
            if best is None or v.at > best.at:
                best = v
    return best


def _read(path: Path, group: dict, secret: Optional[bytes]) -> dict:
    try:
        body = json.loads(read_private(path, limit=MAX_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"cannot be read ({_reason(exc)})") from None
    except ValueError as exc:
        raise ValueError(_reason(exc)) from None
    if not isinstance(body, dict) or body.get("schema") != SCHEMA:
        raise ValueError(f"need schema {SCHEMA}")
    if body.get("group") != group:
        raise ValueError("it was written for another group of cards or software")
    if not isinstance(body.get("decisions"), dict) or not isinstance(body.get("verdict"), dict):
        raise ValueError("malformed (decisions and verdict must be mappings)")
    if path.name != f"{digest(body['decisions'])}.json":
        raise ValueError("its name is not its decisions' digest (a copy or a forgery)")
    if secret is None or not isinstance(body.get("mac"), str) or \
            not hmac.compare_digest(body["mac"], _mac(secret, body)):
        raise ValueError("its keyed digest does not match (not written by this cache, or changed since)")
    return body


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
