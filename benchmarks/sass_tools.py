"""Offline SASS tools for the Triton kernels (no GPU): compile a kernel for a GPU target
with the specialisation a launch gets, disassemble its cubin with the nvdisasm Triton
ships, find the main loop and count its instructions by class, and work out the
theoretical occupancy from registers, shared memory and warps.

Used by sass_moe_triton.py (MoE decoders compared) and sass_bounds.py (what bounds each
kernel on sm_90a). The counts are a proxy to reason about a kernel without a card, not
a timing.
"""
from __future__ import annotations

import collections
import contextlib
import io
import os
import re
import subprocess
import tempfile

import attrs

INSN = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)")
LABEL = re.compile(r"^(\.L_x_\d+):\s*\n\s+/\*([0-9a-f]+)\*/", re.M)
BRANCH = re.compile(r"/\*([0-9a-f]+)\*/[^\n]*BRA[^\n]*`\((\.L_x_\d+)\)")
_REGS = re.compile(r"Used (\d+) registers")
_SPILL_ST = re.compile(r"(\d+) bytes spill stores")
_SPILL_LD = re.compile(r"(\d+) bytes spill loads")

# Instruction classes by base opcode (the part before the first '.').
CLASSES = (
    ("tensor_wgmma", ("HGMMA", "QGMMA", "IGMMA", "BGMMA")),     # warpgroup MMA (sm_90a wgmma)
    ("tensor_mma", ("HMMA", "QMMA", "IMMA", "BMMA")),           # warp MMA (mma.sync)
    ("global_load", ("LDG", "LDGSTS", "UTMALDG", "UBLKCP", "LD")),
    ("global_store", ("STG", "UTMASTG", "ST", "RED", "ATOM", "ATOMG")),
    ("shared", ("LDS", "STS", "LDSM", "STSM", "ATOMS")),
    ("local_spill", ("LDL", "STL")),
    ("fp32", ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "FCHK", "FSET")),
    ("special_fn", ("MUFU",)),
    ("half", ("HFMA2", "HMUL2", "HADD2", "HMNMX2", "HSETP2")),
    ("conversion", ("F2F", "F2FP", "I2F", "I2FP", "F2I", "F2IP", "PRMT", "I2I", "FRND")),
    ("int_alu", ("IADD3", "VIADD", "VIADDMNMX", "VIMNMX3", "IMAD", "IMAD.WIDE", "LOP3", "SHF", "LEA", "ISETP", "IMNMX", "VIMNMX", "SEL",
                 "IABS", "LEA.HI", "SGXT", "BMSK", "FLO", "POPC", "IDP", "UIADD3", "ULOP3", "USHF", "ULEA",
                 "UIMAD", "UISETP", "USEL", "UPRMT", "USGXT", "UMOV", "MOV", "IADD", "IMUL", "SHL", "SHR",
                 "P2R", "R2P", "PLOP3", "UPLOP3", "S2R", "S2UR", "CS2R", "R2UR", "VOTE", "VOTEU", "SHFL",
                 "UFLO", "UPOPC", "UBMSK", "ULDC", "LDC", "UBREV", "BREV")),
    ("sync", ("BAR", "WARPSYNC", "DEPBAR", "WARPGROUP", "SYNCS", "MEMBAR", "ERRBAR", "CCTL", "FENCE",
              "ARRIVES", "LDGDEPBAR", "BSSY", "BSYNC")),
    ("control", ("BRA", "EXIT", "NOP", "CALL", "RET", "YIELD", "BPT", "JMP", "BRX", "ELECT", "UCGABAR_ARV",
                 "UCGABAR_WAIT", "ACQBULK", "PREEXIT", "ENDCOLLECTIVE")),
)
_CLASS_OF = {op: name for name, ops in CLASSES for op in ops}


def op_class(opcode: str) -> str:
    base = opcode.split(".")[0]
    return _CLASS_OF.get(base, "other")


@attrs.frozen
class Compiled:
    """One offline compile: resources from ptxas -v and the disassembled SASS."""
    regs: int | None
    spill_stores: int | None    # bytes
    spill_loads: int | None     # bytes
    smem: int                   # bytes the launch requests
    num_warps: int
    sass: str = attrs.field(repr=False)
    ptx: str = attrs.field(repr=False)


def _launch_attrs(signature: dict) -> dict:
    """What a launch specialises: every pointer and every integer argument is taken as a
    multiple of 16 (16-byte aligned tensors, sizes and strides of the model's shapes)."""
    return {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values())
            if t.startswith("*") or t in ("i32", "i64")}


