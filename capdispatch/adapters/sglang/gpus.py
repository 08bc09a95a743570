"""Which GPUs an SGLang launch uses, and their facts, without initialising CUDA.

SIM_ENV simulates the node: a comma-separated list of devices as CUDA numbers
them (entry N is cuda:N), e.g. `sim:rtx-5090,sim:rtx-3080,sim:rtx-3080`; one
simulated device alone stands for every GPU the launch uses. It is
read when a decision is made. Decisions are then made for the simulated cards;
their kernels run where the tensors are (the CPU, Triton under TRITON_INTERPRET=1).

An entry `emu:NAME@cuda:N` (N the entry's own position) emulates the catalog card NAME
on the real GPU cuda:N: the rank decides as NAME (`device` gives NAME's facts), while
SGLang's own facts and kernels stay the real card's and capdispatch's kernels run on
cuda:N under NAME's launch facts (rank.py, emulate.py). `emu:NAME@sim:CARD` is the same
with the card that is there simulated too (its kernels on the CPU): the CPU tests' form.
"""
from __future__ import annotations

import os
from typing import Optional

import attrs

SIM_ENV = "CAPDISPATCH_SGLANG_DEVICES"
EMU = "emu:"


@attrs.frozen
class Emulation:
    """A rank that decides as the catalog card CARD (SPEC: its facts, id cuda:N) on the
    device RUN ("cuda:N", or "sim:CARD" for a simulated one; REAL: that device's facts)."""
    card: str
    spec: object
    run: str
    real: object

    @property
    def on_cuda(self) -> bool:
        return self.run.startswith("cuda:")

    def to_dict(self) -> dict:
        return {"card": self.card, "name": self.spec.name, "cc": self.spec.cc_str, "on": self.run,
                "device": self.real.name, "device_cc": self.real.cc_str}


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


def _entry(gpu_id: int, env):
    """(SIM_ENV entry for GPU_ID, where it was listed), or (None, None) when SIM_ENV is unset."""
    import capdispatch as cd
    listed = simulated_devices(env)
    if listed is None:
        return None, None
    if len(listed) == 1 and listed[0].startswith(("sim:", EMU)) and "@cuda:" not in listed[0]:
        # One simulated card stands for every GPU of the launch (--device sim:h200 --tp 2),
        # as one device with --tp N does in every command.
        return listed[0], f"{SIM_ENV} entry 0"
    if gpu_id >= len(listed):
        raise cd.BadInput(f"{SIM_ENV} lists {len(listed)} device(s) (cuda:0..cuda:{len(listed) - 1}) "
                          f"but the launch uses cuda:{gpu_id}")
    return listed[gpu_id], f"{SIM_ENV} entry {gpu_id}"


def _emulation(text: str, origin: str, gpu_id: int, via: str) -> Emulation:
    import capdispatch as cd
    name, at, run = text[len(EMU):].partition("@")
    forms = "emu:NAME@cuda:N (N: the entry's position) or emu:NAME@sim:CARD"
    if not name or not at or not run:
        raise cd.BadInput(f"{origin}: {text!r}: expected {forms}")
    card = _spec(f"sim:{name}", origin, via=via)
    if run.startswith("cuda:"):
        if run != f"cuda:{gpu_id}":
            raise cd.BadInput(f"{origin}: {text!r}: entry {gpu_id} is cuda:{gpu_id}, so it emulates a card "
                              f"there (emu:{name}@cuda:{gpu_id}), not on {run}")
        real = _spec(run, origin, via=via)
    elif run.startswith("sim:"):
        real = _spec(run, origin, via=via)
    else:
        raise cd.BadInput(f"{origin}: {text!r}: the card runs on {run!r}; expected {forms}")
    key = card.catalog_key or name
    return Emulation(key, card.with_id(f"cuda:{gpu_id}"), run, real.with_id(f"cuda:{gpu_id}"))


def emulation(gpu_id: int, *, env=None, via: str = "nvml") -> Optional[Emulation]:
    """The emulation SIM_ENV asks of CUDA ordinal GPU_ID (an `emu:` entry), or None."""
    text, origin = _entry(gpu_id, env)
    if text is None or not text.startswith(EMU):
        return None
    return _emulation(text, origin, gpu_id, via)


def device(gpu_id: int, *, env=None, via: str = "nvml"):
    """The facts of CUDA ordinal GPU_ID (simulated when SIM_ENV is set), with id cuda:N.

    via="nvml" never initialises CUDA (ProbeError when NVML cannot answer);
    via="auto" falls back to torch.
    """
    text, origin = _entry(gpu_id, env)
    if text is None:
        return _spec(f"cuda:{gpu_id}", "SGLang GPU", via=via)
    if text.startswith(EMU):      # decided as the emulated card
        return _emulation(text, origin, gpu_id, via).spec
    return _spec(text, origin, via=via).with_id(f"cuda:{gpu_id}")


def devices(ids, *, env=None, via: str = "nvml") -> list:
    return [device(g, env=env, via=via) for g in ids]


def describe(spec, emu: Optional[Emulation] = None) -> str:
    if emu is not None:
        return (f"{spec.id} {spec.name}, cc {spec.cc_str} (emulated on {emu.run}: {emu.real.name}, "
                f"cc {emu.real.cc_str})")
    how = "simulated" if spec.simulated else f"probed: {spec.probe}"
    cc = f", cc {spec.cc_str}" if spec.cc else ""
    return f"{spec.id} {spec.name}{cc} ({how})"
