"""Scenarios the SGLang adapter tests run in fresh processes, against the real
SGLang package: its plugin loader and hook registry keep per-process state, and
SGLang itself spawns one process per rank. Each prints one line `RESULT <json>`.

  launcher CASES.json    load_plugins() as SGLang's launcher does; check the knob
                         map's names against this SGLang; then, per case,
                         prepare_server_args(argv) + resolve_once() under the
                         case's environment, pickling the record when asked
  rank IN.pkl GPU_ID TP_RANK [PORT [POLICY,...]]
                         a scheduler process: load_plugins, publish, the real
                         configure_scheduler_process; with PORT, then SGLang's TP
                         group over gloo and the plugin's agreement hook, once per
                         policy file ("-": none)
  kv IN.pkl GPU_ID TP_RANK
                         a rank, then SGLang's V4 dequant (and store, if routed)
                         against SGLang's K-cache reference
  attn IN.pkl GPU_ID TP_RANK
                         a rank, then SGLang's DSv4 decode, sparse-prefill and
                         indexer call sites against capdispatch's references
  served IN.pkl GPU_ID TP_RANK PORT POLICY[,POLICY...]
                         a rank that agrees once per policy ("-": none) over SGLang's
                         TP group (gloo); after each: the routes as bound (buckets,
                         SGLang's own sizes, checks), the rank's report, and on an
                         H200 rank SGLang's decode call at two sizes with a spy for
                         FlashMLA; SCENARIO_BREAK=RANK:OP fails OP's route install there
  knobs                  only the knob map's names against this SGLang
  version VERSION CASES.json
                         register() with a fake SGLang version, then launches
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_prelude  # noqa: E402,F401  (before anything imports sglang)

KNOB_ENVS = ("SGLANG_DSV4_KV_LAYOUT",)
FIELDS = ("kv_cache_dtype", "page_size", "attention_backend", "dsv4_attn_backend", "tp_size")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.items = []

    def emit(self, record):
        self.items.append([record.levelname, record.getMessage()])


def capture_logs() -> list:
    """Collect the capdispatch records from now on (a fresh list each call)."""
    h = _Records()
    log = logging.getLogger("capdispatch")
    for old in [x for x in log.handlers if isinstance(x, _Records)]:
        log.removeHandler(old)
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return h.items


def emit(obj) -> None:
    print("RESULT " + json.dumps(obj, default=repr), flush=True)


def _ours(hooks) -> bool:
    from capdispatch.adapters.sglang import launch, rank, routes
    mine = {rank.after_configure, rank.after_parallel_ready, *routes.CALLS.values()}
    return any(h[1] in mine or getattr(h[1], "capdispatch_hook", None) is launch.resolution_hook for h in hooks)


def _registries() -> dict:
    """The HookRegistry targets capdispatch hooks, and (SGLang 0.5.23, which has
    register_resolution_hook) the resolution steps it wraps there."""
    import importlib.util

    from sglang.srt.plugins.hook_registry import HookRegistry

    from capdispatch.adapters.sglang import launch
    out = {"hook_targets": sorted(t for t, hs in HookRegistry._hooks.items() if _ours(hs))}
    if importlib.util.find_spec("sglang.srt.arg_groups.resolution_hooks") is not None:
        from sglang.srt.arg_groups import resolution_hooks
        out["resolution_hooks"] = sorted(k for k, fns in resolution_hooks._HOOKS.items()
                                         if launch.resolution_hook in fns)
    return out


# --------------------------------------------------------------------------- launcher

def check_knob_names() -> list:
    """Every SGLang name the knob map's entry for this SGLang uses exists here (0.5.23:
    a msgspec ServerArgs and register_resolution_hook's overridable steps; 0.5.17: a
    dataclass ServerArgs whose step is one of its methods). Returns problems. Names in
    sgl_kernel resolve to the prelude's stand-in under 0.5.17 (sglang-kernel 0.4.5's
    parameters, copied)."""
    import dataclasses
    import importlib
    import pkgutil

    from sglang.srt.environ import envs
    from sglang.srt.server_args import ServerArgs

    from capdispatch.adapters.sglang import knobs, versions
    release = knobs.load().release(versions.installed())
    if dataclasses.is_dataclass(ServerArgs):
        fields = {f.name for f in dataclasses.fields(ServerArgs)}
    else:
        import msgspec
        fields = {f.name for f in msgspec.structs.fields(ServerArgs)}
    problems = []

    def resolves(name):
        try:
            pkgutil.resolve_name(name)
        except Exception as exc:
            problems.append(f"{name}: {type(exc).__name__}: {exc}")

    h = release.hooks
    if release.api == "0.5.23":
        from sglang.srt.arg_groups import resolution_hooks
        if h.resolution_step not in resolution_hooks._OVERRIDABLE_HOOKS:
            problems.append(f"resolution step {h.resolution_step} is not overridable")
    else:
        resolves(h.resolution_step)
    for name in (h.rank, h.group, h.tp_group):
        resolves(name)
    for s in release.settings:
        if s.kind == "field" and s.name not in fields:
            problems.append(f"setting: {s.name} is not a ServerArgs field")
        if s.kind == "env" and not hasattr(envs, s.name):
            problems.append(f"setting: {s.name} is not declared in sglang.srt.environ")
    choices = _field_choices()

    def field_value(where, name, value):
        if name not in fields:
            problems.append(f"{where}: {name} is not a ServerArgs field")
        elif choices.get(name) is not None and value not in [str(c) for c in choices[name]]:
            problems.append(f"{where}: {name}={value} is not one of SGLang's choices {choices[name]}")

    for s in release.selects:
        field_value("select", s.field, s.value)
    sglang_settings = [(f"entry {e.op}={e.backend}", s) for e in release.entries.values() for s in e.settings]
    sglang_settings += [(f"route {r.name} runner", r.runner) for r in release.routes if r.runner]
    for where, s in sglang_settings:
        if s.kind == "field":
            field_value(where, s.name, s.value)
        elif not hasattr(envs, s.name):
            problems.append(f"{where}: {s.name} is not declared in sglang.srt.environ")
        else:
            try:
                getattr(envs, s.name).parse(s.value)
            except Exception as exc:
                problems.append(f"{where}: {s.name}={s.value} does not parse: {exc}")
    import inspect

    from capdispatch.adapters.sglang import routes

    def params(fn):
        # Names, kinds, and which have defaults (a wrapper's None may stand for
        # SGLang's default, e.g. layout=None for KVLayout.V4).
        return [(p.name, p.kind.name, p.default is not p.empty)
                for p in inspect.signature(fn).parameters.values()]

    for r in release.routes:
        resolves(r.target)
        try:
            target = pkgutil.resolve_name(r.target)
        except Exception:
            continue
        # The wrapper binds SGLang's positional and keyword calls the same way.
        want, got = params(target), params(routes.CALLS[r.call])[1:]
        if want != got:
            problems.append(f"route {r.target}: SGLang's parameters {want} differ from {r.call}'s {got}")
        if r.prepare:
            resolves(r.prepare)
        for name, value in r.env:
            if not hasattr(envs, name):
                problems.append(f"route {r.op}: {name} is not declared in sglang.srt.environ")
            else:
                try:
                    getattr(envs, name).parse(value)
                except Exception as exc:
                    problems.append(f"route {r.op}: {name}={value} does not parse: {exc}")
    arch = release.arch
    common = importlib.import_module(arch["module"])
    for name in arch["probes"]:
        if not callable(getattr(common, name, None)):
            problems.append(f"probe {arch['module']}.{name} missing")
    if arch["platform"]:
        from sglang.srt.runtime_context import override_platform
        try:
            override_platform(**{f: None for f in arch["platform"]}).install()
        except ValueError as exc:
            problems.append(f"platform: {exc}")
    for g in arch["globals"]:
        mod = importlib.import_module(g["module"])
        if not hasattr(mod, g["name"]):
            problems.append(f"global {g['module']}.{g['name']} missing")
    jit = importlib.import_module(arch["jit_arch"]["module"])
    for key in ("make", "detect"):
        if not callable(getattr(jit, arch["jit_arch"][key], None)):
            problems.append(f"jit_arch {key}: {arch['jit_arch'][key]} missing")
    return problems


def _field_choices() -> dict:
    """ServerArgs field -> its CLI choices (None: free-form), from SGLang's own parser."""
    import argparse

    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return {a.dest: a.choices for a in parser._actions}


