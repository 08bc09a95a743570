"""Launch time (SGLang's main process): decide for the launch's GPUs, set
SGLang's fields and environment only where the user did not, say what was set.

Runs as a wrapper of one resolution step (how it is wrapped, read and declared
into is the release's API: compat.py): the environment is set before the step, so
SGLang's DeepSeek-V4 defaults read it; fields are declared after it, so they are the
last word unless the user spoke.
What the launch asks (records.LaunchInputs) rides to every scheduler process on
the record (INPUTS_ATTR), so each rank decides from the same inputs.
"""
from __future__ import annotations

import logging
import os
import attrs

from .compat import cli_fields, explicit_fields  # noqa: F401  (read from 0.5.23's launch command)

log = logging.getLogger("capdispatch.sglang")

INPUTS_ATTR = "_capdispatch"      # a bookkeeping attribute: pickled with the record
OPTIONS_ATTR = "_capdispatch_plan"   # records.PlanOptions, set by `dispatch sglang plan` only


class _Stash(str):
    """The LaunchInputs riding on SGLang's server-args record. SGLang dumps
    vars(server_args) into /server_info's internal states (JSON) and pickles the record
    to every scheduler: as a str, the JSON gets one line of text; its `inputs`
    attribute travels in the pickle."""
    inputs = None


def stash(server_args, inputs) -> None:
    """Attach INPUTS (records.LaunchInputs) to SGLang's server-args record."""
    s = _Stash(f"capdispatch launch inputs: {inputs.model}, ops {', '.join(inputs.ops) or 'none'}")
    s.inputs = inputs
    setattr(server_args, INPUTS_ATTR, s)


def stashed(server_args):
    """The LaunchInputs stash() attached, or None."""
    return getattr(getattr(server_args, INPUTS_ATTR, None), "inputs", None)


def model_arch(server_args, api):
    try:
        return api.model_config(server_args).hf_config.architectures[0]
    except Exception as exc:  # SGLang's own step reports a bad model; we only stand aside
        log.debug("capdispatch: model architecture unknown (%s)", exc)
        return None


def gpu_ids_of(cfg, api) -> list:
    from . import gpus
    return gpus.gpu_ids(tp_size=cfg.tp_size, pp_size=cfg.pp_size, nnodes=cfg.nnodes,
                       node_rank=cfg.node_rank, base_gpu_id=cfg.base_gpu_id,
                       gpu_id_step=cfg.gpu_id_step, dp_size=cfg.dp_size,
                       dp_attention=bool(cfg.enable_dp_attention) or api.attn_dp_size(lambda f: getattr(cfg, f)) > 1)


def record_inputs(server_args, release, read, *, user_env=None):
    """The LaunchInputs of a record; READ(field) gives a field's value."""
    from . import compat, decide
    from .records import LaunchInputs
    api = compat.of(release)
    explicit = api.explicit_fields(server_args)
    values = {}
    for f in explicit:
        try:
            values[f] = read(f)
        except AttributeError:
            pass
    arch = model_arch(server_args, api)
    dtype = read("kv_cache_dtype")
    ops, reason = decide.applicable_ops(release, arch, dtype)
    opts = getattr(server_args, OPTIONS_ATTR, None)
    return LaunchInputs(arch, None if dtype is None else str(dtype), ops, reason, frozenset(explicit),
                        values, user_env, **({} if opts is None else {"options": opts}))


