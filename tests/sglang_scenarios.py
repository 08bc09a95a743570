"""Scenarios the SGLang adapter tests run in fresh processes, against the real
SGLang package: its plugin loader and hook registry keep per-process state, and
SGLang itself spawns one process per rank. Each prints one line `RESULT <json>`.

  loader                          SGLang's load_plugins() finds and runs register()
  launch OUT.pkl -- ARGS...       prepare_server_args(ARGS) + resolve_once(); pickles the record
  rank IN.pkl GPU_ID TP_RANK      a scheduler process: publish, configure_scheduler_process
  kv_dequant IN.pkl GPU_ID TP_RANK   rank, then SGLang's V4 dequant vs its reference
  kv_store IN.pkl GPU_ID TP_RANK     rank, then SGLang's V4 store through the route
  version VERSION [-- ARGS...]    register() with a fake SGLang version, then a launch
  agree IN.pkl GPU_ID TP_RANK PORT   rank, then SGLang's TP group (gloo) and the agreement hook
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
    h = _Records()
    log = logging.getLogger("capdispatch")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    return h.items


def emit(obj) -> None:
    print("RESULT " + json.dumps(obj, default=repr), flush=True)


def _ours(hooks) -> bool:
    from capdispatch.adapters.sglang import rank, routes
    mine = {rank.after_configure, rank.after_parallel_ready, *routes.CALLS.values()}
    return any(h[1] in mine for h in hooks)


def loader() -> None:
    logs = capture_logs()
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins
    load_plugins()
    import sglang.srt.distributed.bootstrap as bootstrap
    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.plugins.hook_registry import HookRegistry

    import capdispatch.adapters.sglang as plugin
    from capdispatch.adapters.sglang import launch
    emit({
        "entry_points": [ep.value for ep in entry_points(group="sglang.srt.plugins")],
        "registered": plugin._done.get("result"),
        "again": plugin.register(),
        "resolution_hook": launch.resolution_hook in resolution_hooks._HOOKS.get(
            "handle_model_specific_adjustments", []),
        "hook_targets": sorted(t for t, hs in HookRegistry._hooks.items() if _ours(hs)),
        "configure_patched": hasattr(scheduler.configure_scheduler_process, "__wrapped__"),
        "parallel_patched": hasattr(bootstrap.init_parallel_runtime, "__wrapped__"),
        "logs": logs,
    })


def _launch(argv, out=None) -> dict:
    logs = capture_logs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args
    sa = prepare_server_args(argv)
    sa.resolve_once()
    if out:
        with open(out, "wb") as f:
            pickle.dump(sa, f)
    return {
        "fields": {f: resolution_result(sa, f) for f in FIELDS},
        "declared": [d for src, d in sa._resolved_overrides if src == "capdispatch"],
        "env": {k: os.environ.get(k) for k in KNOB_ENVS},
        "stash": getattr(sa, "_capdispatch", None),
        "logs": logs,
    }


def launch(out, argv) -> None:
    emit(_launch(argv, out))


def _rank(inp, gpu_id: int, tp_rank: int):
    """What SGLang's run_scheduler_process does before building the Scheduler."""
    logs = capture_logs()
    from sglang.srt.plugins import load_plugins
    load_plugins()
    with open(inp, "rb") as f:
        sa = pickle.load(f)
    from sglang.srt.runtime_context import SpawnRanks, publish
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank, dp_rank=None, gpu_id=gpu_id))
    import sglang.srt.managers.scheduler as scheduler
    scheduler.configure_scheduler_process(sa, gpu_id, display_tp_rank=tp_rank)
    return sa, logs


def _state(gpu_id: int) -> dict:
    from capdispatch.adapters.sglang import rank, routes
    st = rank._RANKS[gpu_id]
    out = {"device": st["spec"].to_dict(), "ops": list(st["ops"]),
           "choices": {op: {"backend": c.backend, "routed": c.routed, "why": c.why}
                       for op, c in st["choices"].items()},
           "routes": {}}
    for op in st["ops"]:
        fn = routes.kernel(op, st["key"])
        out["routes"][op] = None if fn is None else f"{fn.__module__}.{fn.__name__}"
    return out