def knob_names() -> None:
    """Only the knob-map name check (tests/test_sglang_units.py runs it when SGLang is here)."""
    emit({"knob_name_problems": check_knob_names()})


def _launch_case(case: dict, baseline: dict) -> dict:
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args
    os.environ.clear()
    os.environ.update(baseline)
    os.environ.update(case.get("env", {}))
    logs = capture_logs()
    try:
        sa = prepare_server_args(case["argv"])
        sa.resolve_once()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "logs": logs}
    if case.get("pickle"):
        with open(case["pickle"], "wb") as f:
            pickle.dump(sa, f)
    return {
        "fields": {f: resolution_result(sa, f) for f in FIELDS},
        "declared": [d for src, d in sa._resolved_overrides if src == "capdispatch"],
        "env": {k: os.environ.get(k) for k in KNOB_ENVS},
        "stash": _inputs_json(_stashed(sa)),
        "stash_json": _stash_json(sa),
        "logs": logs,
    }


def _stashed(sa):
    from capdispatch.adapters.sglang.launch import stashed
    return stashed(sa)


def _stash_json(sa):
    """What SGLang's /server_info makes of the plugin's attribute (it dumps vars(server_args)
    as JSON): the JSON text, or the error."""
    import json
    try:
        return json.dumps(vars(sa).get("_capdispatch"))
    except (TypeError, ValueError) as exc:
        return f"not JSON: {exc}"


