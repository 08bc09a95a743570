"""The verified-decision cache: canary verdicts per card, software and backend identity.

Layout: ``<cache dir>/verify/v2/<card digest>/<op>.<backend>.<backend digest>.json``,
one file per key, each holding its whole key and a keyed digest (HMAC-SHA256) of it and
its verdict, under a secret kept in ``<cache dir>/verify/key`` (32 random bytes, mode
0600, made on the first write). Several ranks can write at once: each write is a
temporary file moved into place with ``os.replace``. The cache directory is
``platformdirs.user_cache_dir("capdispatch")`` unless ``CAPDISPATCH_CACHE_DIR`` is set
(read at each call). Simulated devices have no card: they never read it.

A verdict is trusted only when all of this holds: its file is a regular file (not a link,
FIFO or device) of at most 64 KiB, owned by this user and writable by nobody else, in
folders owned by this user and writable by nobody else; it parses; its card is this
card; its name is the one its key gives; its digest checks out under the secret. A file
that fails any of it is skipped with a WARNING and its backend is *suspect*: decisions
reject it (fail closed) until `dispatch verify` runs its canary again and replaces it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import stat
import sys
from pathlib import Path
from typing import Optional

from ..capabilities import DeviceSpec, Inventory
from ..errors import CapdispatchError
from ..safe_io import FileError, read_private, unsafe_owner_or_mode, write_atomic
from .identity import backend_key, card_key, digest
from .verdict import Verdict

log = logging.getLogger("capdispatch")

SCHEMA = 2
ENV_DIR = "CAPDISPATCH_CACHE_DIR"
MAX_ENTRY_BYTES = 64 * 1024
KEY_NAME = "key"


class CacheError(CapdispatchError, RuntimeError):
    """The verification cache cannot do what was asked (clear it, trust its secret)."""


def cache_dir(env=None) -> Path:
    """Where verdicts live (CAPDISPATCH_CACHE_DIR, else the user's cache directory)."""
    env = os.environ if env is None else env
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR]).expanduser()
    import platformdirs
    return Path(platformdirs.user_cache_dir("capdispatch"))


def verdict_root(env=None) -> Path:
    return cache_dir(env) / "verify" / f"v{SCHEMA}"


# --------------------------------------------------------------------------- #
# Trust: ownership, permissions, the secret
# --------------------------------------------------------------------------- #
def _folder_problem(path: Path) -> Optional[str]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    return unsafe_owner_or_mode(st, "the folder")


