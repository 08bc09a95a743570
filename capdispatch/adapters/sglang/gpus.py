"""Which GPUs an SGLang launch uses, and their facts, without initialising CUDA.

SIM_ENV simulates the node: a comma-separated list of devices as CUDA numbers
them (entry N is cuda:N), e.g. `sim:rtx-5090,sim:rtx-3080,sim:rtx-3080`; one
simulated device alone stands for every GPU the launch uses. It is
read when a decision is made. Decisions are then made for the simulated cards;
their kernels run where the tensors are (the CPU, Triton under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os
from typing import Optional

SIM_ENV = "CAPDISPATCH_SGLANG_DEVICES"


def _positive(name: str, value, minimum: int) -> int:
    import capdispatch as cd
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise cd.BadInput(f"{name}={value!r}: expected an integer >= {minimum}")
    return value


def gpu_ids(*, tp_size: int, pp_size: int = 1, nnodes: int = 1, node_rank: int = 0,
            base_gpu_id: int = 0, gpu_id_step: int = 1, dp_size: int = 1,
            dp_attention: bool = False) -> list:
    """CUDA ordinals of this node's scheduler processes, in rank order (SGLang's
    launcher arithmetic: base + pp * tp_per_node + tp * step, DP replicas after)."""
    tp = _positive("tp_size", tp_size, 1)
    pp = _positive("pp_size", pp_size, 1)
    nnodes = _positive("nnodes", nnodes, 1)
    node_rank = _positive("node_rank", node_rank, 0)
    base = _positive("base_gpu_id", base_gpu_id, 0)
    step = _positive("gpu_id_step", gpu_id_step, 1)
    dp = _positive("dp_size", dp_size, 1)
    pp_per_node = max(pp // nnodes, 1)
    nnodes_per_pp = max(nnodes // pp, 1)
    tp_per_node = max(tp // nnodes_per_pp, 1)
    pp_first = pp_per_node * (node_rank // nnodes_per_pp)
    tp_first = tp_per_node * (node_rank % nnodes_per_pp)
    pp_ranks = range(pp_first, pp_first + pp_per_node)
    tp_ranks = range(tp_first, tp_first + tp_per_node)
    # Separate DP replicas (no attention DP) each get their own block of GPUs.
    replicas = dp if dp > 1 and not dp_attention else 1
    out = []
    for d in range(replicas):
        offset = d * tp * pp * step
        for p in pp_ranks:
            for t in tp_ranks:
                g = base + offset + (p % pp_per_node) * tp_per_node + (t % tp_per_node) * step
                if g not in out:
                    out.append(g)
    return out


def simulated_devices(env=None) -> Optional[list]:
    """The SIM_ENV device list, or None when unset."""
    import capdispatch as cd
    from capdispatch import extend
    env = os.environ if env is None else env
    text = env.get(SIM_ENV)
    if text is None or not text.strip():
        return None
    return extend.device_list(text, SIM_ENV)


def _spec(dev: str, origin: str, *, via: str):
    import capdispatch as cd
    try:
        return cd.probe(dev, via=via)
    except cd.UnknownDeviceError as exc:
        raise cd.BadInput(f"{origin}: {exc}") from None


def device(gpu_id: int, *, env=None, via: str = "nvml"):
    """The facts of CUDA ordinal GPU_ID (simulated when SIM_ENV is set), with id cuda:N.

    via="nvml" never initialises CUDA (ProbeError when NVML cannot answer);
    via="auto" falls back to torch.
    """
    import capdispatch as cd
    listed = simulated_devices(env)
    if listed is None:
        return _spec(f"cuda:{gpu_id}", "SGLang GPU", via=via)
    if len(listed) == 1 and listed[0].startswith("sim:"):
        # One simulated card stands for every GPU of the launch (--device sim:h200 --tp 2),
        # as one device with --tp N does in every command.
        return _spec(listed[0], f"{SIM_ENV} entry 0", via=via).with_id(f"cuda:{gpu_id}")
    if gpu_id >= len(listed):
        raise cd.BadInput(f"{SIM_ENV} lists {len(listed)} device(s) (cuda:0..cuda:{len(listed) - 1}) "
                          f"but the launch uses cuda:{gpu_id}")
    return _spec(listed[gpu_id], f"{SIM_ENV} entry {gpu_id}", via=via).with_id(f"cuda:{gpu_id}")


def devices(ids, *, env=None, via: str = "nvml") -> list:
    return [device(g, env=env, via=via) for g in ids]


def describe(spec) -> str:
    how = "simulated" if spec.simulated else f"probed: {spec.probe}"
    cc = f", cc {spec.cc_str}" if spec.cc else ""
    return f"{spec.id} {spec.name}{cc} ({how})"