def _inputs_json(inputs):
    """The launcher's LaunchInputs record as plain JSON (None when it made none)."""
    import attrs
    if inputs is None:
        return None
    out = attrs.asdict(inputs, recurse=True)
    out["ops"] = list(out["ops"])
    out["explicit_fields"] = sorted(out["explicit_fields"])
    return out


def _cases(path) -> list:
    with open(path) as f:
        return json.load(f)


def launcher(cases_path) -> None:
    from importlib.metadata import entry_points
    logs = capture_logs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang.srt.distributed.bootstrap as bootstrap
    import sglang.srt.managers.scheduler as scheduler

    import capdispatch.adapters.sglang as plugin
    out = {
        "entry_points": [ep.value for ep in entry_points(group="sglang.srt.plugins")],
        "registered": plugin._done.get("result"),
        "again": plugin.register(),
        "configure_patched": hasattr(scheduler.configure_scheduler_process, "__wrapped__"),
        "parallel_patched": hasattr(bootstrap.init_parallel_runtime, "__wrapped__"),
        "load_logs": logs,
        **_registries(),
    }
    baseline = dict(os.environ)
    out["cases"] = [_launch_case(c, baseline) for c in _cases(cases_path)]
    out["knob_name_problems"] = check_knob_names()
    emit(out)


def version(v, cases_path) -> None:
    logs = capture_logs()
    from sglang.srt.plugins import hook_registry  # noqa: F401  (its import sets SGLang's env defaults)

    import capdispatch.adapters.sglang as plugin
    env_before = dict(os.environ)
    out = {"first": plugin.register(sglang_version=v), "again": plugin.register()}
    out["env_changed"] = sorted(k for k in set(os.environ) | set(env_before)
                                if os.environ.get(k) != env_before.get(k))
    out["register_logs"] = list(logs)
    from sglang.srt.plugins import load_plugins
    load_plugins()          # SGLang's loader runs register() again: still nothing
    out.update(_registries())
    baseline = dict(os.environ)
    out["cases"] = [_launch_case(c, baseline) for c in _cases(cases_path)]
    emit(out)


# --------------------------------------------------------------------------- ranks

def _rank(inp, gpu_id: int, tp_rank: int):
    """What SGLang's run_scheduler_process does before building the Scheduler."""
    logs = capture_logs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    with open(inp, "rb") as f:
        sa = pickle.load(f)
    from sglang.srt.runtime_context import SpawnRanks, override_platform, publish
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None, gpu_id=gpu_id))
    if os.environ.get("SCENARIO_DEVICE0_SM120"):
        # What a process would believe from device 0 = an RTX 5090, through
        # SGLang's own override facility: the plugin must replace it.
        override_platform(is_sm120=True, is_blackwell=True, device_sm=120,
                          device_capability=(12, 0)).install()
    import sglang.srt.managers.scheduler as scheduler
    scheduler.configure_scheduler_process(sa, gpu_id, display_tp_rank=tp_rank)
    return sa, logs


def _state(gpu_id: int) -> dict:
    from capdispatch.adapters.sglang import rank, routes
    st = rank._RANKS[gpu_id]
    out = {"device": st.spec.to_dict(), "ops": list(st.inputs.ops),
           "choices": {op: {"backend": c.backend, "routed": c.routed, "action": c.action, "why": c.why,
                            "runs": c.runs, "install": c.install}
                       for op, c in st.choices.items()},
           "routes": {}}
    for op in st.inputs.ops:
        fn = routes.kernel(op, st.key)
        out["routes"][op] = None if fn is None else fn.__name__      # the op=backend custom op's name
    out["env"] = {n: os.environ.get(n) for n in st.release.route_env_names()}
    return out


def _facts() -> dict:
    import sglang.srt.layers.moe.moe_runner.deep_gemm_sm120 as dg120
    import sglang.srt.utils as utils_pkg
    from sglang.kernels.jit.utils import arch
    from sglang.srt.runtime_context import get_platform
    from sglang.srt.utils import common
    was_loaded = "sglang.srt.layers.attention.dsv4.metadata" in sys.modules
    import sglang.srt.layers.attention.dsv4.metadata as dsv4_metadata   # imported after the hook
    p = get_platform()
    jit = arch.get_jit_cuda_arch()
    return {
        "platform": {k: getattr(p, k) for k in ("is_sm90", "is_sm100", "is_sm120", "is_blackwell",
                                                 "device_sm", "device_capability")},
        "probes": {k: getattr(common, k)() for k in ("is_sm90_supported", "is_sm100_supported",
                                                      "is_sm120_supported", "is_blackwell_supported",
                                                      "is_sm120", "get_device_sm")},
        "copies": {"sglang.srt.utils.is_sm120_supported": utils_pkg.is_sm120_supported(),
                   "deep_gemm_sm120.is_sm120_supported": dg120.is_sm120_supported(),
                   "deep_gemm_sm120._is_sm120": dg120._is_sm120,
                   "dsv4.metadata._IS_SM120": dsv4_metadata._IS_SM120,
                   "dsv4.metadata_imported_before": was_loaded},
        "jit_arch": [jit.major, jit.minor, jit.suffix],
    }


