"""Each rank's decision report: one JSON file per rank, rewritten when the rank decides
(before its model loads) and again after the TP group agrees, plus one summary line
in the log.

Where: the directory in CAPDISPATCH_REPORT_DIR (read when the rank decides), else
``<user cache directory>/capdispatch/sglang`` (platformdirs), as
``sglang-<host>-gpu<N>.json`` (a later launch on the same GPU replaces it). A report
that cannot be written is a WARNING, never a failed launch.

Where not: a report directory that is itself a symbolic link, or under a symbolic link
owned by another user than this one or root (a rank often runs as root; such a link
would aim its writes anywhere), and a report file that is a symbolic link: each is
refused with the WARNING, nothing written. The file is written atomically (extend.write_atomic), so
a failed write (a full disk, a directory at the report's name) leaves no temporary file.

What (docs/sglang.md, "The rank report"): the device, per op the decision (backend,
what runs, kept / routed, per size bucket), the route installed and how its install
went, the canary verdicts of the decided backends on this card, the architecture facts
corrected, and after agreement the group's digests and whether every rank carried the
decision out.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional
import socket
import time

log = logging.getLogger("capdispatch.sglang")

ENV_DIR = "CAPDISPATCH_REPORT_DIR"
SCHEMA = 1


def report_dir(env=None) -> Path:
    """CAPDISPATCH_REPORT_DIR, else the user's cache directory's capdispatch/sglang."""
    env = os.environ if env is None else env
    if env.get(ENV_DIR):
        return Path(env[ENV_DIR]).expanduser()
    import platformdirs
    return Path(platformdirs.user_cache_dir("capdispatch")) / "sglang"


def report_path(gpu_id: int, env=None) -> Path:
    host = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in socket.gethostname()) or "host"
    return report_dir(env) / f"sglang-{host}-gpu{gpu_id}.json"


def _canaries(c) -> dict:
    """backend -> its canary verdict on this card ('verified', 'failed', 'not verified';
    None: not read, as for a simulated card), for the backends the choice runs; for SGLang's
    own kernel by the release's statement (Resolution.host_of), on every card, 'not verified
    by capdispatch (SGLang's own kernel (...))': capdispatch's canary is of its own adapter."""
    from capdispatch import extend
    res = c.resolution
    if res is None:
        return {}
    names = {res.backend, *(b.backend for b in res.buckets)}
    return {cand.backend: f"{extend.HOST_NOT_VERIFIED} ({cand.host})" if cand.host else cand.verification
            for cand in res.candidates if cand.backend in names}


def op_entry(c, route) -> dict:
    d = c.to_dict()
    d["route"] = None if route is None else route.target
    d["install"] = c.install
    d["canary"] = _canaries(c)
    return d


def build(state, *, proof=None, agreement=None) -> dict:
    """The report of STATE (records.RankState); PROOF: the rank's verification line;
    AGREEMENT: the group's records.Agreement, None before the group exists."""

    import capdispatch as cd
    from . import versions
    return {
        "schema": SCHEMA,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "pid": os.getpid(),
        "gpu_id": state.gpu_id,
        "device": state.spec.to_dict(),
        "emulated": state.emulated,
        "versions": {"capdispatch": cd.__version__, "sglang": versions.installed()},
        "model": state.inputs.model,
        "ops": {op: op_entry(c, state.release.route(op, state.spec)) for op, c in state.choices.items()},
        "architecture_facts": [{"name": n, "before": repr(b), "after": repr(a)} for n, b, a in state.changes],
        "verification": proof,
        "agreement": None if agreement is None else agreement.to_dict(),
    }


def unsafe_folder(folder) -> Optional[str]:
    """Why the report directory FOLDER may not be written into, or None: it is a symbolic
    link, or a folder above it is one owned by another user than this one or root."""
    from capdispatch.extend import shown
    folder = os.path.abspath(os.fspath(folder))
    if os.path.islink(folder):
        return (f"the report directory {shown(folder)} is a symbolic link (to "
                f"{shown(os.path.realpath(folder))}); give the directory itself")
    me = os.geteuid() if hasattr(os, "geteuid") else None
    above = os.path.dirname(folder)
    while True:
        try:
            st = os.lstat(above)
        except OSError:
            st = None
        if st is not None and me is not None and os.path.islink(above) and st.st_uid not in (me, 0):
            return (f"{shown(above)}, above the report directory, is a symbolic link owned by uid "
                    f"{st.st_uid} (not this user, uid {me}, or root)")
        up = os.path.dirname(above)
        if up == above:
            return None
        above = up


def write(state, *, proof=None, agreement=None):
    """Write STATE's report (build) where report_path says; returns the path, or None
    (with a WARNING) when it cannot be written."""
    from capdispatch.extend import FileError, write_atomic
    env = state.env if state.env is not None else os.environ
    why = None
    try:
        path = report_path(state.gpu_id, env)
        body = json.dumps(build(state, proof=proof, agreement=agreement), indent=2, default=str)
        why = unsafe_folder(path.parent)
        if why is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            why = unsafe_folder(path.parent)       # what is there now, made by us or not
        if why is None:
            write_atomic(path, body + "\n", links=False)
            return path
    except FileError as exc:
        why = str(exc)
    except OSError as exc:
        why = f"{type(exc).__name__}: {exc}"
    log.warning("capdispatch: the rank report for gpu_id %d could not be written (%s); set %s "
                "to a writable directory of this user's", state.gpu_id, why, ENV_DIR)
    return None


def summary_line(state, path, agreement=None) -> str:
    """One line: the rank, per op what runs and how, the digest, where the report is."""
    parts = []
    for op, c in state.choices.items():
        how = c.action if c.install is None or c.action != "reported" else "NOT routed"
        if c.buckets and len({(b.runs, b.action) for b in c.buckets}) > 1:
            what = "/".join(f"{b.label()}:{b.runs}({b.action})" for b in c.buckets)
        else:
            what = f"{c.runs or c.backend or 'sglang'}"
        parts.append(f"{op}={what} {how}")
    text = f"capdispatch: rank {state.spec.id} (gpu_id {state.gpu_id}): " + ", ".join(parts)
    if agreement is not None:
        text += (f"; group of {len(agreement.ranks)}: digest {agreement.digest[:12]}"
                 + ("" if agreement.agreed else " (NOT agreed: see the warning)"))
    return text + f"; report {path if path is not None else 'not written'}"
