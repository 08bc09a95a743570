"""The SGLang adapter's scenarios against SGLang 0.5.17's real modules, in fresh
processes whose path puts 0.5.17 first (tests/sglang_releases.py; the prelude adds
the 0.5.17 stand-ins). Each prints one line `RESULT <json>`.

  launcher CASES.json    load_plugins() as 0.5.17's launcher does; check the knob
                         map's names against 0.5.17; then, per case, 0.5.17's
                         prepare_server_args(argv) (which resolves: ServerArgs is a
                         dataclass whose __post_init__ runs the wrapped step) or
                         ServerArgs(**kwargs) as Engine builds it, pickling when asked
  rank IN.pkl GPU_ID TP_RANK PORT
                         a scheduler process as 0.5.17's run_scheduler_process: load_plugins,
                         the real configure_scheduler_process (before publish), publish;
                         then SGLang's TP group over gloo and the plugin's AFTER hook as
                         init_torch_distributed calls it (ps=, then is_draft_worker=True);
                         with SCENARIO_CALLS=1, then SGLang 0.5.17's KV and attention
                         call targets against references; SCENARIO_ASSUME_LIBS=NAME==V,...:
                         the rank's machine has those libraries (its inventory, as
                         --assume-lib says it)
  emu IN.pkl GPU_ID TP_RANK
                         a scheduler process whose device entry emulates a card: its state,
                         facts and report, or the rank's refusal
  plan ARGS...           `dispatch sglang plan ARGS` in this process
"""
from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_scenarios import _inputs_json, _stash_json, _stashed, _ours, _registries, _state, capture_logs, check_knob_names, emit  # noqa: E402,I001

FIELDS = ("kv_cache_dtype", "page_size", "attention_backend", "moe_runner_backend", "tp_size")
ENVS = ("SGLANG_DSV4_KV_LAYOUT", "SGLANG_OPT_USE_TILELANG_INDEXER", "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH",
        "SGLANG_OPT_USE_FUSED_STORE_CACHE")


def _launch_case(case: dict, baseline: dict) -> dict:
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    os.environ.clear()
    os.environ.update(baseline)
    os.environ.update(case.get("env", {}))
    logs = capture_logs()
    try:
        sa = ServerArgs(**case["kwargs"]) if "kwargs" in case else prepare_server_args(case["argv"])
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "logs": logs}
    if case.get("pickle"):
        with open(case["pickle"], "wb") as f:
            pickle.dump(sa, f)
    return {
        "fields": {f: getattr(sa, f) for f in FIELDS},
        "declared": [d for src, d in sa._resolved_overrides if src == "capdispatch"],
        "materialized": bool(getattr(sa, "_declarations_materialized", False)),
        "env": {k: os.environ.get(k) for k in ENVS},
        "stash": _inputs_json(_stashed(sa)),
        "stash_json": _stash_json(sa),
        "logs": logs,
    }


def launcher(cases_path) -> None:
    import json
    logs = capture_logs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang.srt.distributed.bootstrap as bootstrap
    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import ServerArgs

    import capdispatch
    import capdispatch.adapters.sglang as plugin
    step = "sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments"
    out = {
        "sglang": __import__("sglang").__version__, "capdispatch": capdispatch.__file__,
        "registered": plugin._done.get("result"), "again": plugin.register(),
        "step_patched": hasattr(ServerArgs._handle_model_specific_adjustments, "__wrapped__"),
        "step_ours": _ours(HookRegistry._hooks.get(step, ())),
        "configure_patched": hasattr(scheduler.configure_scheduler_process, "__wrapped__"),
        "group_patched": hasattr(bootstrap.init_torch_distributed, "__wrapped__"),
        "load_logs": logs, **_registries(),
    }
    with open(cases_path) as f:
        cases = json.load(f)
    baseline = dict(os.environ)
    out["cases"] = [_launch_case(c, baseline) for c in cases]
    out["knob_name_problems"] = check_knob_names()
    emit(out)


# --------------------------------------------------------------------------- ranks

def _facts() -> dict:
    import sglang.srt.utils as utils_pkg
    from sglang.kernels.jit.utils import arch
    from sglang.srt.utils import common
    loaded = "sglang.srt.layers.attention.deepseek_v4_backend" in sys.modules
    import sglang.srt.layers.attention.deepseek_v4_backend as backend     # imported after the hook
    import sglang.srt.layers.quantization.fp8_utils as fp8_utils
    import sglang.srt.models.deepseek_common.utils as ds_utils
    jit = arch.get_jit_cuda_arch()
    return {
        "probes": {k: getattr(common, k)() for k in ("is_sm90_supported", "is_sm100_supported",
                                                      "is_sm120_supported", "is_blackwell_supported",
                                                      "get_device_sm")},
        "copies": {"sglang.srt.utils.is_sm120_supported": utils_pkg.is_sm120_supported(),
                   "deepseek_v4_backend._is_sm120": backend._is_sm120,
                   "deepseek_v4_backend_imported_before": loaded,
                   "fp8_utils._is_sm120_supported": fp8_utils._is_sm120_supported,
                   "deepseek_common.utils._device_sm": ds_utils._device_sm},
        "jit_arch": [jit.major, jit.minor, jit.suffix],
    }