def compile_kernel(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int, cc: int,
                   aligned: bool = True) -> Compiled:
    """Compile Triton ``fn`` for CUDA compute capability ``cc`` (90 builds sm_90a) offline."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from capdispatch import bench

    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("compiling offline needs the kernels imported without TRITON_INTERPRET")
    constexprs = bench.compile_matrix.with_defaults(fn, constexprs)
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs,
                    attrs=_launch_attrs(signature) if aligned else None)
    log = io.StringIO()
    # A fresh cache: every compile runs ptxas, whose -v log gives registers and spills.
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope():
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True
        with contextlib.redirect_stdout(log):
            ck = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
    text = log.getvalue()

    def grab(rx):
        m = rx.search(text)
        return int(m.group(1)) if m else None
    return Compiled(regs=grab(_REGS), spill_stores=grab(_SPILL_ST), spill_loads=grab(_SPILL_LD),
                    smem=int(ck.metadata.shared), num_warps=num_warps,
                    sass=disassemble(ck.asm["cubin"]), ptx=ck.asm["ptx"])


def nvdisasm() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([nvdisasm(), "-c", path], capture_output=True, text=True, check=True).stdout


def instructions(text: str) -> list:
    """(address, opcode) of every instruction of an nvdisasm listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(INSN.match, text.split("\n")) if m]


def loops(text: str) -> list:
    """(start, end) addresses of every backward branch's body, largest first."""
    labels = {m.group(1): int(m.group(2), 16) for m in LABEL.finditer(text)}
    out = []
    for m in BRANCH.finditer(text):
        end, start = int(m.group(1), 16), labels.get(m.group(2))
        if start is not None and start < end:
            out.append((start, end))
    return sorted(set(out), key=lambda se: se[0] - se[1])


def main_loop(text: str):
    """(instructions in the largest backward-branch loop, Counter of its opcodes); (0,
    empty Counter) for a kernel without a loop."""
    insns = instructions(text)
    best = (0, collections.Counter())
    for start, end in loops(text):
        body = [op for a, op in insns if start <= a <= end]
        if len(body) > best[0]:
            best = (len(body), collections.Counter(body))
    return best


def whole_kernel(text: str) -> collections.Counter:
    return collections.Counter(op for _, op in instructions(text))


def by_class(mix: collections.Counter) -> dict:
    """{class: count} over CLASSES (and "other"), classes in CLASSES order."""
    out = {name: 0 for name, _ in CLASSES}
    out["other"] = 0
    for op, n in mix.items():
        out[op_class(op)] += n
    return out


@attrs.frozen
class SMLimits:
    regs: int = 65536            # 32-bit registers per SM
    smem: int = 228 * 1024       # shared memory per SM, bytes
    smem_per_block_reserved: int = 1024   # the driver's reservation per resident block
    warps: int = 64
    blocks: int = 32
    reg_alloc_unit: int = 256    # registers are allocated per warp in units of 256


H200 = SMLimits()


@attrs.frozen
class Occupancy:
    blocks: int                  # resident blocks per SM
    warps: int                   # resident warps per SM
    limiter: str                 # "registers", "shared memory", "warps" or "blocks"

    @property
    def fraction(self) -> float:
        return self.warps / H200.warps


def occupancy(regs: int, smem: int, num_warps: int, lim: SMLimits = H200) -> Occupancy:
    """Theoretical resident blocks and warps per SM from the launch's resources."""
    per_warp = -(-regs * 32 // lim.reg_alloc_unit) * lim.reg_alloc_unit
    by = {
        "registers": (lim.regs // per_warp) // num_warps if per_warp else lim.blocks,
        "shared memory": lim.smem // (smem + lim.smem_per_block_reserved),
        "warps": lim.warps // num_warps,
        "blocks": lim.blocks,
    }
    limiter = min(by, key=lambda k: (by[k], list(by).index(k)))
    return Occupancy(blocks=by[limiter], warps=by[limiter] * num_warps, limiter=limiter)


def ptx_mma_kinds(ptx: str) -> dict:
    """How many wgmma and mma.sync instructions the PTX holds (which tensor-core path the
    compiler chose for the kernel's dots)."""
    return {"wgmma": len(re.findall(r"\bwgmma\.mma_async", ptx)), "mma.sync": len(re.findall(r"\bmma\.sync", ptx))}
