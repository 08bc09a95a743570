"""The parent of a rehearsal: start one process per rank, bound their time, gather their
reports, and compare the group's logits with a single-process reference of the same model.

Bounded time: every collective of a rank times out (the group's timeout, and each
all-reduce's wait), and the parent kills every rank's process group when the whole
rehearsal passes its timeout; a rank that did not finish is named with the op it was in.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional
import shutil

import attrs

from ..processes import kill_group, terminate_as_interrupt
from .errors import RehearseError

# Upper bounds of the small model's sizes (inclusive), checked before any rank starts.
# At the largest a rank's small model holds a few GiB (16 layers of 2048 hidden x the model's
# heads x 512, 256 MXFP4 experts of 2048 x 2048).
BOUNDS = {"layers": (1, 16), "hidden": (64, 2048), "vocab": (2, 65536), "experts": (1, 256),
          "intermediate": (64, 2048), "prompt": (1, 4096), "steps": (1, 256)}
MAX_TIMEOUT_S = 86400.0
FOLDER_PREFIX = "capdispatch-rehearse-"
OWNER_FILE = "owner.pid"

SCHEMA = "capdispatch.rehearse/1"
# The group's logits against the reference's, per step: relative Frobenius error. The ops'
# own bounds are 1e-2 (attention) and 1.5e-2 (MoE) per call; layers and bf16 residuals add up.
LOGITS_REL_TOL = 3e-2


@attrs.frozen
class OpRun:
    op: str
    decided: str                  # the rank's decision (its card's)
    ran: Optional[str]            # the kernel that ran where the rank runs
    substituted: Optional[str]    # why ran differs from decided, or None
    calls: int = 0
    time_s: float = 0.0
    ok: Optional[bool] = None     # every call matched the reference op on the same inputs
    detail: Optional[str] = None
    not_emulated: Optional[str] = None   # on an emulated card: what of its limits this kernel does not take
    graphed: int = 0              # calls replayed from a CUDA graph (the rest ran eagerly)
    captures: int = 0             # graphs captured (one per layer and call shape)


@attrs.frozen
class RankRun:
    rank: int
    device: str
    decide: str
    run: str
    ok: bool
    error: Optional[str]          # what failed, with the op it was in
    ops: tuple                    # OpRun...
    max_rel_err: Optional[float] = None   # its logits against the reference, worst step
    failed_op: Optional[str] = None       # the op the rank was in when it failed, if in one
    phases_s: dict = attrs.field(factory=dict)   # seconds: start (imports), join, decide (+ agree), run (build, forward, checks)
    facts: dict = attrs.field(factory=dict)      # the DeviceFacts the rank's kernels launched by (+ memory_cap, note)
    graphs: Optional[str] = None  # where the rank replays CUDA graphs, or why it does not
    died: bool = False            # the process ended without its report (killed, crashed)


@attrs.frozen
class Rehearsal:
    model: str
    tp: int
    ep: int
    backend: str                  # the collectives' backend: gloo or nccl
    dims: dict
    steps: int
    ranks: tuple                  # RankRun...
    ok: bool
    tolerance: float
    reference: Optional[str]      # why no comparison was made, or None
    wall_s: float
    cause: Optional[str] = None   # the first failure, not a consequence of another rank's
    dp_attention: bool = False    # SGLang's DP-attention layout
    recorded: Optional[str] = None   # the rehearsal cache file of this verdict (proof/rehearsals.py), or None
    # Decided ops the model does not call (models/calls.yaml): op -> why, not rehearsed.
    not_called: dict = attrs.field(factory=dict)

    def to_dict(self) -> dict:
        d = attrs.asdict(self)
        d["schema"] = SCHEMA
        return d


def _port() -> int:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as exc:
        raise RehearseError(f"no free TCP port on 127.0.0.1 for the ranks' rendezvous ({exc.strerror or exc})") \
            from None


def plan_shape(model: str, tp: int, ep: int, dp_attention: bool = False):
    import capdispatch as cd
    return cd.load_model(model).for_rank(tp, ep, dp_attention)


def rehearse(devices, model: str, *, tp: Optional[int] = None, ep: int = 1, layers: int = 2,
             hidden: int = 256, vocab: int = 512, experts: int = 8, intermediate: int = 64,
             prompt: int = 8, steps: int = 3, seed: int = 0, timeout: float = 60.0,
             libs: Optional[str] = None, start_timeout: float = 120.0, graphs: bool = True,
             dp_attention: bool = False, record: bool = True, on_progress=None) -> Rehearsal:
    """Rehearse DEVICES (RankDevice..., one per rank) as one TP group on MODEL.

    TIMEOUT: seconds a rank may go without progress (and each all-reduce may wait);
    START_TIMEOUT: seconds a rank may take to start (imports, device); GRAPHS: replay decode
    steps' calls from CUDA graphs on CUDA ranks (graphs.py); DP_ATTENTION: SGLang's
    --enable-dp-attention layout (each rank its own sequence, the whole attention; the MoE
    over every rank's rows); RECORD: store the verdict in the rehearsal cache, where a serving
    launch on the same cards, software and decisions finds it (never for a run with a planted
    fault); ON_PROGRESS: called with every rank's progress text while they run, None at the
    end. STEPS is at least 1: decode_mla and the indexer run only in decode steps, and a rank
    passes only when every op it decided was called and matched its reference."""
    from . import checks
    from . import model as M
    from .rank import FAULT_ENV, parse_fault, unverified
    fault = parse_fault(os.environ.get(FAULT_ENV, ""))   # a bad value is bad input, before any start
    if fault and fault[0] >= len(devices):
        raise RehearseError(f"{FAULT_ENV}: rank {fault[0]} does not exist (the group has ranks "
                            f"0-{len(devices) - 1})")
    tp = len(devices) if tp is None else tp
    if tp != len(devices):
        raise RehearseError(f"--tp {tp} needs {tp} devices, one per rank; --device gave {len(devices)}")
    for flag, v, (lo, hi) in (("--layers", layers, BOUNDS["layers"]), ("--hidden", hidden, BOUNDS["hidden"]),
                              ("--vocab", vocab, BOUNDS["vocab"]), ("--experts", experts, BOUNDS["experts"]),
                              ("--intermediate", intermediate, BOUNDS["intermediate"]),
                              ("--prompt", prompt, BOUNDS["prompt"]), ("--steps", steps, BOUNDS["steps"])):
        if v < lo:
            raise RehearseError(f"{flag} {v}: must be at least {lo}")
        if v > hi:
            raise RehearseError(f"{flag} {v}: at most {hi} (the small model stays small: a rank's weights "
                                f"and caches fit a few GiB)")
    if hidden % 64 or intermediate % 64:
        raise RehearseError(f"--hidden {hidden} / --intermediate {intermediate}: must be multiples of 64 "
                            f"(MXFP4 blocks of 32, packed two per byte)")
    for flag, v in (("--timeout", timeout), ("--start-timeout", start_timeout)):
        if not (v > 0 and v <= MAX_TIMEOUT_S):
            raise RehearseError(f"{flag} {v}: must be a number of seconds above 0 and at most "
                                f"{MAX_TIMEOUT_S:g} (one day)")
    check_before_start(devices, libs)
    shape = plan_shape(model, tp, ep, dp_attention)   # a layout the model cannot take is refused here
    d = M.dims_of(shape, layers=layers, hidden=hidden, vocab=vocab, experts=experts,
                  intermediate=intermediate)
    runs = [dv.run for dv in devices]
    backend = "nccl" if all(r.startswith("cuda") for r in runs) and len(set(runs)) == len(runs) else "gloo"
    t0 = time.monotonic()
    _clean_stale_folders()
    with terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix=FOLDER_PREFIX) as folder:
        with open(os.path.join(folder, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        cfg = dict(devices=[dv.text for dv in devices], model=model, tp=tp, ep=ep, layers=layers,
                   hidden=hidden, vocab=vocab, experts=experts, intermediate=intermediate,
                   prompt=prompt, steps=steps, seed=seed, libs=libs, backend=backend, port=_port(),
                   folder=folder, collective_timeout=timeout, start_timeout=start_timeout, graphs=graphs,
                   dp_attention=dp_attention, parent=os.getpid())
        cfg_path = os.path.join(folder, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        results, logits = _spawn(cfg_path, folder, len(devices), timeout, start_timeout, on_progress)
    ref_logits, why = None, None
    if any(lg is not None for lg in logits):
        ref_logits = reference_logits(d, tp, seed, prompt, steps)     # per sequence, per step
    else:
        why = "no rank finished: nothing to compare"
    ranks = []
    for r, dv in enumerate(devices):
        res, lg = results[r], logits[r]
        err = None
        if lg is not None and ref_logits is not None:
            err = max(_rel(a, b) for a, b in zip(lg, ref_logits[r // d.ranks]))
        ops = tuple(_op_run(op, e, (res.get("ops") or {}).get(op))
                    for op, e in (res.get("decisions") or {}).items())
        error = res.get("error")
        # Fail closed here too: a rank passes only when every op it decided was called and matched.
        unchecked = unverified({o.op: {"calls": o.calls, "ok": o.ok, "worst": o.detail} for o in ops})
        if res.get("ok") and (unchecked or not ops):
            error = f"rank {r}: {unchecked or 'reported no op calls'}"
        ok = bool(res.get("ok")) and bool(ops) and not unchecked and err is not None and err <= LOGITS_REL_TOL
        if res.get("ok") and err is not None and err > LOGITS_REL_TOL:
            error = (f"rank {r}: logits differ from the reference: relative error {err:.2e} "
                     f"(bound {LOGITS_REL_TOL:.0e}) though every op matched its reference")
        where = res.get("where") or ""
        op = where.split(" ")[0] if where.split(" ")[0] in checks.called_ops() else None
        ranks.append(RankRun(r, dv.text, dv.decide, dv.run, ok, error, ops, err, op, res.get("phases_s") or {},
                             res.get("facts") or {}, res.get("graphs"), bool(res.get("died"))))
    out = Rehearsal(shape.model, tp, ep, backend, d.to_dict(), steps, tuple(ranks),
                    all(r.ok for r in ranks), LOGITS_REL_TOL, why, round(time.monotonic() - t0, 2),
                    _cause(ranks), dp_attention,
                    not_called=next((res["not_called"] for res in results if res.get("not_called")), {}))
    # A run with a planted fault tests the rehearsal, not the cards: never their verdict.
    if record and fault is None:
        out = attrs.evolve(out, recorded=_record(out, results))
    return out


def check_before_start(devices, libs) -> None:
    """What would fail in every rank, refused once here: an unknown library profile, a CUDA
    device this machine does not have."""
    if libs:
        from ..capabilities import Inventory
        from ..errors import CapdispatchError
        try:
            Inventory.with_assumptions(libs=libs)
        except CapdispatchError as exc:
            raise RehearseError(str(exc)) from None
    cuda = sorted({dv.run for dv in devices if dv.run.startswith("cuda")})
    if cuda:
        import capdispatch as cd
        for run in cuda:
            try:
                cd.probe(run)
            except cd.ProbeError as exc:
                raise RehearseError(f"--device: {run} cannot run a rank here "
                                    f"({getattr(exc, 'reason', exc)})") from None


def _record(r: Rehearsal, results) -> Optional[str]:
    """Store R's verdict in the rehearsal cache when every rank said its card and the group's
    decisions were made (a rank that failed before deciding leaves nothing to key by)."""
    from ..proof import rehearsals
    cards = [res.get("card") for res in results]
    decisions = next((res.get("plan_decisions") for res in results if res.get("plan_decisions")), None)
    if any(c is None for c in cards) or decisions is None:
        return None
    errs = [k.max_rel_err for k in r.ranks if k.max_rel_err is not None]
    v = rehearsals.RehearsalVerdict(r.ok, r.cause, tuple(k.device for k in r.ranks), r.model, r.tp, r.ep,
                                    r.dp_attention, max(errs) if errs else None, rehearsals.now())
    path = rehearsals.store(cards, decisions, v)
    return None if path is None else str(path)


def _cause(ranks) -> Optional[str]:
    """The failure to read first: a rank that failed in one of its ops, else one that died
    (not a survivor whose collective the death broke), else the first failing rank."""
    failed = [k for k in ranks if not k.ok]
    if not failed:
        return None
    first = next((k for k in failed if k.failed_op), None) or next((k for k in failed if k.died), failed[0])
    return first.error or f"rank {first.rank} failed"


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _op_run(op, e, s) -> OpRun:
    s = s or {}
    return OpRun(op, e["decided"], e.get("ran"), e.get("substituted"), s.get("calls", 0),
                 round(s.get("time_s", 0.0), 6), s.get("ok"), s.get("worst"), e.get("not_emulated"),
                 s.get("graphed", 0), s.get("captures", 0))


def _spawn(cfg_path, folder, world, timeout, start_timeout, on_progress=None):
    """Run the ranks; (per-rank result dicts, per-rank logits or None)."""
    env = dict(os.environ)
    procs = []
    try:
        for r in range(world):
            with open(os.path.join(folder, f"rank{r}.log"), "wb") as log:
                procs.append(subprocess.Popen([sys.executable, "-m", "capdispatch.rehearse.rank", cfg_path,
                                               str(r)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        return _watch(procs, folder, world, timeout, start_timeout, on_progress)
    finally:
        if on_progress:
            on_progress(None)
        for p in procs:          # an interrupt (Ctrl-C, SIGTERM, SIGHUP) or an error here: none outlives us
            kill_group(p)


def _watch(procs, folder, world, timeout, start_timeout, on_progress=None):
    import torch

    from .rank import JOINING
    # Watchdog: a rank must start (imports, device) within START_TIMEOUT; a started rank that
    # makes no progress (no op or collective begins) for TIMEOUT seconds is stalled, and then
    # every rank still running is killed. A rank that fails ends the others within TIMEOUT:
    # their next collective times out. A rank that fails before the group forms (rank 0 could
    # not bind the port) ends the run at once: the others would wait out START_TIMEOUT.
    t0 = time.monotonic()
    killed, stalled = [], None     # stalled: (rank, why, what it did: 'stalled' / 'failed')
    progress = [os.path.join(folder, f"rank{r}.progress") for r in range(world)]
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        for r, p in enumerate(procs):
            if codes[r] not in (None, 0) and _read(progress[r]) in ("", "starting", JOINING):
                stalled = stalled or (r, "failed before the group formed", "failed")
            if codes[r] is not None:
                continue
            try:
                age = time.time() - os.path.getmtime(progress[r])
            except OSError:
                age = None
            if age is None and now - t0 > start_timeout:
                stalled = stalled or (r, f"did not start within {start_timeout:g} s", "stalled")
            elif age is not None and age > timeout + _grace(progress[r]):
                stalled = stalled or (r, f"made no progress for {timeout:g} s", "stalled")
        if stalled:
            break
        if on_progress:
            on_progress([_read(p) for p in progress])
        time.sleep(0.05)
    stalls = {}
    for r, p in enumerate(procs):
        if p.poll() is None:
            killed.append(r)
            kill_group(p)
            stalls[r] = stalled[1] if stalled[0] == r else f"still running when rank {stalled[0]} {stalled[2]}"
    results, logits = [], []
    for r, p in enumerate(procs):
        path = os.path.join(folder, f"rank{r}.json")
        res = None
        if os.path.exists(path):
            with open(path) as f:
                res = json.load(f)
        where = _read(os.path.join(folder, f"rank{r}.progress")) or "starting"
        if res is None:
            if r in killed:
                why = f"rank {r}: {stalls[r]} (killed) in {where}"
            else:
                tail = _read(os.path.join(folder, f"rank{r}.log"))[-400:].strip()
                why = f"rank {r}: died (exit {p.returncode}) in {where}" + (f": {tail}" if tail else "")
            res = {"ok": False, "error": why, "where": where, "died": r not in killed}
        elif res.get("error"):
            msg = res["error"].splitlines()[0][:400]
            res["error"] = f"rank {r}: {msg}" + (f" (in {res['where']})" if res.get("where") else "")
        results.append(res)
        pt = os.path.join(folder, f"rank{r}.pt")
        logits.append(torch.load(pt) if res.get("ok") and os.path.exists(pt) else None)
    return results, logits


def _clean_stale_folders() -> None:
    """Remove the folders of earlier rehearsals whose parent is gone (killed outright, it could
    not remove its own); a folder whose owner still runs, or that is not ours, stays."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(FOLDER_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        try:
            if os.path.islink(path) or os.stat(path).st_uid != os.getuid():
                continue
            pid = int(_read(os.path.join(path, OWNER_FILE)).strip() or 0)
        except (OSError, ValueError):
            continue
        if pid > 0 and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _grace(progress_path) -> float:
    """A rank waiting in a collective times out there itself (and says so): a few seconds more."""
    where = _read(progress_path)
    return 5.0 if where.startswith(("all_reduce", "all_gather", "joining", "deciding")) else 0.0


def _read(path) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def reference_logits(d, tp, seed, prompt, steps) -> list:
    """The same model in one process, per sequence (one per DP rank) and step: each attention
    shard in turn through the ops' references, every MoE shard over every sequence's rows,
    the partials summed in rank order where the group all-reduces."""
    import torch

    from . import checks
    from . import model as M
    shards = [M.rank_weights(d, seed, r) for r in range(tp)]
    attn = shards[:d.ranks]                  # ranks 0.. hold attention shards 0.. (rank % attention TP)
    caches = [[[M.Layer(d, prompt + steps, "cpu") for _ in range(d.layers)] for _ in attn] for _ in range(d.dp)]

    def ops(name, layer, *args):
        return checks.reference(name)(*args)

    comm = M.Comm(lambda t: t, torch.cat, lambda t: t, lambda full: list(full.chunk(d.dp)))
    emb = M.embedding(d, seed)
    toks = [M.tokens(d, seed, prompt, steps, q) for q in range(d.dp)]
    out = [[] for _ in range(d.dp)]
    with torch.no_grad():
        for s in range(steps + 1):
            lo, hi = (0, prompt) if s == 0 else (prompt + s - 1, prompt + s)
            got = M.forward(d, attn, shards, ops, comm, [emb[t[lo:hi]] for t in toks], lo, caches, s, seed,
                            prefill=s == 0)
            for q, lg in enumerate(got):
                out[q].append(lg)
    return out
