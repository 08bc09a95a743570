"""The MoE route inside the real SGLang 0.5.23, in ONE fresh process (importing
SGLang costs tens of seconds; SGLang allows re-publishing a process's config):

  moe MODEL_DIR [MODE,...]      (MODE: default, explicit, strict; see main)

1. SGLang's launcher: load_plugins, prepare_server_args + resolve_once for a
   DeepSeek-V4 launch with TP3 and EP3 on a simulated mixed rig
   (CAPDISPATCH_SGLANG_DEVICES), the platform facts of device 0 (an RTX 5090)
   installed through SGLang's override_platform, so SGLang's own DSv4 default
   picks moe_runner_backend=flashinfer_mxfp4 (`explicit`: the user sets it);
   the record is pickled and unpickled as SGLang's spawn does.
2. Per rank (gpu_id 0, 1, 2): SGLang's publish and configure_scheduler_process
   (the plugin's rank hook), then SGLang's real FusedMoE with an Fp8Config
   holding MXFP4 experts, as DeepSeek-V4 builds it (E=12 global experts, 4 per
   rank under EP3, H=256, I=128, top-k 6, swiglu_limit 10, routed scaling
   factor 1.5), its real weight_loader fed a random checkpoint (global expert
   ids, [gate, up, down] tensors and E8M0 scales), process_weights_after_loading
   and forward on random tokens with random global top-k routes. The output of
   a routed rank is compared with capdispatch's torch reference on that rank's
   experts (global ids mapped to local, -1 where EP put the expert elsewhere).

Stand-ins for CUDA-only pieces (each is SGLang asking "is there a GPU"):
SGLang's dispatcher asks get_device() where to put its EP id map (here: the
CPU); Mxfp4FlashinferCutlassMoEMethod asks is_flashinfer_available(), which is
False without CUDA; the layer asks the TP group (not built: one process) only
whether symmetric memory is on. Prints `RESULT <json>`.
"""
from __future__ import annotations

import os
import pickle
import random
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_prelude  # noqa: E402,F401  (before anything imports sglang)
from sglang_scenarios import capture_logs, emit  # noqa: E402

E_GLOBAL, EP, H, I, TOPK, TOKENS = 12, 3, 256, 128, 6, 5
LIMIT, SCALING = 10.0, 1.5
DEVICE = "cpu"
# DeepSeek-V4 per rank: 64 local experts (128 under EP2), H 4096, I 2048, top-k 6.
DSV4_SHAPE = {"E_GLOBAL": 128, "EP": 2, "H": 4096, "I": 2048, "TOPK": 6, "TOKENS": 64, "DEVICE": "cuda"}


def use_shape(**shape) -> None:
    """Switch this module's problem (the `gpu` mode and the benchmark use DSV4_SHAPE)."""
    globals().update(shape)