def _secret(env, *, create: bool) -> Optional[bytes]:
    """The cache's secret: None when there is none yet (and not CREATE); CacheError when
    the file cannot be trusted or made."""
    path = cache_dir(env) / "verify" / KEY_NAME
    try:
        data = read_private(path, limit=1024, secret=True)
    except FileNotFoundError:
        if not create:
            return None
    except (OSError, ValueError) as exc:
        raise CacheError(f"verification cache secret {path}: {_reason(exc)}; remove it "
                         f"(`dispatch verify --clear-cache`) to start a new cache") from None
    else:
        if len(data) < 32:
            raise CacheError(f"verification cache secret {path}: too short ({len(data)} bytes); "
                             f"remove it (`dispatch verify --clear-cache`) to start a new cache")
        return data
    _private_dirs(cache_dir(env), path.parent)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:          # another process made it first: use theirs
        return _secret(env, create=False)
    try:
        os.write(fd, secrets.token_hex(32).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return _secret(env, create=False)


def _trusted_secret(env) -> bytes:
    """The secret to sign a new verdict with; one that cannot be trusted (a link, another
    user's, open to others, truncated) is replaced with a WARNING, so a verdict is always
    recorded. Verdicts signed with the old secret then fail their digest check: suspect
    until verified again, never trusted."""
    try:
        return _secret(env, create=True)
    except CacheError as exc:
        path = cache_dir(env) / "verify" / KEY_NAME
        log.warning("%s; replacing it with a new secret (verdicts signed with the old one count as "
                    "failed until verified again)", exc)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return _secret(env, create=True)


def _private_dirs(top: Path, leaf: Path) -> None:
    """Make LEAF and the folders between TOP and it, each 0700 whatever the umask; one of
    this user's that others may write (an older capdispatch, a umask of 002) is closed."""
    top.mkdir(parents=True, exist_ok=True)
    for folder in reversed([leaf, *leaf.parents]):
        if folder == top or top not in folder.parents:
            continue
        try:
            folder.mkdir(mode=0o700)
            os.chmod(folder, 0o700)
        except FileExistsError:
            st = os.lstat(folder)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
                os.chmod(folder, 0o700)


def _mac(secret: bytes, body: dict) -> str:
    text = json.dumps({k: body.get(k) for k in ("schema", "card", "backend", "verdict")},
                      sort_keys=True, separators=(",", ":"), default=str)
    return hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def file_name(bkey: dict) -> str:
    return f"{bkey['op']}.{bkey['name']}.{digest(bkey)}.json"


# --------------------------------------------------------------------------- #
# One card's verdicts
# --------------------------------------------------------------------------- #
class CardCache:
    """The verdicts of one card with its software, read from disk once."""

    def __init__(self, spec: DeviceSpec, inventory: Inventory, env, *, driver: Optional[str] = None):
        self.spec = spec
        self.inventory = inventory
        self.env = env
        self.card = card_key(spec, inventory, env, driver=driver)
        self.dir = verdict_root(env) / digest(self.card)
        self._suspect = {}           # backend digest -> why its file is not trusted
        self._entries = self._read()

    def _warn_all(self, why: str) -> dict:
        """Nothing here is trusted: every backend with a file here is suspect (rejected, as a
        failed verdict is, until `dispatch verify` runs its canary again), so a kernel known
        to fail is never chosen again because the cache cannot be read."""
        try:
            names = [p.name for p in self.dir.iterdir() if p.suffix == ".json"]
        except OSError:
            names = []
        for name in names:
            d = _digest_of_name(name)
            if d:
                self._suspect[d] = why
        log.warning("verification cache %s is not trusted: %s; every backend with a verdict here counts "
                    "as failed on this card until `dispatch verify` runs its canary again "
                    "(`dispatch verify --clear-cache` starts a new cache; each user needs a cache of "
                    "their own)", self.dir, why)
        return {}

    def _read(self) -> dict:
        out = {}
        root = cache_dir(self.env) / "verify"
        for folder in (root, root / f"v{SCHEMA}", self.dir):
            why = _folder_problem(folder)
            if why:
                return self._warn_all(f"{folder}: {why}")
        try:
            files = sorted(p for p in self.dir.iterdir() if p.suffix == ".json")
        except FileNotFoundError:
            return out
        except OSError as exc:
            log.warning("verification cache %s cannot be listed (%s); treating it as empty",
                        self.dir, exc.strerror or exc)
            return out
        if not files:
            return out
        try:
            secret = _secret(self.env, create=False)
        except CacheError as exc:
            return self._warn_all(str(exc))
        for path in files:
            d = _digest_of_name(path.name)
            try:
                bkey, verdict = _read_entry(path, self.card, secret)
            except ValueError as exc:
                log.warning("ignoring verification cache file %s: %s; its backend counts as failed "
                            "until `dispatch verify` runs its canary again", path, exc)
                if d:
                    self._suspect[d] = str(exc)
                continue
            out[digest(bkey)] = verdict
        return out

    def get(self, backend) -> Optional[Verdict]:
        """The trusted verdict of BACKEND on this card, or None."""
        return self._entries.get(digest(backend_key(backend, self.inventory)))

    def suspect(self, backend) -> Optional[str]:
        """Why BACKEND's cache file was not trusted, or None (no such file, or trusted)."""
        return self._suspect.get(digest(backend_key(backend, self.inventory)))

    def put(self, backend, verdict: Verdict) -> Optional[Path]:
        """Record VERDICT (kept in memory either way); the file, or None with a WARNING
        when the cache directory cannot be written."""
        bkey = backend_key(backend, self.inventory)
        d = digest(bkey)
        self._entries[d] = verdict
        self._suspect.pop(d, None)
        path = self.dir / file_name(bkey)
        body = {"schema": SCHEMA, "card": self.card, "backend": bkey, "verdict": verdict.to_dict()}
        try:
            _private_dirs(cache_dir(self.env), self.dir)
            secret = _trusted_secret(self.env)
            body["mac"] = _mac(secret, json.loads(json.dumps(body, default=str)))
            # 0600, a link at the name replaced rather than followed
            write_atomic(path, json.dumps(body, indent=1, sort_keys=True, default=str), private=True)
        except (OSError, CacheError, FileError) as exc:
            log.warning("verification cache %s cannot be written (%s); the verdict of %s/%s is kept "
                        "for this process only", self.dir, _reason(exc), backend.op, backend.name)
            return None
        return path

    def verdicts(self) -> list:
        return list(self._entries.values())


def _digest_of_name(name: str) -> Optional[str]:
    parts = name.rsplit(".", 2)
    return parts[1] if len(parts) == 3 and len(parts[1]) == 20 else None


def _read_entry(path: Path, card: dict, secret: Optional[bytes]):
    """(backend key, Verdict) of a trusted file; ValueError saying why it is not."""
    try:
        body = json.loads(read_private(path, limit=MAX_ENTRY_BYTES).decode("utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot be read ({_reason(exc)})") from None
    except RecursionError:
        raise ValueError("nested too deeply to be a verdict") from None
    except ValueError as exc:
        raise ValueError(f"{_reason(exc)}") from None
    if not isinstance(body, dict) or body.get("schema") != SCHEMA:
        found = body.get("schema") if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"need schema {SCHEMA}, found {found!r}"[:200])
    if body.get("card") != card:
        raise ValueError(f"it was written for another card or software ({_diff(card, body.get('card'))})")
    bkey = body.get("backend")
    if not isinstance(bkey, dict) or not isinstance(body.get("verdict"), dict):
        raise ValueError("malformed verdict (backend and verdict must be mappings)")
    if not isinstance(bkey.get("op"), str) or not isinstance(bkey.get("name"), str):
        raise ValueError("malformed verdict (the backend key has no op and name)")
    if path.name != file_name(bkey):
        raise ValueError(f"its key belongs in {file_name(bkey)} (a copy or a forgery)")
    if secret is None or not isinstance(body.get("mac"), str) or \
            not hmac.compare_digest(body["mac"], _mac(secret, body)):
        raise ValueError("its keyed digest does not match (not written by this cache, or changed since)")
    try:
        verdict = Verdict.from_dict(body["verdict"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed verdict ({_reason(exc)})") from None
    if (verdict.op, verdict.backend) != (bkey["op"], bkey["name"]):
        raise ValueError(f"the verdict is for {verdict.op}/{verdict.backend}, the key for "
                         f"{bkey['op']}/{bkey['name']}")
    return bkey, verdict


def _diff(want: dict, found) -> str:
    if not isinstance(found, dict):
        return f"found {type(found).__name__}"
    from ..backends.base import need_found
    keys = [k for k in want if want.get(k) != found.get(k)]
    return (", ".join(need_found(k, repr(want.get(k)), repr(found.get(k))) for k in keys[:3])
            or "keys differ")[:300]


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
    """The cached, trusted verdict of BACKEND (a name or a Backend) for OP on the card
    SPEC describes, or None when it has not been verified with today's software."""
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


def clear(env=None) -> tuple:
    """Remove every cached verdict and the secret: (the directory, whether it existed).
    CacheError when anything in it could not be removed."""
    root = cache_dir(env) / "verify"
    failed = []

    def note(func, path, exc_info):
        failed.append(f"{path}: {_reason(exc_info[1])}")
    existed = os.path.lexists(root)
    if existed:
        if os.path.islink(root) or not os.path.isdir(root):
            raise CacheError(f"cannot clear the verification cache: {root} is not a folder")
        if sys.version_info >= (3, 12):
            shutil.rmtree(root, onexc=lambda f, p, e: note(f, p, (type(e), e, None)))
        else:
            shutil.rmtree(root, onerror=note)
    if failed or os.path.lexists(root):
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise CacheError(f"could not clear the verification cache {root}: "
                         f"{failed[0] if failed else 'it is still there'}{more}")
    return root, existed
