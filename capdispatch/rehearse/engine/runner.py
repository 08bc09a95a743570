"""The engine rehearsal's run: SGLang with the plugin, then without, the same requests to
both, the rank reports, the comparison and the predictions beside the measures. Every step
is bounded; no process and no temporary folder outlives the run (Ctrl-C, SIGTERM and SIGHUP
included: processes.terminate_as_interrupt, and the server's group watches this process)."""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.error
from typing import Callable, Optional

import attrs

from ...adapters.sglang import versions as sglang_versions
from ...errors import CapdispatchError
from ...models import model_calls
from ..errors import RehearseError
from . import baseline, launch, server, verdict
from .verdict import Reply, Run

SET_ENV = "CAPDISPATCH_SET"
MEMORY_BOUND = 0.05    # the bars: memory after load within 5% of the plan,
TIME_BOUND = 0.20      # TPOT within 20% of the speed prediction


def rehearse(model: str, devices, *, tp: Optional[int] = None, prompt: int = 256, steps: int = 16,
             requests: int = 4, seed: int = 0, timeout: float = 120.0, start_timeout: float = 1800.0,
             port: Optional[int] = None, out: Optional[str] = None, sglang_args=(),
             server_cmd: tuple = ("-m", launch.SERVER_MODULE), env: Optional[dict] = None,
             off_from: Optional[str] = None,
             say: Callable[[str], None] = lambda s: None) -> verdict.EngineRehearsal:
    """The engine rehearsal of checkpoint MODEL on DEVICES (--device values); SERVER_CMD is what
    runs as `python SERVER_CMD ARGS` (SGLang's launcher; a stand-in in tests). OFF_FROM: an
    earlier rehearsal's engine-rehearsal.json whose plugin-off run is this launch's
    (baseline.py), compared against instead of starting a plugin-off server."""
    from .. import runner as small
    folder_model = launch.checkpoint(model)
    ranked = launch.ranks(devices, tp)
    ids = tuple(g for g, _ in ranked)
    emulated = {g: card for g, card in ranked if card}
    listed = launch.devices_value(ranked)
    launch.check_bounds(prompt=prompt, steps=steps, requests=requests, port=port)
    launch.check_timeout("--timeout", timeout)
    launch.check_timeout("--start-timeout", start_timeout)
    extra = launch.check_extra(sglang_args)
    shape = _model(folder_model)
    out = _out_dir(out)
    prompts = launch.requests(seed, requests, prompt, shape.vocab)
    base = {k: v for k, v in (os.environ if env is None else env).items()}
    launch.environment(base, plugin=True, report_dir="", devices=listed)    # a clash refused before any start
    off_key = baseline.key((*server_cmd, *launch.Launch(folder_model, ids, 0, seed, extra).argv()), 0,
                           folder_model, prompts, steps, seed,
                           launch.environment(base, plugin=False, report_dir="", devices=listed), ids,
                           sglang_versions.installed())
    kept_off = baseline.load(off_from, off_key) if off_from else None     # refused before any start
    t0 = time.monotonic()
    small._clean_stale_folders()
    from ...processes import terminate_as_interrupt
    with terminate_as_interrupt(), tempfile.TemporaryDirectory(prefix=small.FOLDER_PREFIX) as tmp:
        with open(os.path.join(tmp, small.OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        runs = []
        for plugin in (True, False):
            if not plugin and kept_off is not None:
                say(f"engine rehearsal: SGLang with capdispatch's plugin off: the same launch's run of "
                    f"{off_from}")
                runs.append(kept_off)
                break
            reports = os.path.join(tmp, "reports-on" if plugin else "reports-off")
            os.mkdir(reports)
            lp = launch.Launch(folder_model, ids, port or launch.free_port(), seed, extra)
            e = launch.environment(base, plugin=plugin, report_dir=reports, devices=listed)
            say(f"engine rehearsal: SGLang with capdispatch's plugin {'on' if plugin else 'off'}: starting")
            run = _serve(lp, e, plugin, server_cmd, prompts, steps, timeout, start_timeout, tmp, reports, out, say,
                         emulated)
            runs.append(run)
            if not run.ok:
                break
        on, off = runs[0], (runs[1] if len(runs) > 1 else None)
        ref = None
        ref_ops = tuple(dict.fromkeys(o.op for r in on.reports for o in r.routed()))
        if ref_ops and off is not None and off.ok and verdict.needs_reference(_comparisons(on, off)):
            # Whose kernel is off: the same launch with the routed ops on their torch references.
            reports = os.path.join(tmp, "reports-reference")
            os.mkdir(reports)
            graphs = () if launch.GRAPHS_OFF in extra else (launch.GRAPHS_OFF,)
            lp = launch.Launch(folder_model, ids, port or launch.free_port(), seed, extra + graphs)
            e = launch.environment(base, plugin=True, report_dir=reports, devices=listed)
            e[SET_ENV] = verdict.reference_set(base.get(SET_ENV), ref_ops)
            say(f"engine rehearsal: logprobs miss {verdict.LOGPROB_TOL:g}; SGLang with {', '.join(ref_ops)} on "
                f"their torch references: starting")
            ref = _serve(lp, e, True, server_cmd, prompts, steps, timeout, start_timeout, tmp, reports, out, say,
                         emulated, reference=True)
    r = _verdict(shape, folder_model, devices, ids, prompt, steps, requests, seed, on, off,
                 time.monotonic() - t0, out, emulated, next_n_of(extra), ref, ref_ops if ref is not None else (),
                 off_key)
    if out:
        _write_out(r, out)
    return r


def _model(folder: str):
    from ...models import load_model
    return load_model(folder)       # a ModelError (bad input) names the file and the field


def _out_dir(out: Optional[str]) -> Optional[str]:
    if out is None:
        return None
    path = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(path) and not os.path.isdir(path):
        raise RehearseError(f"--out {out}: exists and is not a folder")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise RehearseError(f"--out {out}: its parent folder {parent} does not exist")
    os.makedirs(path, exist_ok=True)
    return path


def _command(lp: launch.Launch, server_cmd: tuple) -> tuple:
    return ("python", *server_cmd, *lp.argv())


def _serve(lp, env, plugin, server_cmd, prompts, steps, timeout, start_timeout, tmp, reports, out, say,
           emulated=None, reference=False) -> Run:
    """One server: start, wait, ask, stop. A failure is the Run's error, named by step."""
    name = "sglang-reference.log" if reference else f"sglang-plugin-{'on' if plugin else 'off'}.log"
    label = "reference" if reference else f"plugin {'on' if plugin else 'off'}"
    log = os.path.join(tmp, name)
    command = _command(lp, server_cmd)
    ready = memory = None
    version = sglang_versions.installed()   # the server runs under this interpreter; it may say more
    settings = ()
    replies, step, rank, error, log_tail = [], None, None, None, ""
    proc = server.start(server_cmd, lp.argv(), env, log)
    try:
        ready = server.wait_ready(proc, lp.port, log, start_timeout)
        say(f"engine rehearsal: {label}: ready in {ready:.0f} s; sending requests")
        step = "server info"
        try:
            info = server.get_json(lp.port, "/server_info", timeout)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            # The measures it carries (version, settings, memory) are then reported as unknown.
            say(f"engine rehearsal: {label}: /server_info did not answer "
                f"({server.why(exc)}); going on without it")
            info = {}
        version = info.get("version") or version
        settings = verdict.settings_of(info)
        states = info.get("internal_states") or [{}]
        memory = (states[0] or {}).get("memory_usage")
        step = "warm-up request"
        _generate(proc, lp.port, log, prompts[0], 2, timeout, step)
        for i, ids in enumerate(prompts):
            step = f"request {i} (1 token)"
            t = time.monotonic()
            one = _generate(proc, lp.port, log, ids, 1, timeout, step)
            first = time.monotonic() - t
            step = f"request {i} ({steps} tokens)"
            t = time.monotonic()
            body = _generate(proc, lp.port, log, ids, steps, timeout, step)
            total = time.monotonic() - t
            rep = verdict.reply_of(body, first, total)
            head = verdict.reply_of(one, first, first).tokens
            if head[:1] != rep.tokens[:1]:
                raise server.EngineFailed(step, f"SGLang's first token differs between the 1-token "
                                                f"({head[:1]}) and the {steps}-token reply ({rep.tokens[:1]}): "
                                                f"its greedy output is not repeatable here")
            if len(rep.tokens) != steps:
                raise server.EngineFailed(step, f"{len(rep.tokens)} tokens back, asked for {steps}")
            replies.append(rep)
        step = None
    except server.EngineFailed as exc:
        step, rank, error, log_tail = exc.step, exc.rank, str(exc), exc.log_tail
    except (urllib.error.URLError, OSError) as exc:
        error = f"{step}: no answer from SGLang ({server.why(exc)})"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        error = f"SGLang's answer cannot be read: {type(exc).__name__}: {exc}"
    finally:
        server.stop(proc)
    saved = None
    if out:
        saved = os.path.join(out, name)
        shutil.copyfile(log, saved)
    found = ()
    if plugin:
        # Read after a failure too: what the ranks decided and installed before it is evidence.
        try:
            found = verdict.read_reports(reports, lp.gpu_ids, emulated)
        except ValueError as exc:
            if error is None:
                step, error = "rank reports", str(exc)
        if out and found:
            folder = "reports-reference" if reference else "reports"
            os.makedirs(os.path.join(out, folder), exist_ok=True)
            kept = []
            for rep in found:
                dest = os.path.join(out, folder, os.path.basename(rep.path))
                shutil.copyfile(rep.path, dest)
                kept.append(attrs.evolve(rep, path=dest))
            found = tuple(kept)
    if not plugin and error is None:
        leaked = sorted(os.listdir(reports))
        if leaked:
            step, error = "plugin off", (f"the plugin-off run wrote rank reports ({', '.join(leaked)}): "
                                         f"{launch.PLUGINS_ENV} did not keep capdispatch out")
    return Run(plugin, command, error is None, step, rank, error, ready, version, memory, settings,
               tuple(replies), found, saved, log_tail, reference)


def _generate(proc, port, log, ids, n, timeout, step) -> dict:
    body = {"input_ids": list(ids), "return_logprob": True, "top_logprobs_num": verdict.TOP_LOGPROBS,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    try:
        return server.post_json(port, "/generate", body, timeout)
    except (urllib.error.URLError, OSError) as exc:
        if proc.poll() is not None:
            raise server.died(proc, log, step) from None
        why = server.why(exc)
        text = server.tail(log)
        raise server.EngineFailed(step, f"no answer within --timeout {timeout:g} s, or an HTTP error ({why}); "
                                        f"SGLang's log's last line: {server.last_error(text)}",
                                  server.rank_in(text), text) from None


def _comparisons(on, off, ref=None) -> tuple:
    """Each request's plugin-on reply against its plugin-off one (and the reference's)."""
    if not (on.ok and off is not None and off.ok):
        return ()
    routed = any(r.routed() for r in on.reports)
    exact = not routed and not verdict.settings_differ(on, off)
    refs = ref.replies if ref is not None and ref.ok else ()
    return tuple(verdict.compare(i, a, b, exact=exact, ref=refs[i] if i < len(refs) else None)
                 for i, (a, b) in enumerate(zip(on.replies, off.replies)))


def _verdict(shape, folder, devices, ids, prompt, steps, requests, seed, on, off, wall, out, emulated=None,
             next_n=1, ref=None, ref_ops=(), off_key=None):
    routed = tuple(f"{o.op} on rank {r.rank} ({o.backend})" for r in on.reports for o in r.routed())
    problems = verdict.report_problems(on.reports) if on.ok else []
    if ref is not None and ref.ok:
        problems += verdict.report_problems(ref.reports) + verdict.reference_problems(ref.reports, ref_ops)
    differ = verdict.settings_differ(on, off) if on.ok and off is not None and off.ok else ()
    comparisons = _comparisons(on, off, ref)
    cause = None
    for run in (on, off, ref):
        if run is not None and not run.ok and cause is None:
            who = f"rank {run.rank}, " if run.rank is not None else ""
            cause = f"{run.label}, {who}{run.step}: {run.error}"
    if cause is None and problems:
        cause = f"rank reports: {problems[0]}"
    bad = [c for c in comparisons if not c.ok]
    if cause is None and bad:
        cause = bad[0].detail
    ok = (cause is None and off is not None and len(comparisons) == requests == len(on.replies)
          and all(c.ok for c in comparisons))
    if ok is False and cause is None:
        cause = "nothing was compared"
    measures = measures_of(shape, ids, prompt, steps, on, emulated, next_n)
    declared = model_calls()
    not_called = {o.op: declared.not_called(o.op) for r in on.reports for o in r.ops if declared.get(o.op) is None}
    return verdict.EngineRehearsal("sglang", shape.name, folder, tuple(str(d) for d in devices), len(ids), prompt,
                                   steps, requests, seed, on, off, routed, differ, comparisons, measures, ok, cause,
                                   verdict.LOGPROB_TOL, round(wall, 2), out, not_called, ref, tuple(ref_ops),
                                   off_key)


def next_n_of(sglang_args) -> Optional[int]:
    """The tokens a decode step verifies under SGLANG_ARGS, as the plan counts them: 1 without
    speculative decoding (SGLang then loads no MTP layer and verifies no draft); with a
    --speculative-* argument, None (the model's own: 1 + its MTP layers)."""
    return None if any(str(a).startswith("--speculative") for a in sglang_args) else 1


def measures_of(shape, ids, prompt, steps, on, emulated=None, next_n=1) -> tuple:
    """Measured memory after load (rank 0, SGLang's /server_info) and time (client side) beside
    `dispatch plan` and `dispatch plan --speed` for the same checkpoint and cards. Where a
    rank emulates a card, the times are the device's and the prediction the card's: shown,
    without a bar."""
    mem = on.memory or {}
    tpot = [(r.total_s - r.first_s) / (steps - 1) * 1e3 for r in on.replies]
    pre = [prompt / r.first_s for r in on.replies if r.first_s > 0]
    m_tpot = statistics.median(tpot) if tpot else None
    m_pre = statistics.median(pre) if pre else None
    gib = 1 << 30
    w = _num(mem.get("weight"))
    kv = _num(mem.get("kvcache"))
    cap = mem.get("token_capacity")
    pw = pkv = pt = pp = None
    note_mem = note_time = ""
    try:
        specs, memplan = _plan(shape, ids, cap if isinstance(cap, int) and cap > 0 else None, emulated, next_n)
        r0 = memplan.ranks[0].memory if memplan.ranks else None
        if r0 is None:
            note_mem = memplan.refusal or "the plan has no memory for rank 0"
        else:
            pw, pkv = r0.weight_bytes / gib, (r0.kv_bytes / gib if cap else None)
        try:
            pt, pp = _speed(shape, memplan, specs, prompt)
        except (CapdispatchError, ValueError) as exc:     # a prediction that cannot be made is said
            note_time = f"not predicted: {exc}"
    except (CapdispatchError, ValueError) as exc:
        note_mem = note_time = f"not predicted: {exc}"
    time_bound = TIME_BOUND
    if emulated and not note_time:
        time_bound = None
        note_time = (f"emulated rank(s) {', '.join(f'cuda:{g} as {c}' for g, c in sorted(emulated.items()))}: "
                     f"measured on the device that is there, predicted for the card; no bar")
    return (verdict.Measure("weights after load", "GiB", w, pw, MEMORY_BOUND, note_mem),
            verdict.Measure("KV pool", "GiB", kv, pkv, MEMORY_BOUND,
                            note_mem or f"the plan's pool at SGLang's token capacity ({cap})"),
            verdict.Measure("decode TPOT (batch 1)", "ms", m_tpot, pt, time_bound,
                            note_time or f"median over requests of (t[{steps} tokens] - t[1 token]) / {steps - 1}"),
            verdict.Measure("prefill throughput", "tokens/s", m_pre, pp, None,
                            note_time or f"{prompt} tokens / t[1 token], median; includes the HTTP round trip"))


def _num(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _plan(shape, ids, context, emulated=None, next_n=1):
    """The ranks' cards as the plugin reads them (NVML, or CAPDISPATCH_SGLANG_DEVICES; an
    emulated rank's card from the catalog) and `dispatch plan`'s rig plan at CONTEXT tokens,
    one request, NEXT_N tokens a decode step (next_n_of)."""
    import capdispatch as cd
    from ...adapters.sglang import gpus
    from ...dispatch import rigplan
    emulated = emulated or {}
    specs = [cd.probe(f"sim:{emulated[g]}").with_id(f"cuda:{g}") if g in emulated else gpus.device(g, via="nvml")
             for g in ids]
    plan = rigplan.build(shape, specs, tp=len(ids), next_n=next_n, context=context or rigplan.DEFAULT_CONTEXT,
                         batch=1)
    return specs, plan


def _speed(shape, memplan, specs, prompt):
    """`dispatch plan --speed`'s decode step at batch 1 (ms) and prefill of PROMPT (tokens/s)."""
    from ...dispatch import speed
    from ...dispatch.explain import plan
    if memplan.shapes is None:
        raise ValueError(memplan.refusal)
    decided = plan(list(memplan.devices), shapes=memplan.shapes, log_warnings=False)
    rows = speed.predict(shape, memplan.shapes, list(memplan.devices),
                         {op: g.per_device for op, g in decided.ops.items()},
                         speed.merged(speed.default_calibrations()), prefill=prompt)

    def step(phase, size):
        known = [r.total for r in rows if r.phase == phase and r.size == size]
        return max(known) if known and None not in known else None
    dec, pre = step("decode", 1), step("prefill", prompt)
    return dec, (prompt / pre * 1e3 if pre else None)


def _write_out(r, out: str) -> None:

    from ...safe_io import write_atomic
    from .render import render
    write_atomic(os.path.join(out, "engine-rehearsal.json"), json.dumps(r.to_dict(), indent=2) + "\n")
    write_atomic(os.path.join(out, "engine-rehearsal.txt"), render(r) + "\n")


def stderr_say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