def prepare(server_args, release, *, env=None):
    """Before the step: what applies, the group decision, the environment.
    Returns the Decision, or None when there is nothing to decide here."""
    import capdispatch as cd

    from . import compat, decide, gpus
    env = os.environ if env is None else env
    api = compat.of(release)
    cfg = api.view(server_args)
    # Before SGLang's own DeepSeek-V4 defaults set any of them (on SM120 it turns
    # its TileLang and torch indexer switches on): what the user set, for the ranks.
    user_env = {n: env[n] for n in release.route_env_names() if n in env}
    inputs = record_inputs(server_args, release, lambda f: getattr(cfg, f), user_env=user_env)
    stash(server_args, inputs)
    if not inputs.ops:
        log.info("capdispatch: %s; nothing to decide at launch", inputs.reason)
        return None
    ids = gpu_ids_of(cfg, api)
    try:
        specs = gpus.devices(ids, env=env, via="nvml")
    except cd.ProbeError as exc:
        log.warning("capdispatch: cannot read the launch's GPUs %s without initialising CUDA (%s); "
                    "launch-time settings skipped, each rank still decides for its own card",
                    ", ".join(f"cuda:{g}" for g in ids), getattr(exc, "reason", exc))
        return None
    emus = [gpus.emulation(g, env=env, via="nvml") for g in ids]
    d = decide.decide_launch(specs, release, inputs, env=env)
    refuse_emulations(release, d, emus)
    for s in d.settings:
        if s.action == "set" and s.kind == "env":
            env[s.name] = s.value
    stash(server_args, attrs.evolve(inputs, devices=tuple(gpus.describe(s, e) for s, e in zip(specs, emus))))
    return d


def refuse_emulations(release, d, emus) -> None:
    """Refuse the launch where an emulated rank (emulate.py) cannot run its card's decision
    on the device that is there: one line naming the rank, before SGLang starts any."""
    import capdispatch as cd

    from . import emulate
    for rank, (dev, emu) in enumerate(zip(d.devices, emus)):
        if emu is None:
            continue
        refused = emulate.problems(release, {op: row[dev.id] for op, row in d.choices.items() if dev.id in row},
                                   emu, rank)
        if refused:
            raise cd.Unsatisfiable(f"capdispatch: {refused[0]}")


def finish(server_args, release, d) -> None:
    """After the step: declare the fields, log the summary; refuse a MoE route SGLang would
    hand global expert ids (moe_method.global_ids_refusal)."""
    import capdispatch as cd

    from . import compat, decide, render, gpus
    api = compat.of(release)
    inputs = stashed(server_args)
    dtype = api.resolved(server_args, "kv_cache_dtype")
    ops, reason = decide.applicable_ops(release, inputs.model, dtype)
    inputs = attrs.evolve(inputs, kv_cache_dtype=None if dtype is None else str(dtype), reason=reason,
                          ops=tuple(op for op in inputs.ops if op in ops))
    if not inputs.ops:
        stash(server_args, inputs)
        log.info("capdispatch: SGLang resolved %s; capdispatch's ops do not run", reason)
        return
    from .moe_method import global_ids_refusal
    refused = global_ids_refusal(api, lambda f: api.resolved(server_args, f),
                                 [dev.id for dev in d.devices if "moe" in inputs.ops and
                                  d.choices.get("moe", {}).get(dev.id) is not None and d.choices["moe"][dev.id].routed])
    if refused:
        raise cd.Unsatisfiable(refused)
    fields = {s.name: s.value for s in d.settings if s.action == "set" and s.kind == "field"}
    if fields:
        api.declare(server_args, decide.SOURCE, fields)
    inputs = attrs.evolve(inputs, applied={s.name: s.value for s in d.settings if s.action == "set"})
    stash(server_args, inputs)
    for w in d.warnings:
        log.warning("capdispatch: %s", w)
    log.info("capdispatch: SGLang launch of %s on %s: %s", inputs.reason,
             "; ".join(inputs.devices or (gpus.describe(s) for s in d.devices)), render.summary(d))


_STEPS: set = set()     # per process: the resolution steps whose wrapper is registered


def register_step(release, *, apply: bool = False) -> None:
    """Wrap RELEASE's resolution step with resolution_hook, once per process (the
    plugin's register() and `dispatch sglang plan`'s in-process resolution both ask;
    APPLY: the plan, outside SGLang's plugin loader)."""
    from . import compat
    step = release.hooks.resolution_step
    if step in _STEPS:
        return
    compat.of(release).register_step(step, resolution_hook, apply=apply)
    _STEPS.add(step)


def resolution_hook(server_args, previous) -> None:
    """The step's wrapper: fn(server_args, previous)."""
    from . import knobs, versions
    release = knobs.load().release(versions.installed() or "")
    d = prepare(server_args, release) if release is not None else None
    previous(server_args)
    if d is not None:
        finish(server_args, release, d)