def _calls(gen) -> dict:
    """SGLang 0.5.17's own call targets, called as its DSv4 code calls them, on a routed rank."""
    import torch
    from attention_checks import rel_err, v4_pool, v4_view
    from sglang.kernels.ops.attention.dsv4 import dequant_k_cache as dq

    import sgl_kernel.flash_mla as fm
    from capdispatch.backends.decode_mla import reference as DR
    from capdispatch.backends.sparse_prefill import reference as PR
    from sglang_scenarios import _ids, _stat_err
    out = {}
    # dequant: the renamed target, keyword page_size/out as _forward_prefill_sparse passes them.
    page_size, n = 64, 45
    bpp = -(-page_size * 584 // 576) * 576
    pool = torch.randint(0, 256, (5, bpp), dtype=torch.uint8, generator=gen)
    data = pool[:, :page_size * 576].view(5, page_size, 576)[:, :, :448]
    data[(data & 0x7F) == 0x7F] &= 0xFE           # no fp8 NaN codes
    scales = pool[:, page_size * 576:page_size * 584].view(5, page_size, 8)[:, :, :7]
    scales[scales < 10] = 10
    scales[scales == 255] = 254
    ids = torch.randint(0, 5 * page_size, (n,), generator=gen).int()
    want = dq.dequantize_k_cache_paged_ref(pool, ids, page_size)
    got = dq.dequantize_k_cache_paged(pool, ids, page_size=page_size)
    out["dequant"] = {"routed": hasattr(dq.dequantize_k_cache_paged, "__wrapped__"),
                      "identical": bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))}
    # decode: `from sgl_kernel.flash_mla import flash_mla_with_kvcache` at call time, keywords.
    b, h, ps, epS = 3, 6, 16, 8
    q = (torch.randn(b, 1, h, 512, generator=gen) * 2).bfloat16()
    kpool, _ = v4_pool(gen, 6, ps, "cpu")
    epool, _ = v4_pool(gen, 5, epS, "cpu")
    idx, eidx = _ids(gen, b, 40, 6 * ps), _ids(gen, b, 24, 5 * epS)
    tl = torch.randint(0, 41, (b,), generator=gen, dtype=torch.int32)
    etl = torch.randint(0, 25, (b,), generator=gen, dtype=torch.int32)
    sink = torch.randn(h, generator=gen) * 2
    from sgl_kernel.flash_mla import flash_mla_with_kvcache
    o = flash_mla_with_kvcache(q=q, k_cache=v4_view(kpool, ps), block_table=None, cache_seqlens=None, head_dim_v=512,
                               tile_scheduler_metadata=fm.get_mla_metadata()[0], softmax_scale=512 ** -0.5,
                               is_fp8_kvcache=True, indices=idx, topk_length=tl, attn_sink=sink,
                               extra_k_cache=v4_view(epool, epS), extra_indices_in_kvcache=eidx,
                               extra_topk_length=etl)
    w = DR.decode_mla(q, kpool, idx, ps, 512 ** -0.5, tl, sink, epool, eidx, epS, etl)
    out["decode"] = {"routed": hasattr(flash_mla_with_kvcache, "__wrapped__"), "out_rel_err": rel_err(o[0], w[0]),
                     "lse": _stat_err(o[1], w[1])}
    # sparse prefill: 0.4.5's lse is base-2 (FlashMLA's legacy statistics).
    s, s_kv, topk = 7, 50, 32
    q = (torch.randn(s, h, 512, generator=gen) * 2).bfloat16()
    kv = torch.randn(s_kv, 1, 512, generator=gen).bfloat16()
    pidx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s)]).int().unsqueeze(1)
    ptl = torch.randint(0, topk + 1, (s,), generator=gen, dtype=torch.int32)
    from sgl_kernel.flash_mla import flash_mla_sparse_fwd
    o, ml, lse = flash_mla_sparse_fwd(q=q, kv=kv, indices=pidx, sm_scale=512 ** -0.5, d_v=512, attn_sink=sink,
                                      topk_length=ptl)
    wo, wml, wlse = PR.sparse_prefill(q, kv, pidx, 512 ** -0.5, 512, sink, ptl, use_legacy=True)
    out["prefill"] = {"routed": hasattr(flash_mla_sparse_fwd, "__wrapped__"), "out_rel_err": rel_err(o, wo),
                      "max_logits": _stat_err(ml, wml), "lse": _stat_err(lse, wlse)}
    return out


