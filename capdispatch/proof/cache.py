"""The verified-decision cache: canary verdicts per card, software and backend identity.

Layout: ``<cache dir>/verify/v1/<card digest>/<op>.<backend>.<backend digest>.json``,
one file per key, each holding its whole key, so several ranks can write at once
(each write is a temporary file moved into place with ``os.replace``) and a file that
does not belong where it lies is recognised. The cache directory is
``platformdirs.user_cache_dir("capdispatch")`` unless ``CAPDISPATCH_CACHE_DIR`` is set
(read at each call). A file that cannot be read, does not parse or names another card
is skipped with a WARNING. Simulated devices have no card: they never read it.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from ..capabilities import DeviceSpec, Inventory
from .identity import backend_key, card_key, digest
from .verdict import Verdict

log = logging.getLogger("capdispatch")

SCHEMA = 1
ENV_DIR = "CAPDISPATCH_CACHE_DIR"


def cache_dir(env=None) -> Path:
    """Where verdicts live (CAPDISPATCH_CACHE_DIR, else the user's cache directory)."""
    env = os.environ if env is None else env
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR]).expanduser()
    import platformdirs
    return Path(platformdirs.user_cache_dir("capdispatch"))


def verdict_root(env=None) -> Path:
    return cache_dir(env) / "verify" / f"v{SCHEMA}"


class CardCache:
    """The verdicts of one card with its software, read from disk once."""

    def __init__(self, spec: DeviceSpec, inventory: Inventory, env, *, driver: Optional[str] = None):
        self.spec = spec
        self.inventory = inventory
        self.env = env
        self.card = card_key(spec, inventory, env, driver=driver)
        self.dir = verdict_root(env) / digest(self.card)
        self._entries = self._read()

    def _read(self) -> dict:
        out = {}
        try:
            files = sorted(p for p in self.dir.iterdir() if p.suffix == ".json")
        except FileNotFoundError:
            return out
        except OSError as exc:
            log.warning("verification cache %s cannot be listed (%s); treating it as empty",
                        self.dir, exc.strerror or exc)
            return out
        for path in files:
            entry = _read_entry(path, self.card)
            if entry is not None:
                bkey, verdict = entry
                out[digest(bkey)] = verdict
        return out

    def get(self, backend) -> Optional[Verdict]:
        return self._entries.get(digest(backend_key(backend, self.inventory)))

    def put(self, backend, verdict: Verdict) -> Optional[Path]:
        """Record VERDICT (kept in memory either way); the file, or None with a WARNING
        when the cache directory cannot be written."""
        bkey = backend_key(backend, self.inventory)
        d = digest(bkey)
        self._entries[d] = verdict
        path = self.dir / f"{backend.op}.{backend.name}.{d}.json"
        body = {"schema": SCHEMA, "card": self.card, "backend": bkey, "verdict": verdict.to_dict()}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-", suffix=".part")
        except OSError as exc:
            log.warning("verification cache %s cannot be written (%s); the verdict of %s/%s is kept "
                        "for this process only", self.dir, exc.strerror or exc, backend.op, backend.name)
            return None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(body, fh, indent=1, sort_keys=True, default=str)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if not isinstance(exc, OSError):
                raise
            log.warning("verification cache file %s cannot be written (%s); the verdict is kept "
                        "for this process only", path, exc.strerror or exc)
            return None
        return path

    def verdicts(self) -> list:
        return list(self._entries.values())


def _read_entry(path: Path, card: dict):
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        log.warning("ignoring verification cache file %s: cannot be read as JSON (%s)", path,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    if not isinstance(body, dict) or body.get("schema") != SCHEMA:
        found = body.get("schema") if isinstance(body, dict) else type(body).__name__
        log.warning("ignoring verification cache file %s: need schema %d, found %r", path, SCHEMA, found)
        return None
    if body.get("card") != card:
        log.warning("ignoring verification cache file %s: it was written for another card or "
                    "software (%s)", path, _diff(card, body.get("card")))
        return None
    bkey = body.get("backend")
    try:
        if not isinstance(bkey, dict) or not isinstance(body.get("verdict"), dict):
            raise ValueError("backend and verdict must be mappings")
        verdict = Verdict.from_dict(body["verdict"])
    except (TypeError, ValueError) as exc:
        log.warning("ignoring verification cache file %s: malformed verdict (%s)", path, exc)
        return None
    return bkey, verdict


def _diff(want: dict, found) -> str:
    if not isinstance(found, dict):
        return f"found {type(found).__name__}"
    keys = [k for k in want if want.get(k) != found.get(k)]
    return ", ".join(f"{k}: need {want.get(k)!r}, found {found.get(k)!r}" for k in keys[:3]) or "keys differ"


def open_card(spec: DeviceSpec, *, inventory: Optional[Inventory] = None, env=None) -> Optional[CardCache]:
    """The card's cache, read once; None for a simulated device (it has no card)."""
    if spec.simulated:
        return None
    env = dict(os.environ if env is None else env)
    return CardCache(spec, inventory or Inventory(), env)


def _backend_obj(op: str, backend, registry):
    if not isinstance(backend, str):
        return backend
    if registry is None:
        from ..backends import builtin
        registry = builtin()
    return registry.backend(op, backend)


def lookup(spec: DeviceSpec, op: str, backend, *, registry=None, inventory: Optional[Inventory] = None,
           env=None) -> Optional[Verdict]:
    """The cached verdict of BACKEND (a name or a Backend) for OP on the card SPEC
    describes, or None when it has not been verified with today's software."""
    card = open_card(spec, inventory=inventory, env=env)
    if card is None:
        return None
    return card.get(_backend_obj(op, backend, registry))


def store(spec: DeviceSpec, backend, verdict: Verdict, *, registry=None,
          inventory: Optional[Inventory] = None, env=None) -> Optional[Path]:
    """Record VERDICT for BACKEND on SPEC's card; returns the file (None for simulated)."""
    card = open_card(spec, inventory=inventory, env=env)
    if card is None:
        return None
    return card.put(_backend_obj(verdict.op, backend, registry), verdict)


def clear(env=None) -> Path:
    """Remove every cached verdict; returns the directory that was cleared."""
    root = cache_dir(env) / "verify"
    shutil.rmtree(root, ignore_errors=True)
    return root
