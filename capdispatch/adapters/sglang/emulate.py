"""A rank that emulates another card (gpus.Emulation: `emu:NAME@cuda:N` in
CAPDISPATCH_SGLANG_DEVICES): it decides as the card, and its routes run capdispatch's
kernels for the card on the device that is there.

SGLang's own architecture facts stay the real device's (sglang_facts.correct is given
the real card): every kernel SGLang runs itself -- the ops kept, the linears, the JIT
kernels, whose compile target the facts set -- is then the one SGLang runs on that
device without the plugin, so plugin-on and plugin-off differ only where a route runs
the card's kernel. Telling SGLang that an H100 is SM86 would compile its JIT kernels
for sm_86 (code an SM90 card cannot load), turn DeepGEMM off and move its fp8 linears
to other kernels: a run neither card makes. What the real facts cannot give is a call
site SGLang reaches only on the card (an RTX 5090's SM120 decode on an H100): that rank
is refused, as is one whose routed kernel cannot run on the device (problems).

On a CUDA device the card's launch facts are installed for capdispatch's kernels
(extend.emulate_card: launch tables, shared memory per block, SM count, fp8 codec);
its memory is not: SGLang sizes its weights and KV pool from the device's memory."""
from __future__ import annotations

from typing import Optional


def problems(release, choices: dict, emu, rank: Optional[int] = None) -> list:
    """Why the emulated rank EMU cannot run its decision CHOICES (op -> OpChoice, decided
    as the card) on the device that is there, one line each (empty: it can)."""
    import capdispatch as cd
    who = f"rank {rank} ({_label(emu)})" if rank is not None else _label(emu)
    out = []
    for op, c in choices.items():
        if not c.routed:
            continue       # SGLang's own kernel runs, chosen by SGLang for the device that is there
        mine, there = release.route(op, emu.spec), release.route(op, emu.real)
        if mine is None or there is None or mine.target != there.target:
            where = there.site if there is not None else "no site capdispatch routes"
            out.append(f"{who}: {op}'s route for the {emu.spec.name} is {mine.site if mine else 'none'}, "
                       f"but SGLang on the {emu.real.name} (cc {emu.real.cc_str}) calls {where}: the card's "
                       f"route is never called there, and telling SGLang the card's architecture would run "
                       f"SGLang's own kernels for cc {emu.spec.cc_str} on cc {emu.real.cc_str}; emulate a "
                       f"card whose SGLang call sites are the device's")
            continue
        names = [c.backend] + [b.backend for b in getattr(c.resolution, "buckets", ()) or ()]
        for b in dict.fromkeys(n for n in names if n is not None and n != mine.native):
            try:
                cd.resolve(op, emu.real, selections={op: b}, strict=True)
            except cd.CapdispatchError as exc:
                out.append(f"{who}: {op}={b} (decided for the {emu.spec.name}) cannot run on the "
                           f"{emu.real.name}: {str(exc).splitlines()[0]}")
    return out


def _label(emu) -> str:
    return f"emu:{emu.card}@{emu.run}"


def install(emu, gpu_id: int) -> Optional[dict]:
    """Install the card's launch facts for capdispatch's kernels on cuda:GPU_ID (nothing
    where the device is simulated). Returns what the report says of the emulation."""
    from capdispatch import extend
    d = emu.to_dict()
    if emu.on_cuda:
        d["facts"] = extend.emulate_card(emu.spec, gpu_id).to_dict()
        d["note"] = ("capdispatch's kernels launch by the card's compute capability, shared memory per "
                     "block, SM count and fp8 support; SGLang's own kernels, its architecture facts and the "
                     "memory it sizes its pools by are the device's")
    else:
        d["facts"] = None
        d["note"] = ("the device is simulated: capdispatch's kernels run on the CPU, where the card's launch "
                     "facts do not apply; SGLang's architecture facts are the simulated device's")
    return d