def _seed() -> int:
    env = os.environ.get("MOE_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def _launch(model_dir: str, mode: str):
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args
    from importlib.metadata import entry_points
    if not [e for e in entry_points(group="sglang.srt.plugins") if e.name == "capdispatch"]:
        raise SystemExit("capdispatch's SGLang plugin is not registered in this environment: it is an "
                         "entry point, so capdispatch must be installed (pip install --no-deps -e .), "
                         "not only importable")
    load_plugins()
    argv = ["--model-path", model_dir, "--skip-tokenizer-init", "--device", "cuda",
            "--tp-size", str(EP), "--ep-size", str(EP)]
    if mode in ("explicit", "strict"):
        argv += ["--moe-runner-backend", "flashinfer_mxfp4"]
    sa = prepare_server_args(argv)
    if DEVICE == "cpu":
        # The launcher's facts are device 0's: an RTX 5090 (SGLang's DSv4 rule reads them).
        with override_platform(is_sm120=True, is_blackwell=True, device_sm=120, device_capability=(12, 0)):
            sa.resolve_once()
    else:
        sa.resolve_once()
    from sglang.srt.arg_groups.overrides import resolution_result
    return pickle.loads(pickle.dumps(sa)), str(resolution_result(sa, "moe_runner_backend"))


def _checkpoint(gen):
    """Random checkpoint tensors per global expert (DeepSeek-V4 names and dtypes:
    int8 packed e2m1 pairs, float8_e8m0fnu scales), never all zero."""
    import torch

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(torch.int8)

    def scales(*shape):
        return torch.randint(119, 126, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)

    return [{"gate_proj": (codes(I, H // 2), scales(I, H // 32)),
             "up_proj": (codes(I, H // 2), scales(I, H // 32)),
             "down_proj": (codes(H, I // 2), scales(H, I // 32))} for _ in range(E_GLOBAL)]


def _layer(rank: int):
    import torch
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    qc = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128], is_fp4_experts=True)
    qc.is_dsv4_fp4_experts = True           # what SGLang's model loader sets for DSv4
    dev = torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")
    with dev:                               # as SGLang's loader builds the model on the rank's device
        return _fused_moe(FusedMoE, qc)


def _fused_moe(FusedMoE, qc):
    import torch
    return FusedMoE(num_experts=E_GLOBAL, hidden_size=H, intermediate_size=I, layer_id=0, top_k=TOPK,
                    params_dtype=torch.bfloat16, quant_config=qc, prefix="model.layers.0.mlp.experts",
                    activation="silu", routed_scaling_factor=SCALING, swiglu_limit=LIMIT,
                    reduce_results=False)


def _load(layer, ckpt) -> None:
    """What DeepseekV4ForCausalLM.load_weights does for expert tensors: SGLang's
    expert params mapping, the layer's weight_loader with GLOBAL expert ids."""
    params = dict(layer.named_parameters())
    for param_name, weight_name, expert_id, shard_id in type(layer).make_expert_params_mapping(
            ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
            ckpt_up_proj_name="up_proj", num_experts=E_GLOBAL):
        proj = weight_name.split(".")[-2]
        w, s = ckpt[expert_id][proj]
        for suffix, tensor in (("weight", w), ("weight_scale_inv", s)):
            param = params[param_name.rsplit(".", 1)[-1] + suffix]
            param.weight_loader(param, tensor, weight_name + suffix, shard_id=shard_id, expert_id=expert_id)


def _reference(ckpt, rank, x, topk_weights, topk_ids):
    import torch

    from capdispatch.backends.moe import MoeWeights
    from capdispatch.backends.moe.reference import moe
    el = E_GLOBAL // EP
    mine = range(rank * el, (rank + 1) * el)
    dev = x.device
    w13 = torch.stack([torch.cat([ckpt[e]["gate_proj"][0], ckpt[e]["up_proj"][0]]) for e in mine]).to(dev)
    s13 = torch.stack([torch.cat([ckpt[e]["gate_proj"][1], ckpt[e]["up_proj"][1]]) for e in mine]).to(dev)
    w2 = torch.stack([ckpt[e]["down_proj"][0] for e in mine]).to(dev)
    s2 = torch.stack([ckpt[e]["down_proj"][1] for e in mine]).to(dev)
    local = torch.where((topk_ids >= rank * el) & (topk_ids < (rank + 1) * el), topk_ids - rank * el, -1)
    ref = moe(x, MoeWeights(w13, s13, w2, s2, swiglu_limit=LIMIT), topk_weights, local.to(torch.int32))
    return ref, local


def _routing(gen, tokens=None):
    """DeepSeek-V4's final routes: K distinct global experts per token, weights
    renormalised over the top-k and times the routed scaling factor (what
    SGLang's TopK hands a method with fuse_routed_scaling_factor_in_topk)."""
    import torch
    t = TOKENS if tokens is None else tokens
    ids = torch.rand(t, E_GLOBAL, generator=gen).topk(TOPK, dim=1).indices.to(torch.int32)
    w = torch.rand(t, TOPK, generator=gen) + 0.05
    return (w / w.sum(dim=1, keepdim=True) * SCALING).float().to(DEVICE), ids.to(DEVICE)


def _poisoning(method, seen: dict):
    """Wrap the layer's bound kernel: it writes into a NaN-filled output, every
    element of which must be overwritten."""
    import torch
    kernel = method.kernel

    def run(x, weights, topk_weights, topk_ids, out=None):
        buf = torch.full_like(x, float("nan"))
        got = kernel(x, weights, topk_weights, topk_ids, out=buf)
        seen.update(same_buffer=got is buf, all_written=bool(torch.isfinite(buf).all()),
                    ids_min=int(topk_ids.min()), masked_routes=int((topk_ids < 0).sum()))
        return got

    method.kernel = run


def _rank(sa, rank: int, gen, ckpt, run: bool = True, load: bool = False) -> dict:
    import sglang.srt.layers.moe.token_dispatcher.standard as standard
    import sglang.srt.layers.quantization.mxfp4_flashinfer_cutlass_moe as fi_cutlass
    import sglang.srt.managers.scheduler as scheduler
    from sglang.srt.runtime_context import SpawnRanks, get_exec, get_platform, publish

    from capdispatch.adapters.sglang import rank as hooks
    from capdispatch.adapters.sglang import routes
    from capdispatch.adapters.sglang.moe_method import CapdispatchMxfp4MoEMethod
    if DEVICE == "cpu":
        standard.get_device = lambda device_id=None: "cpu"      # stand-in: see the module doc
        fi_cutlass.is_flashinfer_available = lambda: True        # stand-in: see the module doc
    logs = capture_logs()
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank, dp_rank=None, gpu_id=rank))
    try:
        scheduler.configure_scheduler_process(sa, rank, display_tp_rank=rank)
    except Exception as exc:      # strict: the plugin refuses on this rank
        return {"error": f"{type(exc).__name__}: {exc}", "logs": logs}
    # Scheduler.init_moe_gemm_config: the process's MoE runner flag, from the launch's value.
    from sglang.srt.layers.moe.utils import initialize_moe_config
    initialize_moe_config()
    st = hooks._RANKS[rank]
    c = st.choices["moe"]
    out = {"device": st.spec.name, "backend": c.backend, "routed": c.routed, "why": c.why,
           "route": None, "platform_is_sm120": bool(get_platform().is_sm120),
           "moe_runner_backend": str(get_exec().moe.moe_runner_backend), "logs": logs}
    fn = routes.kernel("moe", st.key)
    out["route"] = None if fn is None else fn.__name__      # the op=backend custom op's name
    layer = _layer(rank)
    method = layer.quant_method
    out["method"] = type(method).__name__
    out["method_is_capdispatch"] = isinstance(method, CapdispatchMxfp4MoEMethod)
    out["moe_ep_rank"] = layer.moe_ep_rank
    out["num_local_experts"] = layer.num_local_experts
    out["fuses_routed_scaling_in_topk"] = bool(layer.should_fuse_routed_scaling_factor_in_topk)
    out["scale_dtype"] = str(layer.w13_weight_scale_inv.dtype)
    if not out["method_is_capdispatch"] or not (run or load):
        return out        # SGLang's own method (its kernels need CUDA): built, not run here
    _load(layer, ckpt)
    prepared = method.process_weights_after_loading(layer)
    out["prepared"] = {k: getattr(prepared, k) for k in ("backend", "num_experts", "hidden", "intermediate",
                                                         "swiglu_limit", "bytes_per_expert_before",
                                                         "bytes_per_expert_after", "packed_bytes_per_expert",
                                                         "aux_bytes")}
    if load:
        out["_layer"], out["_method"] = layer, method
        return out
    out.update(forward(layer, method, rank, gen, ckpt, TOKENS))
    return out


def forward(layer, method, rank, gen, ckpt, tokens) -> dict:
    """One forward of LAYER on fresh random tokens and routes, against the reference."""
    import torch
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.runtime_context import get_parallel
    out = {}
    x = (torch.randn(tokens, H, generator=gen) * 0.5).bfloat16().to(DEVICE)
    tw, ids = _routing(gen, tokens)
    seen = {}
    if getattr(method, "_poisoning", None) is None:
        _poisoning(method, seen)
        method._poisoning = seen
    seen = method._poisoning
    seen.clear()
    logits = torch.randn(tokens, E_GLOBAL, generator=gen).to(DEVICE)
    # No TP processes here: the layer only asks the group for its symmetric-memory
    # context (off), and never communicates (reduce_results=False).
    with get_parallel().override(tp_group=types.SimpleNamespace(world_size=EP)):
        y = layer.forward(x, StandardTopKOutput(tw, ids, logits))
    ref, local = _reference(ckpt, rank, x, tw, ids)
    diff = (y.float() - ref.float())
    out["kernel"] = dict(seen)
    out["local_masked"] = int((local < 0).sum())
    out["all_masked_tokens"] = int((local < 0).all(dim=1).sum())
    out["rel_err"] = (diff.norm() / ref.float().norm()).item()
    out["max_abs_over_max_ref"] = (diff.abs().max() / ref.float().abs().max()).item()
    out["ref_nonzero"] = bool((ref != 0).any())
    out["shape"] = list(y.shape)
    return out


def build_gpu_rank(model_dir, gen):
    """The `gpu` mode's rank 0 of an EP2 launch on this machine's GPU 0 (the other
    rank's experts are -1 here), at DeepSeek-V4 shapes. Returns (rank dict, layer,
    method, checkpoint)."""
    use_shape(**DSV4_SHAPE)
    sa, value = _launch(model_dir, "default")
    ckpt = _checkpoint(gen)
    import torch
    torch.cuda.set_device(0)       # what SGLang's bootstrap does before the model
    r = _rank(sa, 0, gen, ckpt, run=False, load=True)
    r["launch_moe_runner_backend"] = value
    return r, ckpt


def gpu(model_dir, gen) -> dict:
    """The routed layer at DeepSeek-V4 shapes on a real GPU (CAPDISPATCH_SET picks the
    backend, e.g. moe=triton_w4a16), for T in 1, 7, 64, 512."""
    r, ckpt = build_gpu_rank(model_dir, gen)
    layer, method = r.pop("_layer", None), r.pop("_method", None)
    if r["method_is_capdispatch"]:
        r["by_tokens"] = {t: forward(layer, method, 0, gen, ckpt, t) for t in (1, 7, 64, 512)}
    return r


def native_by_names() -> list:
    """The moe route's `native_by` names against this SGLang: the field, its values
    and the method classes it names. Returns the problems."""
    import importlib
    import pkgutil

    from sglang_scenarios import _field_choices

    from capdispatch.adapters.sglang import knobs, moe_plan, versions
    release = knobs.load().release(versions.installed())
    route = moe_plan.route_of(release)
    pkgutil.resolve_name(route.target)
    nb = route.native_by
    problems = []
    choices = _field_choices().get(nb.field)
    if choices is None:
        problems.append(f"{nb.field} is not a ServerArgs field with choices")
    for value, _ in nb.values:
        if value != moe_plan.OTHER and value not in (choices or ()):
            problems.append(f"{nb.field}={value} is not one of SGLang's choices")
    fams = [("default", v) for _, v in nb.default]
    problems += [f"default {v} is not one of SGLang's choices" for _, v in fams if v not in (choices or ())]
    names = set()
    for _, m in nb.methods:
        names.update([m] if isinstance(m, str) else [n for _, n in m])
    where = {"Fp8MoEMethod": "fp8", "Mxfp4MarlinMoEMethod": "mxfp4_marlin_moe",
             "Mxfp4FlashinferCutlassMoEMethod": "mxfp4_flashinfer_cutlass_moe",
             "Mxfp4FlashinferTrtllmMoEMethod": "mxfp4_flashinfer_trtllm_moe"}
    for n in sorted(names):
        mod = importlib.import_module(f"sglang.srt.layers.quantization.{where.get(n, 'fp8')}")
        if not isinstance(getattr(mod, n, None), type):
            problems.append(f"method {n} is not a class of {mod.__name__}")
    return problems


def main(argv) -> None:
    """MODES (comma-separated, in order): default (SGLang's own choice; every rank
    runs its layer), explicit (the user's --moe-runner-backend flashinfer_mxfp4;
    layers built, not run), strict (that, under CAPDISPATCH_STRICT=1)."""
    import torch
    model_dir = argv[0]
    modes = (argv[1] if len(argv) > 1 else "default").split(",")
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    ckpt = _checkpoint(gen)
    out = {"seed": seed, "modes": {}, "native_by_problems": native_by_names()}
    if modes == ["gpu"]:
        emit({"seed": seed, "gpu": gpu(model_dir, gen)})
        return
    for mode in modes:
        logs = capture_logs()
        sa, value = _launch(model_dir, mode)
        if mode == "strict":
            os.environ["CAPDISPATCH_STRICT"] = "1"
        ranks = [_rank(sa, r, gen, ckpt, run=mode == "default") for r in range(EP)]
        os.environ.pop("CAPDISPATCH_STRICT", None)
        out["modes"][mode] = {"launch_moe_runner_backend": value, "launch_logs": logs, "ranks": ranks}
    emit(out)


if __name__ == "__main__":
    main(sys.argv[1:])