def rank(inp, gpu_id: int, tp_rank: int, port: int) -> None:
    import random

    logs = capture_logs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    with open(inp, "rb") as f:
        sa = pickle.load(f)
    if os.environ.get("SCENARIO_ASSUME_LIBS"):
        import attrs
        from capdispatch.adapters.sglang import launch
        given = launch.stashed(sa)
        options = attrs.evolve(given.options, assume_libs=tuple(os.environ["SCENARIO_ASSUME_LIBS"].split(",")))
        launch.stash(sa, attrs.evolve(given, options=options))
    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.runtime_context import publish
    dp_rank = scheduler.configure_scheduler_process(sa, gpu_id, tp_rank, 0, 0, 0, 0, None, display_tp_rank=tp_rank)
    publish(sa, role="scheduler")
    out = {"dp_rank": dp_rank, "state": _state(gpu_id), "facts": _facts(), "logs": logs}
    import json
    from capdispatch.adapters.sglang import rank as ranks
    with open(ranks._RANKS[gpu_id].report) as f:
        written = json.load(f)
    out["report"] = {"ops": {op: {"canary": e["canary"], "why": e["why"], "action": e["action"]}
                             for op, e in written["ops"].items()},
                     "verification": written["verification"]}

    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.distributed.parallel_state_wrapper import ParallelState

    from capdispatch.adapters.sglang import rank as hooks
    tp_size = sa.tp_size
    ps.init_distributed_environment(world_size=tp_size, rank=tp_rank, local_rank=tp_rank, backend="gloo",
                                    timeout=120, distributed_init_method=f"tcp://127.0.0.1:{port}")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, backend="gloo")
    state = ParallelState.trivial(tp_rank=tp_rank, tp_size=tp_size, gpu_id=gpu_id)
    call = dict(server_args=sa, model_config=None, device="cpu", ps=state, dist_port=port, local_omp_cpuid=None)
    logs = capture_logs()
    hooks.after_parallel_ready(None, **call, is_draft_worker=False)
    st = hooks._RANKS[gpu_id]
    out["agreement"] = {"logs": logs, "ranks": list(st.agreement.ranks), "digest": st.agreement.digest,
                        "group": {op: {d: r.backend for d, r in g.per_device.items()}
                                  for op, g in st.agreed.ops.items()}}
    before = st.agreement
    logs = capture_logs()
    hooks.after_parallel_ready(None, **call, is_draft_worker=True)     # a draft worker: stands aside
    out["draft"] = {"logs": logs, "same_agreement": hooks._RANKS[gpu_id].agreement is before}
    if os.environ.get("SCENARIO_CALLS"):
        import torch
        seed = random.SystemRandom().randrange(2**31)
        out["seed"] = seed
        out["calls"] = _calls(torch.Generator().manual_seed(seed))
    emit(out)


def emu(inp, gpu_id: int, tp_rank: int) -> None:
    """A scheduler process whose CAPDISPATCH_SGLANG_DEVICES entry emulates a card
    (`emu:NAME@sim:CARD`): its state, SGLang 0.5.17's facts and its report, or the refusal."""
    import json
    logs = capture_logs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    with open(inp, "rb") as f:
        sa = pickle.load(f)
    import sglang.srt.managers.scheduler as scheduler

    from capdispatch.adapters.sglang import report
    try:
        scheduler.configure_scheduler_process(sa, gpu_id, tp_rank, 0, 0, 0, 0, None, display_tp_rank=tp_rank)
    except Exception as exc:
        emit({"error": f"{type(exc).__name__}: {exc}"})
        return
    with open(report.report_path(gpu_id)) as f:
        rep = json.load(f)
    emit({"state": _state(gpu_id), "facts": _facts(), "logs": logs, "emulated": rep["emulated"]})


def plan(args) -> None:
    import contextlib
    import io
    buf = io.StringIO()
    from capdispatch.dispatch.cli import main
    with contextlib.redirect_stdout(buf):
        try:
            rc = main(["sglang", "plan", *args])
        except SystemExit as exc:
            rc = exc.code
    emit({"rc": rc, "stdout": buf.getvalue()})


def main(argv) -> None:
    name, rest = argv[0], argv[1:]
    if name == "launcher":
        launcher(rest[0])
    elif name == "rank":
        rank(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
    elif name == "plan":
        plan(rest)
    elif name == "emu":
        emu(rest[0], int(rest[1]), int(rest[2]))
    else:
        raise SystemExit(f"unknown scenario {name!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