def rank(inp, gpu_id: int, tp_rank: int) -> None:
    sa, logs = _rank(inp, gpu_id, tp_rank)
    import sglang.srt.layers.moe.moe_runner.deep_gemm_sm120 as dg120
    import sglang.srt.utils as utils_pkg
    from sglang.kernels.jit.utils import arch
    from sglang.srt.runtime_context import get_platform
    from sglang.srt.utils import common
    was_loaded = "sglang.srt.layers.attention.dsv4.metadata" in sys.modules
    import sglang.srt.layers.attention.dsv4.metadata as dsv4_metadata   # imported after the hook
    p = get_platform()
    jit = arch.get_jit_cuda_arch()
    emit({
        "state": _state(gpu_id),
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
        "logs": logs,
    })


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


def kv_dequant(inp, gpu_id: int, tp_rank: int) -> None:
    _, logs = _rank(inp, gpu_id, tp_rank)
    import torch
    from sglang.kernels.ops.attention.dsv4 import dequant_k_cache as dq
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    # The attention backend is imported lazily by SGLang: it binds whatever is routed.
    import sglang.srt.layers.attention.deepseek_v4_backend as backend
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    checks = []
    for kind in ("store-range", "all-bytes"):
        for page_size, n, index_dtype in ((4, 37, torch.int64), (64, 45, torch.int32)):
            bpp = -(-page_size * 584 // 576) * 576
            pages = 5
            pool = _pool(kind, pages, bpp, page_size, gen)
            ids = torch.randint(0, pages * page_size, (n,), generator=gen).to(index_dtype)
            want = dequantize_k_cache_paged_ref(pool, ids, page_size).view(torch.int16)
            got_src = dq.dequantize_k_cache_paged_dsv4(pool, ids, page_size).view(torch.int16)
            got_be = backend.dequantize_k_cache_paged_dsv4(pool.view(torch.bfloat16), ids, page_size)
            work = torch.full((n + 3, 1, 512), float("nan"), dtype=torch.bfloat16)
            got_out = backend.dequantize_k_cache_paged_dsv4(pool, ids, page_size, out=work[2:2 + n])
            # Where bits differ, are both NaN, or is either a zero/subnormal bf16?
            # (The Triton interpreter's numpy emulation gets those bits wrong.)
            nan_w = ((want & 0x7F80) == 0x7F80) & ((want & 0x7F) != 0)
            nan_g = ((got_src & 0x7F80) == 0x7F80) & ((got_src & 0x7F) != 0)
            tiny = ((want & 0x7F80) == 0) | ((got_src & 0x7F80) == 0)
            differ = got_src != want
            checks.append({
                "pool": kind, "page_size": page_size, "n": n, "index_dtype": str(index_dtype),
                "source_identical": bool(torch.equal(got_src, want)),
                "source_differing": int(differ.sum()),
                "differing_not_nan_or_subnormal": int((differ & ~(nan_w & nan_g) & ~tiny).sum()),
                "backend_identical": bool(torch.equal(got_be.view(torch.int16), want)),
                "out_identical": bool(torch.equal(work[2:2 + n].view(torch.int16), want))
                                 and got_out.data_ptr() == work[2].data_ptr(),
            })
    emit({"seed": seed, "checks": checks, "state": _state(gpu_id),
          "backend_binding_routed": hasattr(backend.dequantize_k_cache_paged_dsv4, "__wrapped__"),
          "same_object": backend.dequantize_k_cache_paged_dsv4 is dq.dequantize_k_cache_paged_dsv4,
          "logs": logs})


def kv_store(inp, gpu_id: int, tp_rank: int) -> None:
    _, logs = _rank(inp, gpu_id, tp_rank)
    import torch
    from sglang.kernels.ops.attention.dsv4 import attn
    from sglang.test.kernels.deepseek_v4.k_cache_reference import dequantize_k_cache_paged_ref

    from capdispatch.backends.kv_cache import reference
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    page_size, pages, n = 4, 6, 19
    bpp = -(-page_size * 584 // 576) * 576
    k = (torch.randn(n, 512, generator=gen) * 3).bfloat16()
    loc = torch.randperm(pages * page_size, generator=gen)[:n]
    pool = torch.zeros(pages, bpp, dtype=torch.uint8)
    attn.fused_store_cache(input=k, cache=pool, indices=loc, page_size=page_size, type="flashmla")
    want = torch.zeros_like(pool)
    reference.kv_quant(k, want, loc, page_size)
    back = dequantize_k_cache_paged_ref(pool, loc, page_size)[:, 0].float()
    rel = ((back[:, :448] - k[:, :448].float()).abs().max() / k[:, :448].float().abs().max()).item()
    emit({"seed": seed, "state": _state(gpu_id),
          "pool_identical_to_capdispatch_reference": bool(torch.equal(pool, want)),
          "rope_exact": bool(torch.equal(back[:, 448:].bfloat16().view(torch.int16),
                                         k[:, 448:].view(torch.int16))),
          "nope_max_rel_err": rel, "logs": logs})


def version(v, argv) -> None:
    logs = capture_logs()
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.plugins.hook_registry import HookRegistry

    import capdispatch.adapters.sglang as plugin
    env_before = dict(os.environ)
    first = plugin.register(sglang_version=v)
    again = plugin.register()
    result = {"first": first, "again": again,
              "hook_targets": sorted(t for t, hs in HookRegistry._hooks.items() if _ours(hs)),
              "resolution_hooks": sorted(resolution_hooks._HOOKS),
              "env_changed": sorted(k for k in set(os.environ) | set(env_before)
                                    if os.environ.get(k) != env_before.get(k))}
    if argv:
        launched = _launch(argv)
        result.update(launch={k: launched[k] for k in ("fields", "declared", "env", "stash")})
    result["logs"] = logs
    emit(result)


def agree(inp, gpu_id: int, tp_rank: int, port: int) -> None:
    sa, logs = _rank(inp, gpu_id, tp_rank)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel
    world = get_parallel().tp_size
    ps.init_distributed_environment(world_size=world, rank=tp_rank, local_rank=tp_rank,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}",
                                    backend="gloo", timeout=60)
    ps.initialize_model_parallel(backend="gloo")
    from capdispatch.adapters.sglang import rank as rank_hooks
    from capdispatch.dispatch.agreement import AgreementError
    error = None
    try:
        # What the AFTER hook on init_parallel_runtime does once the groups exist.
        rank_hooks.after_parallel_ready(None, server_args=sa, device="cpu", dist_port=port)
    except AgreementError as exc:
        error = str(exc)
    st = rank_hooks._RANKS[gpu_id]
    plan = st["agreed"]
    emit({"error": error, "state": _state(gpu_id),
          "group": None if plan is None else {op: {d: r.backend for d, r in g.per_device.items()}
                                              for op, g in plan.ops.items()},
          "logs": logs})


def main(argv) -> None:
    name, rest = argv[0], argv[1:]
    passthrough = []
    if "--" in rest:
        i = rest.index("--")
        rest, passthrough = rest[:i], rest[i + 1:]
    if name == "loader":
        loader()
    elif name == "launch":
        launch(rest[0], passthrough)
    elif name in ("rank", "kv_dequant", "kv_store"):
        globals()[name](rest[0], int(rest[1]), int(rest[2]))
    elif name == "version":
        version(rest[0], passthrough)
    elif name == "agree":
        agree(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))
    else:
        raise SystemExit(f"unknown scenario {name!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
