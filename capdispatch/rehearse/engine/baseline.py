"""A plugin-off run kept for another rehearsal of the same launch (`--off-from FILE`).

The plugin-off server is SGLang alone: what capdispatch's plugin decides, routes or emulates
never reaches it. Rehearsals that differ only in the plugin's side (an explicit choice, an
emulated card) can therefore compare against one plugin-off run, where everything SGLang
sees is the same: its release and interpreter, the launch command (the port aside), the
checkpoint's files, the requests, the environment (capdispatch's own variables aside) and
the cards themselves. OffKey records those; a kept run is taken only where every one is equal,
else the rehearsal stops before starting anything, naming what differs."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
from typing import Optional

import attrs

from ..errors import RehearseError
from . import verdict
from .verdict import Reply, Run

PLUGIN_VARS = ("CAPDISPATCH_",)       # read by the plugin alone, which the plugin-off server does not load
# The shell's own bookkeeping: it changes between commands and reaches no kernel.
SHELL_VARS = frozenset({"PWD", "OLDPWD", "SHLVL", "_", "TERM", "COLUMNS", "LINES", "PS1", "SSH_CLIENT",
                        "SSH_CONNECTION", "SSH_TTY", "TMUX_PANE", "WINDOWID"})
FILE_LIMIT = 64 << 20


@attrs.frozen
class OffKey:
    """What the plugin-off server's answers depend on (module docstring). Environment values
    and file contents are kept as digests: the key names what differs without holding them."""
    sglang: str                # the installed release and the interpreter that runs it
    command: tuple             # the launch after `python`, the port replaced by PORT
    checkpoint: tuple          # (file, size, sha256 of config/index files or mtime_ns) per file
    requests: str              # sha256 of the prompts, steps and seed
    env: tuple                 # (name, value digest) of every variable SGLang sees
    devices: tuple             # (cuda:N, name, uuid or why unknown) per rank
    host: str


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


# What SGLang reads from a checkpoint folder: its configs and index, the weights, a custom
# model's code, a tokenizer; a lock or cache file a run leaves there changes no answer.
READ_SUFFIXES = (".json", ".safetensors", ".py", ".model", ".tiktoken", ".txt")


def _files(folder: str) -> tuple:
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(".") or not name.endswith(READ_SUFFIXES) or not os.path.isfile(path):
            continue
        st = os.stat(path)
        if name.endswith(".json") and st.st_size <= FILE_LIMIT:
            with open(path, "rb") as fh:
                mark = hashlib.sha256(fh.read()).hexdigest()[:16]
        else:   # the weights: size and modification time (hashing 18 GiB per rehearsal is not bounded)
            mark = f"mtime {st.st_mtime_ns}"
        out.append((name, st.st_size, mark))
    return tuple(out)


def _devices(gpu_ids) -> tuple:
    import capdispatch as cd
    out = []
    for g in gpu_ids:
        try:
            spec = cd.probe(f"cuda:{g}", via="nvml")
            out.append((f"cuda:{g}", spec.name, spec.uuid or "no uuid"))
        except cd.CapdispatchError as exc:     # the same answer twice still tells two runs apart
            out.append((f"cuda:{g}", "not probed", str(exc)))
    return tuple(out)


def key(command, port: int, folder: str, prompts, steps: int, seed: int, env: dict, gpu_ids,
        version: Optional[str]) -> OffKey:
    """The plugin-off launch's OffKey: COMMAND (the server's argv after `python`) on PORT."""
    shown = tuple("PORT" if a == str(port) and i and command[i - 1] == "--port" else str(a)
                  for i, a in enumerate(command))
    seen = tuple(sorted((k, _digest(v)) for k, v in env.items()
                        if not k.startswith(PLUGIN_VARS) and k not in SHELL_VARS))
    asked = _digest(json.dumps({"prompts": [list(p) for p in prompts], "steps": steps, "seed": seed}))
    return OffKey(f"sglang {version or 'not installed'} under {sys.executable}", shown, _files(folder), asked,
                  seen, _devices(gpu_ids), socket.gethostname())


def differences(kept: dict, now: OffKey) -> list:
    """What differs between the kept run's key (its JSON) and NOW, one phrase each."""
    out = []
    for field in attrs.fields(OffKey):
        was, is_ = kept.get(field.name), _plain(getattr(now, field.name))
        if was == is_:
            continue
        if field.name in ("env", "checkpoint"):     # entries named first: (name, ...) each
            a, b = ({x[0]: x for x in v or ()} for v in (was, is_))
            names = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            what = "the environment" if field.name == "env" else "the checkpoint's files"
            out.append(f"{what} ({', '.join(names[:6])}{' ...' if len(names) > 6 else ''})")
        else:
            out.append({"sglang": "SGLang or its interpreter", "command": "SGLang's launch arguments",
                        "requests": "the requests (--seed, --prompt, --steps, --requests)",
                        "devices": "the cards", "host": "the machine"}[field.name]
                       + f" ({_brief(was)} then, {_brief(is_)} now)")
    return out


def _plain(v):
    return json.loads(json.dumps(v))


def _brief(v) -> str:
    text = json.dumps(v)
    return text if len(text) <= 160 else text[:157] + "..."


def load(path: str, now: OffKey) -> Run:
    """The plugin-off Run of the rehearsal report PATH (engine-rehearsal.json), where its
    OffKey equals NOW; RehearseError (one line, naming the file) otherwise."""
    from ...safe_io import read_bytes
    where = f"--off-from {path}"
    if not os.path.isfile(path):
        raise RehearseError(f"{where}: no such file (an engine-rehearsal.json that --out wrote)")
    try:
        d = json.loads(read_bytes(path, limit=verdict.REPORT_LIMIT * 16, what="engine rehearsal report"))
    except (OSError, ValueError) as exc:
        raise RehearseError(f"{where}: cannot be read as JSON: {exc}") from None
    if not isinstance(d, dict) or d.get("schema") != verdict.SCHEMA:
        found = d.get("schema") if isinstance(d, dict) else type(d).__name__
        raise RehearseError(f"{where}: schema {found!r}, expected {verdict.SCHEMA} (an engine rehearsal's report)")
    off, kept = d.get("off"), d.get("off_key")
    if not isinstance(off, dict) or not off.get("ok"):
        why = "has no plugin-off run" if not isinstance(off, dict) else f"its plugin-off run failed ({off.get('error')})"
        raise RehearseError(f"{where}: {why}; nothing to compare against")
    if not isinstance(kept, dict):
        raise RehearseError(f"{where}: records no launch key (off_key) to check its plugin-off run against")
    diff = differences(kept, now)
    if diff:
        raise RehearseError(f"{where}: its plugin-off run was another launch: {'; '.join(diff)}; run without "
                            f"--off-from (a plugin-off run of its own)")
    try:
        replies = tuple(Reply(tuple(int(t) for t in r["tokens"]), tuple(float(x) for x in r["logprobs"]),
                              tuple(tuple((int(t), float(lp)) for t, lp in pos) for pos in r["top"]),
                              float(r["first_s"]), float(r["total_s"])) for r in off["replies"])
        return Run(False, tuple(off["command"]), True, None, None, None, off.get("ready_s"), off.get("version"),
                   off.get("memory"), tuple(tuple(x) for x in off.get("settings") or ()), replies, (),
                   off.get("log"), "", False, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise RehearseError(f"{where}: its plugin-off run cannot be read ({type(exc).__name__}: {exc})") from None
