"""capdispatch's MoE method for SGLang's FusedMoE: DeepSeek-V4's MXFP4 routed
experts on a rank whose card cannot run SGLang's own method for the launch's
`moe_runner_backend` (SGLang takes one value for the whole launch, decided
from device 0).

SGLang 0.5.23 picks the method per layer in `Fp8Config.get_quant_method`
(DeepSeek-V4 checkpoints are fp8 with MXFP4 experts, `is_fp4_experts`): for
flashinfer_mxfp4 `Mxfp4FlashinferCutlassMoEMethod` on SM90/SM120 and
`Mxfp4FlashinferTrtllmMoEMethod` elsewhere, for marlin
`Mxfp4MarlinMoEMethod` (SM90/SM120 only), otherwise `Fp8MoEMethod`, whose
runners have no MXFP4 kernel and which stages the E8M0 scales as float32.
The route (routes.moe_quant_method) replaces that choice on a routed rank by
this class, bound to the capdispatch kernel decided for the rank's card:

* create_weights: SGLang's own FP4-expert parameters (the loader's names,
  shapes and attributes), with the scales in native E8M0 (one byte each,
  never float32) and w13 in the checkpoint's [gate; up] order;
* process_weights_after_loading: the loaded tensors become a
  capdispatch MoeWeights (reinterpreted, no copy) and are put in place into
  the backend's layout (`capdispatch.backends.moe.prepare`); the bytes per
  expert before and after are logged and returned (MoePrepared);
* apply: the dispatcher's local expert ids (-1 where EP placed the expert on
  another rank) and final top-k weights (renormalised, DSv4's routed scaling
  factor folded in: `fuse_routed_scaling_factor_in_topk`) go to the kernel;
  the layer's SwiGLU clamp (`swiglu_limit`) is a property of the weights.

Imports torch and SGLang only when a route builds one (never at import).
"""
from __future__ import annotations

import logging
from typing import Optional

import attrs

log = logging.getLogger("capdispatch.sglang")


@attrs.frozen
class MoePrepared:
    """What preparing one MoE layer's experts did (also logged)."""
    layer: str
    device: str
    backend: str
    num_experts: int
    hidden: int
    intermediate: int
    swiglu_limit: Optional[float]
    bytes_per_expert_before: float
    bytes_per_expert_after: float
    packed_bytes_per_expert: int
    aux_bytes: int


def global_ids_refusal(api, read, routed_on) -> Optional[str]:
    """Why this launch cannot route MoE (None: it can). ROUTED_ON: the devices (descriptions)
    whose MoE layers are routed; READ(field): SGLang's resolved value; API: the release's
    adapter code (compat.of(release)). capdispatch's method
    takes EP-local expert ids (-1 off the rank); where SGLang's standard dispatcher (no
    all-to-all backend) keeps global ids for the launch's runner value (compat:
    keeps_global_expert_ids: 0.5.17 under flashinfer_mxfp4 and the other FlashInfer values),
    a routed layer under expert parallelism would run the wrong experts: refused."""
    if not routed_on:
        return None
    try:
        ep, a2a, backend = int(read("ep_size") or 1), str(read("moe_a2a_backend")), str(read("moe_runner_backend"))
    except (AttributeError, TypeError, ValueError):
        return None       # a record without these fields: no expert parallelism to map
    if ep <= 1 or a2a != "none" or not api.keeps_global_expert_ids(backend):
        return None
    return (f"capdispatch: SGLang {api.name} with --ep-size {ep} and moe_runner_backend={backend} "
            f"is not supported: its dispatcher hands every MoE layer global expert ids under that launch-wide "
            f"value, and capdispatch's MoE method, routed on {', '.join(routed_on)}, takes EP-local ids; "
            f"give --ep-size 1 or --moe-runner-backend triton (its dispatcher maps the ids to local), or use "
            f"SGLang 0.5.23 (it maps them per layer)")