def rank(inp, gpu_id: int, tp_rank: int, port=None, modes=()) -> None:
    """MODES: policy files to agree under, one after another over the same TP
    group (every rank runs the same sequence); "-" is no policy file."""
    sa, logs = _rank(inp, gpu_id, tp_rank)
    out = {"state": _state(gpu_id), "facts": _facts(), "logs": logs, "agreements": []}
    if port is not None:
        from sglang.srt.distributed import parallel_state as ps
        from sglang.srt.runtime_context import get_parallel

        from capdispatch.adapters.sglang import rank as hooks
        from capdispatch.dispatch.agreement import AgreementError
        from capdispatch.proof.rehearsals import RehearsalRequiredError
        ps.init_distributed_environment(world_size=get_parallel().tp_size, rank=tp_rank,
                                        local_rank=tp_rank, backend="gloo", timeout=120,
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(backend="gloo")
        for policy in modes or ("-",):
            # "require-rehearsal": no policy file, CAPDISPATCH_REQUIRE_REHEARSAL=1.
            os.environ.pop("CAPDISPATCH_REQUIRE_REHEARSAL", None)
            if policy in ("-", "require-rehearsal"):
                os.environ.pop("CAPDISPATCH_POLICY", None)
            else:
                os.environ["CAPDISPATCH_POLICY"] = policy
            if policy == "require-rehearsal":
                os.environ["CAPDISPATCH_REQUIRE_REHEARSAL"] = "1"
            logs = capture_logs()
            error = None
            try:
                # The plugin's AFTER hook on init_parallel_runtime, once SGLang's TP group exists.
                hooks.after_parallel_ready(None, server_args=sa, device="cpu", dist_port=port)
            except (AgreementError, RehearsalRequiredError) as exc:
                error = str(exc)
            plan = hooks._RANKS[gpu_id].agreed
            agreement = hooks._RANKS[gpu_id].agreement
            out["agreements"].append({
                "rehearsal": None if agreement is None else agreement.rehearsal,
                "policy": policy, "error": error, "logs": logs, "state": _state(gpu_id),
                "group": None if plan is None or error else {
                    op: {d: r.backend for d, r in g.per_device.items()} for op, g in plan.ops.items()}})
    emit(out)


def emu(inp, gpu_id: int, tp_rank: int) -> None:
    """A scheduler process whose CAPDISPATCH_SGLANG_DEVICES entry emulates a card
    (`emu:NAME@sim:CARD`): its state, SGLang's facts and its report, or the refusal."""
    import json
    from capdispatch.adapters.sglang import rank as hooks
    from capdispatch.adapters.sglang import report
    try:
        _, logs = _rank(inp, gpu_id, tp_rank)
    except Exception as exc:
        emit({"error": f"{type(exc).__name__}: {exc}"})
        return
    st = hooks._RANKS[gpu_id]
    with open(report.report_path(gpu_id)) as f:
        rep = json.load(f)
    emit({"state": _state(gpu_id), "facts": _facts(), "logs": logs, "key": list(st.key),
          "report": {"emulated": rep["emulated"], "device": rep["device"]["name"],
                     "verification": rep["verification"]}})


# --------------------------------------------------------------------------- KV routes

def _seed() -> int:
    env = os.environ.get("KV_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def _pool(kind, pages, bpp, page_size, gen):
    """A fresh random pool. "all-bytes": every byte random. "store-range": only
    bytes a KV store writes -- no fp8 NaN code (0x7F/0xFF; stores clamp to 448)
    and scale bytes 0 or 10..254, whose products are bf16-normal, so exact."""
    import torch
    pool = torch.randint(0, 256, (pages, bpp), dtype=torch.uint8, generator=gen)
    if kind == "store-range":
        data = pool[:, :page_size * 576].view(pages, page_size, 576)[:, :, :448]
        data[(data & 0x7F) == 0x7F] &= 0xFE
        scales = pool[:, page_size * 576:page_size * 584].view(pages, page_size, 8)[:, :, :7]
        low = (scales >= 1) & (scales < 10)
        scales[low] = torch.randint(10, 255, (int(low.sum()),), dtype=torch.uint8, generator=gen)
        scales[scales == 255] = 254
    return pool


def _dequant_checks(gen):
    import torch
    from sglang.kernels.ops.attention.dsv4 import dequant_k_cache as dq
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    # SGLang imports its attention backend lazily: it binds whatever is routed then.
    import sglang.srt.layers.attention.deepseek_v4_backend as backend
    checks = []
    for kind in ("store-range", "all-bytes"):
        for page_size, n, index_dtype in ((4, 37, torch.int64), (64, 45, torch.int32)):
            bpp = -(-page_size * 584 // 576) * 576
            pages = 5
            pool = _pool(kind, pages, bpp, page_size, gen)
            ids = torch.randint(0, pages * page_size, (n,), generator=gen).to(index_dtype)
            want = dequantize_k_cache_paged_ref(pool, ids, page_size).view(torch.int16)
            got = dq.dequantize_k_cache_paged_dsv4(pool, ids, page_size).view(torch.int16)
            got_be = backend.dequantize_k_cache_paged_dsv4(pool.view(torch.bfloat16), ids, page_size)
            work = torch.full((n + 3, 1, 512), float("nan"), dtype=torch.bfloat16)
            got_out = backend.dequantize_k_cache_paged_dsv4(pool, ids, page_size, out=work[2:2 + n])
            # Where bits differ: both NaN, or a zero/subnormal bf16 on either side?
            nan_w = ((want & 0x7F80) == 0x7F80) & ((want & 0x7F) != 0)
            nan_g = ((got & 0x7F80) == 0x7F80) & ((got & 0x7F) != 0)
            tiny = ((want & 0x7F80) == 0) | ((got & 0x7F80) == 0)
            differ = got != want
            checks.append({
                "pool": kind, "page_size": page_size, "n": n, "index_dtype": str(index_dtype),
                "identical": bool(torch.equal(got, want)),
                "differing": int(differ.sum()),
                "differing_not_nan_or_subnormal": int((differ & ~(nan_w & nan_g) & ~tiny).sum()),
                "backend_binding_identical": bool(torch.equal(got_be.view(torch.int16), got)),
                "out_slice_identical": bool(torch.equal(work[2:2 + n].view(torch.int16), got))
                                       and got_out.data_ptr() == work[2].data_ptr(),
            })
    return checks, {"backend_binding_routed": hasattr(backend.dequantize_k_cache_paged_dsv4, "__wrapped__"),
                    "backend_binding_is_source": backend.dequantize_k_cache_paged_dsv4 is dq.dequantize_k_cache_paged_dsv4}


def _store_check(gen) -> dict:
    import torch
    from sglang.kernels.ops.attention.dsv4 import attn
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    from capdispatch.backends.kv_cache import reference
    page_size, pages, n = 4, 6, 19
    bpp = -(-page_size * 584 // 576) * 576
    k = (torch.randn(n, 512, generator=gen) * 3).bfloat16()
    loc = torch.randperm(pages * page_size, generator=gen)[:n]
    pool = torch.zeros(pages, bpp, dtype=torch.uint8)
    attn.fused_store_cache(input=k, cache=pool, indices=loc, page_size=page_size, type="flashmla")
    want = torch.zeros_like(pool)
    reference.kv_quant(k, want, loc, page_size)
    back = dequantize_k_cache_paged_ref(pool, loc, page_size)[:, 0].float()
    nope = k[:, :448].float()
    return {"pool_identical_to_capdispatch_reference": bool(torch.equal(pool, want)),
            "rope_exact": bool(torch.equal(back[:, 448:].bfloat16().view(torch.int16),
                                           k[:, 448:].view(torch.int16))),
            "nope_max_rel_err": ((back[:, :448] - nope).abs().max() / nope.abs().max()).item()}


def kv(inp, gpu_id: int, tp_rank: int) -> None:
    _, logs = _rank(inp, gpu_id, tp_rank)
    import torch
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    state = _state(gpu_id)
    checks, binding = _dequant_checks(gen)
    out = {"seed": seed, "state": state, "dequant": checks, **binding}
    if state["routes"].get("kv_quant"):
        out["store"] = _store_check(gen)
    out["logs"] = logs
    emit(out)


# --------------------------------------------------------------------------- attention routes

def _stat_err(got, want) -> dict:
    """Max |difference| over finite entries, and whether the non-finite pattern agrees."""
    import torch
    g, w = got.float(), want.float()
    fin = torch.isfinite(w)
    same = bool(torch.equal(torch.isfinite(g), fin)) and bool(torch.equal(g[~fin], w[~fin]))
    err = (g[fin] - w[fin]).abs().max().item() if bool(fin.any()) else 0.0
    return {"same_nonfinite": same, "max_abs": err}


def _ids(gen, b, topk, cap):
    import torch
    x = torch.stack([torch.randperm(cap, generator=gen)[:topk] for _ in range(b)]).int()
    x[torch.rand(x.shape, generator=gen) < 0.2] = -1
    return x.view(b, 1, topk)


def _decode_check(gen) -> dict:
    """SGLang's DSv4 decode call, as deepseek_v4_backend makes it on a non-SM120 card:
    functools.partial(flash_mla_interface.flash_mla_with_kvcache, use_legacy=...) built
    when the backend is, called with keywords; SGLang keeps [0]."""
    import functools

    import torch
    from attention_checks import rel_err, v4_pool, v4_view
    from sglang.kernels.ops.attention import flash_mla_interface as fmi
    from sglang.srt.runtime_context import get_platform

    from capdispatch.backends.decode_mla import reference as R
    b, h, ps, epS = 3, 6, 16, 8
    q = (torch.randn(b, 1, h, 512, generator=gen) * 2).bfloat16()
    pool, _ = v4_pool(gen, 6, ps, "cpu")
    epool, _ = v4_pool(gen, 5, epS, "cpu")
    view, eview = v4_view(pool, ps), v4_view(epool, epS)
    idx, eidx = _ids(gen, b, 40, 6 * ps), _ids(gen, b, 24, 5 * epS)
    tl = torch.randint(0, 41, (b,), generator=gen, dtype=torch.int32)
    etl = torch.randint(0, 25, (b,), generator=gen, dtype=torch.int32)
    sink = torch.randn(h, generator=gen) * 2
    scale = 512 ** -0.5
    if get_platform().is_sm120:
        # The SM120 branch: imported at call time, keyword arguments only.
        from sglang.kernels.ops.attention.flash_mla_sm120 import flash_mla_with_kvcache_sm120 as site
        o = site(q=q, k_cache=view, head_dim_v=512, softmax_scale=scale, indices=idx, topk_length=tl,
                 attn_sink=sink, extra_k_cache=eview, extra_indices_in_kvcache=eidx, extra_topk_length=etl)
    else:
        site = fmi.flash_mla_with_kvcache
        call = functools.partial(fmi.flash_mla_with_kvcache, use_legacy=True)
        o = call(q=q, k_cache=view, head_dim_v=512, block_table=None, cache_seqlens=None,
                 tile_scheduler_metadata=fmi.get_mla_metadata()[0], softmax_scale=scale, is_fp8_kvcache=True,
                 indices=idx, topk_length=tl, attn_sink=sink, extra_k_cache=eview,
                 extra_indices_in_kvcache=eidx, extra_topk_length=etl)
    want = R.decode_mla(q, pool, idx, ps, scale, tl, sink, epool, eidx, epS, etl)
    return {"routed": hasattr(site, "__wrapped__"), "site": site.__name__,
            "out_rel_err": rel_err(o[0], want[0]), "lse": _stat_err(o[1], want[1]),
            "shape": list(o[0].shape), "finite": bool(torch.isfinite(o[0]).all())}


def _prefill_check(gen) -> dict:
    """SGLang's _forward_prefill_sparse call: flash_mla_sparse_fwd imported at call time."""
    import torch
    from sglang.kernels.ops.attention.flash_mla_interface import flash_mla_sparse_fwd

    from attention_checks import rel_err

    from capdispatch.backends.sparse_prefill import reference as R
    s, h, s_kv, topk = 7, 6, 50, 32
    q = (torch.randn(s, h, 512, generator=gen) * 2).bfloat16()
    kv = torch.randn(s_kv, 1, 512, generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s)]).int()
    idx[torch.rand(idx.shape, generator=gen) < 0.2] = -1
    idx = idx.unsqueeze(1)
    tl = torch.randint(0, topk + 1, (s,), generator=gen, dtype=torch.int32)
    sink = torch.randn(h, generator=gen) * 2
    out = {}
    for legacy in (True, False):
        o, ml, lse = flash_mla_sparse_fwd(q=q, kv=kv, indices=idx, sm_scale=512 ** -0.5, d_v=512,
                                          attn_sink=sink, topk_length=tl, use_legacy=legacy)
        wo, wml, wlse = R.sparse_prefill(q, kv, idx, 512 ** -0.5, 512, sink, tl, use_legacy=legacy)
        out[f"legacy={legacy}"] = {"out_rel_err": rel_err(o, wo), "max_logits": _stat_err(ml, wml),
                                   "lse": _stat_err(lse, wlse)}
    return out


def _indexer_check(gen) -> dict:
    """dsv4/indexer.py under the rank's switches: fn = fp8_paged_mqa_logits_torch (a module
    global read at call time), called as run_paged_indexer calls it."""
    import torch
    import sglang.srt.layers.attention.dsv4.indexer as I
    from sglang.srt.environ import envs

    from capdispatch.backends.indexer import reference as R
    B, H, P = 4, 64, 9
    q = torch.randn(B, 1, H, 128, generator=gen).to(torch.float8_e4m3fn)
    codes, scales = R.quantize_index_k(torch.randn(P, 64, 128, generator=gen))
    kv = R.pack_index_k(codes, scales)
    w = torch.randn(B, H, generator=gen)
    lens = torch.randint(1, 3 * 64, (B,), generator=gen, dtype=torch.int32)
    table = torch.stack([torch.randperm(P, generator=gen)[:3] for _ in range(B)]).int()
    from sglang.srt.runtime_context import get_platform
    site = I.fp8_paged_mqa_logits_torch_sm120 if get_platform().is_sm120 else I.fp8_paged_mqa_logits_torch
    picked = {"torch_switch": envs.SGLANG_FP8_PAGED_MQA_LOGITS_TORCH.get(),
              "tilelang_switch": envs.SGLANG_OPT_USE_TILELANG_INDEXER.get(),
              "routed": hasattr(site, "__wrapped__"), "site": site.__name__}
    got = site(q, kv, w, lens, table, None, 3 * 64, False)
    want = R.fp8_paged_mqa_logits(q, kv, w, lens, table, None, 3 * 64)
    sg = getattr(site, "__wrapped__", site)(q, kv, w, lens, table, None, 3 * 64, False)
    valid = torch.arange(3 * 64).unsqueeze(0) < lens.unsqueeze(1)
    scale = want[valid].abs().max().item()
    return {**picked, "shape": list(got.shape),
            "max_abs_vs_reference": (got[valid] - want[valid]).abs().max().item() / scale,
            "masked_minus_inf": bool((got[~valid] == float("-inf")).all()),
            # SGLang's own torch version stages in bf16: a looser agreement.
            "max_abs_vs_sglang_torch": (got[valid] - sg[valid].float()).abs().max().item() / scale}


def attn(inp, gpu_id: int, tp_rank: int) -> None:
    _, logs = _rank(inp, gpu_id, tp_rank)
    import torch
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    out = {"seed": seed, "state": _state(gpu_id)}
    for name, check in (("decode", _decode_check), ("prefill", _prefill_check), ("indexer", _indexer_check)):
        if name == "prefill" and out["state"]["routes"].get("sparse_prefill") is None:
            continue            # SGLang calls no sparse-prefill site here (SM120)
        try:
            out[name] = check(gen)
        except Exception as exc:       # reported, so the test names what failed
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    out["logs"] = logs
    emit(out)


# --------------------------------------------------------------------------- served form

def _bound(st) -> dict:
    """Per routed op, the kernel as installed: per bucket the backend, and whether it is
    capdispatch's kernel without argument checks ("unchecked"), with them ("checked"),
    or SGLang's own call ("sglang": the dispatcher's pick is None)."""
    import capdispatch as cd
    from capdispatch import extend
    from capdispatch.adapters.sglang import routes
    from capdispatch.backends.torch_ops import without_checks
    reg = extend.registry.builtin()
    out = {}
    for op in st.inputs.ops:
        fn = routes.kernel(op, st.key)
        if fn is None:
            continue

        def how(f, backend):
            if f is None:
                return "sglang"
            checked = reg.backend(op, backend).load()
            return "unchecked" if f is without_checks(checked) and f is not checked else "checked"
        names = getattr(fn, "buckets", None)
        if names is None:
            out[op] = {"dispatcher": False, "backend": st.choices[op].backend, "how": how(fn, st.choices[op].backend)}
            continue
        rows, lower = [], 0
        for upper, backend in names:
            n = upper if upper is not None else lower + 1
            rows.append([upper, backend, how(fn.pick(n), backend)])
            lower = upper if upper is not None else lower
        out[op] = {"dispatcher": True, "name": fn.__name__, "buckets": rows, "keeps": fn.keeps}
    return out


def _report_json(st):
    path = st.report
    if path is None:
        return None
    with open(path) as f:
        return {"path": path, "body": json.load(f)}


def _decode_spy(gen) -> dict:
    """SGLang's decode call (as _decode_check makes it) at 1 and 3 tokens, with FlashMLA's
    kernel replaced by a spy that records the schedule object it receives; then the same
    call with capdispatch's flashmla adapter installed at the route for the rank's device."""
    import functools

    import torch
    from attention_checks import rel_err, v4_pool, v4_view
    from sglang.kernels.ops.attention import flash_mla_interface as fmi

    import capdispatch as cd
    import flash_mla
    from capdispatch.adapters.sglang import rank as hooks
    from capdispatch.adapters.sglang import routes
    from capdispatch.backends.decode_mla import reference as R
    seen = []

    def spy(q, tile_scheduler_metadata, **kw):
        seen.append({"sched": tile_scheduler_metadata, "q": list(q.shape)})
        b, s_q, h, _ = q.shape
        return torch.zeros(b, s_q, h, 512, dtype=torch.bfloat16), torch.zeros(b, h, s_q)
    flash_mla.flash_mla_with_kvcache = spy
    h, ps = 6, 16
    pool, _ = v4_pool(gen, 6, ps, "cpu")
    view = v4_view(pool, ps)
    call = functools.partial(fmi.flash_mla_with_kvcache, use_legacy=True)
    out = {"routed": hasattr(fmi.flash_mla_with_kvcache, "__wrapped__")}

    def decode(b):
        q = (torch.randn(b, 1, h, 512, generator=gen) * 2).bfloat16()
        # 64 ids per query, int32: FlashMLA's alignment, which the adapter takes as it is without checks.
        idx = _ids(gen, b, 64, 6 * ps)
        tl = torch.randint(0, 65, (b,), generator=gen, dtype=torch.int32)
        sched = fmi.get_mla_metadata()[0]
        before = len(seen)
        o = call(q=q, k_cache=view, head_dim_v=512, block_table=None, cache_seqlens=None,
                 tile_scheduler_metadata=sched, softmax_scale=512 ** -0.5, is_fp8_kvcache=True,
                 indices=idx, topk_length=tl)
        want = R.decode_mla(q, pool, idx, ps, 512 ** -0.5, tl)
        got = seen[before:]
        return {"library_calls": len(got), "same_schedule": [g["sched"] is sched for g in got],
                "library_q": [g["q"] for g in got], "out_rel_err": rel_err(o[0], want[0]) if not got else None}
    out["tokens_1"] = decode(1)
    out["tokens_3"] = decode(3)
    # capdispatch's flashmla adapter at the same route (what the rank binds wherever FlashMLA
    # runs as capdispatch's kernel): SGLang's schedule reaches the library through it.
    st = hooks._RANKS[next(iter(hooks._RANKS))]
    res = cd.resolve("decode_mla", st.spec, selections=["decode_mla=flashmla"], assume_libs=["sgl-flash-mla"])
    saved = routes.kernel("decode_mla", st.key)
    routes._KERNELS["decode_mla"][st.key] = cd.bind_resolution(res, checks=False)
    try:
        out["adapter"] = decode(3)
    finally:
        routes._KERNELS["decode_mla"][st.key] = saved
    return out


def _break_route(tp_rank: int) -> None:
    """SCENARIO_BREAK=RANK:OP: on that rank OP's route install fails, as where SGLang's
    module does not import (the rank then reports the op, and the group learns it)."""
    spec = os.environ.get("SCENARIO_BREAK")
    if not spec or int(spec.split(":")[0]) != tp_rank:
        return
    op = spec.split(":")[1]
    from capdispatch.adapters.sglang import routes
    real = routes.install

    def install(route, kernel_fn, device_key, backend=None):
        if route.op == op:
            return f"{route.target} cannot be imported here (scenario)"
        return real(route, kernel_fn, device_key, backend)
    routes.install = install


def served(inp, gpu_id: int, tp_rank: int, port: int, modes) -> None:
    _break_route(tp_rank)
    sa, logs = _rank(inp, gpu_id, tp_rank)
    import torch
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel

    from capdispatch.adapters.sglang import rank as hooks
    from capdispatch.dispatch.agreement import AgreementError
    st = hooks._RANKS[gpu_id]
    out = {"configure": {"state": _state(gpu_id), "logs": logs, "report": _report_json(st)}, "agreements": []}
    ps.init_distributed_environment(world_size=get_parallel().tp_size, rank=tp_rank, local_rank=tp_rank,
                                    backend="gloo", timeout=120,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(backend="gloo")
    gen = torch.Generator().manual_seed(_seed())
    for policy in modes:
        if policy == "-":
            os.environ.pop("CAPDISPATCH_POLICY", None)
        else:
            os.environ["CAPDISPATCH_POLICY"] = policy
        logs = capture_logs()
        error = None
        try:
            hooks.after_parallel_ready(None, server_args=sa, device="cpu", dist_port=port)
        except AgreementError as exc:
            error = str(exc)
        st = hooks._RANKS[gpu_id]
        entry = {"policy": os.path.basename(policy), "error": error, "logs": logs, "state": _state(gpu_id),
                 "bound": _bound(st), "report": _report_json(st)}
        if "H200" in st.spec.name and not os.environ.get("SCENARIO_BREAK"):
            entry["decode"] = _decode_spy(gen)
        out["agreements"].append(entry)
    emit(out)


def main(argv) -> None:
    name, rest = argv[0], argv[1:]
    if name == "launcher":
        launcher(rest[0])
    elif name == "version":
        version(rest[0], rest[1])
    elif name == "rank":
        rank(rest[0], int(rest[1]), int(rest[2]), int(rest[3]) if len(rest) > 3 else None,
             tuple(rest[4].split(",")) if len(rest) > 4 else ())
    elif name == "served":
        served(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), tuple(rest[4].split(",")))
    elif name == "knobs":
        knob_names()
    elif name == "kv":
        kv(rest[0], int(rest[1]), int(rest[2]))
    elif name == "attn":
        attn(rest[0], int(rest[1]), int(rest[2]))
    elif name == "emu":
        emu(rest[0], int(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"unknown scenario {name!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