def not_covered(quant_config, layer, prefix: str) -> Optional[str]:
    """Why capdispatch's method does not take LAYER (None: it does). What it does
    not take stays with SGLang's own method."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.utils import is_layer_skipped
    import torch
    if not isinstance(layer, FusedMoE):
        return "not a FusedMoE layer"
    if not getattr(quant_config, "is_fp4_experts", False):
        return "the experts are not MXFP4"
    if getattr(quant_config, "dequant_fp4_to_fp8", False):
        return "SGLANG_DSV4_FP4_DEQUANT turns the experts into FP8"
    if is_layer_skipped(prefix, quant_config.ignored_layers,
                        fused_mapping=quant_config.packed_modules_mapping):
        return "the layer is unquantised (ignored_layers)"
    cfg = layer.moe_runner_config
    wrong = [(name, have, want) for name, have, want in (
        ("activation", cfg.activation, "silu"), ("is_gated", cfg.is_gated, True),
        ("gemm1_alpha", cfg.gemm1_alpha, None), ("gemm1_clamp_limit", cfg.gemm1_clamp_limit, None),
        ("apply_router_weight_on_input", cfg.apply_router_weight_on_input, False),
        ("with_bias", layer.with_bias, False), ("params_dtype", layer.params_dtype, torch.bfloat16))
        if have != want]
    if wrong:
        return "; ".join(f"{n}={h!r} (capdispatch's moe op takes {w!r})" for n, h, w in wrong)
    return None


def new_tensor_key():
    """(device type, index) where the layer's parameters are about to be created:
    the loader builds the model under its target device (the rank's GPU)."""
    import torch
    d = torch.empty(0).device
    if d.type == "cuda" and d.index is None:
        return ("cuda", torch.cuda.current_device())
    return (d.type, d.index)


def _where(key) -> str:
    return key[0] if key[1] is None else f"{key[0]}:{key[1]}"


class CapdispatchMxfp4MoEMethod:
    """A FusedMoE quant method running capdispatch's moe op (see the module doc)."""

    fuse_routed_scaling_factor_in_topk = True
    load_up_proj_weight_first = False        # [gate; up]: the order MoeWeights takes

    def __init__(self, quant_config, prefix: str, kernel, key, backend: str):
        from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
        self._fp8 = Fp8MoEMethod(quant_config)   # SGLang's FP4-expert parameters and loader attributes
        self.prefix = prefix
        self.kernel = kernel
        self.key = key
        self.backend = backend                  # the decided backend KERNEL is: its weight layout
        self.runner = None                      # FusedMoE reads it; no SGLang runner runs here
        self.moe_runner_config = None
        self.weights = None
        self.prepared: Optional[MoePrepared] = None

    def __repr__(self) -> str:
        return f"CapdispatchMxfp4MoEMethod({self.prefix!r}, {self.backend} on {_where(self.key)})"

    def create_weights(self, layer, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype, **extra_weight_attrs):
        import torch
        # Native E8M0 scales: the checkpoint's bytes, never a float32 container.
        self._fp8.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                                 params_dtype, fp4_scale_dtype=torch.float8_e8m0fnu, **extra_weight_attrs)

    def create_moe_runner(self, layer, moe_runner_config) -> None:
        self.moe_runner_config = moe_runner_config

    def get_moe_runner_backend(self, layer):
        # None: the dispatcher maps global expert ids to local ones, -1 where not local.
        return None

    def get_moe_routing_method_type(self, layer, requested_method):
        return requested_method

    def process_weights_after_loading(self, layer) -> MoePrepared:
        from capdispatch import extend
        MoeWeights, prepare = extend.moe.MoeWeights, extend.moe.prepare
        limit = self.moe_runner_config.swiglu_limit if self.moe_runner_config is not None else None
        w = MoeWeights(layer.w13_weight.data, layer.w13_weight_scale_inv.data,
                       layer.w2_weight.data, layer.w2_weight_scale_inv.data,
                       swiglu_limit=None if limit is None else float(limit))
        before = w.bytes_per_expert()
        prepare(w, self.backend)
        self.weights = w
        self.prepared = MoePrepared(self.prefix, str(w.device), self.backend, w.num_experts, w.hidden,
                                    w.intermediate, w.swiglu_limit, before, w.bytes_per_expert(),
                                    w.packed_bytes_per_expert(), w.aux_bytes())
        p = self.prepared
        log.info("capdispatch: moe %s on %s: %s, %d local experts (H=%d, I=%d, swiglu_limit=%s): "
                 "%.0f B per expert before preparation, %.0f B after (packed size %d B), %d B aux",
                 p.layer or "layer", p.device, p.backend, p.num_experts, p.hidden, p.intermediate,
                 p.swiglu_limit, p.bytes_per_expert_before, p.bytes_per_expert_after,
                 p.packed_bytes_per_expert, p.aux_bytes)
        return p

    def apply(self, layer, dispatch_output):
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker
        if self.weights is None:
            raise RuntimeError(f"capdispatch moe {self.prefix}: apply() before process_weights_after_loading()")
        topk = dispatch_output.topk_output
        if not TopKOutputChecker.format_is_standard(topk):
            raise ValueError(f"capdispatch moe {self.prefix}: needs SGLang's standard top-k output "
                             f"(ids and weights), got format {topk.format}")
        x = dispatch_output.hidden_states
        key = (x.device.type, x.device.index)
        if key != self.key:
            raise RuntimeError(f"capdispatch moe {self.prefix}: hidden states on {x.device}, but this layer's "
                               f"kernel ({self.backend}) was decided and its weights prepared for "
                               f"{_where(self.key)}")
        out = self.kernel(x, self.weights, topk.topk_weights, topk.topk_ids)
        return StandardCombineInput(hidden_states=out)


def make(quant_config, layer, prefix: str, kernel, key, backend: str):
    """The capdispatch method for LAYER running KERNEL (the decided moe BACKEND, bound; for
    a size dispatcher its catch-all bucket's backend: every bucket of one call site shares
    its weight layout, so the weights are prepared for it), or None (with the reason logged
    at DEBUG) where it does not apply and SGLang's own choice stands."""
    why = not_covered(quant_config, layer, prefix)
    if why is not None:
        # Not an MXFP4 expert layer: nothing to route. An MXFP4 layer the op does
        # not cover keeps SGLang's method, which this card cannot run: said loudly.
        quiet = why in ("not a FusedMoE layer", "the experts are not MXFP4") or "ignored_layers" in why \
            or "FP4_DEQUANT" in why
        (log.debug if quiet else log.warning)(
            "capdispatch: moe %s on %s stays with SGLang's method: %s", prefix or "layer", _where(key), why)
        return None
    return CapdispatchMxfp4MoEMethod(quant_config, prefix, kernel, key, backend)
