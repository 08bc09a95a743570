"""Every tensor of a cut DeepSeek-V4 checkpoint, as records: its name (DeepSeek's own, as the
published checkpoint names it), stored dtype, shape and how its values are drawn; grouped
in shards (the globals, one per decoder layer, the next-n layer). Pure Python.

Value rules (docs/checkpoint.md says why): every linear maps an RMS-1 input to an RMS-~1
output, i.e. a dequantised std of 1/sqrt(fan_in); norms are ones; the mHC mixers give
mixes ~ N(0, 1) with neutral bases; hash routes are distinct experts per token.
"""
from __future__ import annotations

import math
from typing import Optional

import attrs

from ..errors import ModelError

# Bytes per element of each safetensors dtype the checkpoint stores.
DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}
BLOCK = 128              # the fp8 linears' scale block, [128, 128]
FP4_BLOCK = 32           # the MXFP4 experts' scale block, [1, 32]
E8M0_BIAS = 127          # an F8_E8M0 byte b means 2 ** (b - 127)
# The std of an e2m1 value drawn from uniformly random 4-bit codes:
# sqrt(mean(v^2)) over {0, .5, 1, 1.5, 2, 3, 4, 6} and their negatives.
E2M1_STD = math.sqrt(137 / 16)
# Scale bytes above 128 would leave capdispatch's MXFP4 decode's short path
# (backends/moe/weights.py, FOLD_SCALE_MAX).
FP4_SCALE_MAX = 128


@attrs.frozen
class Draw:
    """How a tensor's values are drawn.

    kind: fp8 (e4m3 codes ~ N(0, sigma) before the block scale), scale (every byte
    `byte`), fp4 (uniformly random e2m1 codes, two per byte), normal (N(0, sigma)),
    ones, zeros, tid2eid (hash routes: row t holds `topk` distinct experts of `experts`).
    """
    kind: str
    sigma: Optional[float] = None
    byte: Optional[int] = None
    experts: Optional[int] = None
    topk: Optional[int] = None

    def describe(self) -> str:
        if self.kind in ("fp8", "normal"):
            return f"{self.kind} sigma {self.sigma:.4g}"
        if self.kind == "scale":
            return f"scale 2^{self.byte - E8M0_BIAS}"
        return self.kind


@attrs.frozen
class Tensor:
    name: str
    dtype: str
    shape: tuple = attrs.field(converter=tuple)
    draw: Draw

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@attrs.frozen
class Shard:
    """One safetensors file: FILE, what it holds (WHAT: globals, layer N, next-n layer)."""
    file: str
    what: str
    tensors: tuple = attrs.field(converter=tuple)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@attrs.frozen
class Plan:
    model: str
    layers: int
    mtp: int
    config: dict = attrs.field(eq=False, hash=False)
    shards: tuple = attrs.field(converter=tuple)

    @property
    def tensors(self) -> int:
        return sum(len(s.tensors) for s in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


# ------------------------------------------------------------------ value rules

def fp8_draw(fan_in: int) -> tuple:
    """(codes' Draw, scale's Draw) giving a dequantised std of 1/sqrt(fan_in): the scale is
    the power of two 2^k just below it, the codes' sigma in [1, 2)."""
    target = 1 / math.sqrt(fan_in)
    k = math.floor(math.log2(target))
    return Draw("fp8", sigma=target / 2 ** k), Draw("scale", byte=E8M0_BIAS + k)


def fp4_scale(fan_in: int) -> Draw:
    """The 1x32 scale that brings uniform e2m1 codes (std 2.93) nearest 1/sqrt(fan_in)."""
    k = round(math.log2(1 / (math.sqrt(fan_in) * E2M1_STD)))
    return Draw("scale", byte=min(E8M0_BIAS + k, FP4_SCALE_MAX))


ONES, ZEROS = Draw("ones"), Draw("zeros")


def _normal(fan_in: int) -> Draw:
    return Draw("normal", sigma=1 / math.sqrt(fan_in))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------ the tensors

class _Names:
    def __init__(self, cfg: dict, shape):
        self.s, self.hc = shape, cfg["hc_mult"]

    def fp8(self, name: str, rows: int, cols: int) -> list:
        codes, scale = fp8_draw(cols)
        return [Tensor(f"{name}.weight", "F8_E4M3", (rows, cols), codes),
                Tensor(f"{name}.scale", "F8_E8M0", (_ceil(rows, BLOCK), _ceil(cols, BLOCK)), scale)]

    def fp4(self, name: str, rows: int, cols: int) -> list:
        return [Tensor(f"{name}.weight", "I8", (rows, cols // 2), Draw("fp4")),
                Tensor(f"{name}.scale", "F8_E8M0", (rows, cols // FP4_BLOCK), fp4_scale(cols))]

    def bf16(self, name: str, rows: int, cols: int) -> Tensor:
        return Tensor(f"{name}.weight", "BF16", (rows, cols), _normal(cols))

    def norm(self, name: str, size: int) -> Tensor:
        return Tensor(f"{name}.weight", "BF16", (size,), ONES)

    def mhc(self, prefix: str, part: str, mixes: int, scales: int) -> list:
        # mixes = (x_flat @ fn.T) * rsqrt(mean(x_flat^2)) over the hc * hidden stream:
        # sigma 1/sqrt(hc * hidden) gives mixes ~ N(0, 1); scale 1 and base 0 are neutral.
        width = self.hc * self.s.hidden
        return [Tensor(f"{prefix}hc_{part}_fn", "F32", (mixes, width), _normal(width)),
                Tensor(f"{prefix}hc_{part}_base", "F32", (mixes,), ZEROS),
                Tensor(f"{prefix}hc_{part}_scale", "F32", (scales,), ONES)]

    def compressor(self, prefix: str, ratio: int, dim: int) -> list:
        # Unquantized (no .scale): SGLang fuses wkv and wgate into one bf16 wkv_gate.
        coff = 2 if ratio == 4 else 1
        return [Tensor(f"{prefix}.ape", "F32", (ratio, coff * dim), Draw("normal", sigma=0.1)),
                self.bf16(f"{prefix}.wkv", coff * dim, self.s.hidden),
                self.bf16(f"{prefix}.wgate", coff * dim, self.s.hidden),
                self.norm(f"{prefix}.norm", dim)]

    def block(self, p: str, ratio: int, hashed: bool) -> list:
        s, h = self.s, self.s.hidden
        heads_dim = s.heads * s.head_dim
        t = [Tensor(f"{p}.attn.attn_sink", "F32", (s.heads,), ZEROS)]
        t += self.fp8(f"{p}.attn.wq_a", s.q_lora_rank, h)
        t += [self.norm(f"{p}.attn.q_norm", s.q_lora_rank)]
        t += self.fp8(f"{p}.attn.wq_b", heads_dim, s.q_lora_rank)
        t += self.fp8(f"{p}.attn.wkv", s.head_dim, h)
        t += [self.norm(f"{p}.attn.kv_norm", s.head_dim)]
        t += self.fp8(f"{p}.attn.wo_a", s.o_groups * s.o_lora_rank, heads_dim // s.o_groups)
        t += self.fp8(f"{p}.attn.wo_b", h, s.o_groups * s.o_lora_rank)
        if ratio:
            t += self.compressor(f"{p}.attn.compressor", ratio, s.head_dim)
        if ratio == 4:
            t += self.fp8(f"{p}.attn.indexer.wq_b", s.indexer_heads * s.indexer_dim, s.q_lora_rank)
            t += [self.bf16(f"{p}.attn.indexer.weights_proj", s.indexer_heads, h)]
            t += self.compressor(f"{p}.attn.indexer.compressor", 4, s.indexer_dim)
        t += [self.norm(f"{p}.attn_norm", h), self.norm(f"{p}.ffn_norm", h)]
        mixes = (2 + self.hc) * self.hc
        t += self.mhc(f"{p}.", "attn", mixes, 3) + self.mhc(f"{p}.", "ffn", mixes, 3)
        t += [self.bf16(f"{p}.ffn.gate", s.experts, h)]
        if hashed:
            t += [Tensor(f"{p}.ffn.gate.tid2eid", "I64", (s.vocab, s.experts_per_token),
                         Draw("tid2eid", experts=s.experts, topk=s.experts_per_token))]
        else:
            t += [Tensor(f"{p}.ffn.gate.bias", "F32", (s.experts,), Draw("normal", sigma=0.01))]
        for e in range(s.experts):
            x = f"{p}.ffn.experts.{e}"
            t += self.fp4(f"{x}.w1", s.moe_intermediate, h) + self.fp4(f"{x}.w2", h, s.moe_intermediate) \
                + self.fp4(f"{x}.w3", s.moe_intermediate, h)
        if s.shared_experts:
            inter = s.shared_experts * s.moe_intermediate
            x = f"{p}.ffn.shared_experts"
            t += self.fp8(f"{x}.w1", inter, h) + self.fp8(f"{x}.w2", h, inter) + self.fp8(f"{x}.w3", inter, h)
        return t

    def globals(self) -> list:
        s = self.s
        return [Tensor("embed.weight", "BF16", (s.vocab, s.hidden), Draw("normal", sigma=1.0)),
                self.bf16("head", s.vocab, s.hidden), self.norm("norm", s.hidden),
                *self.mhc("", "head", self.hc, 1)]

    def nextn(self, i: int) -> list:
        s, p = self.s, f"mtp.{i}"
        # SGLang builds the next-n layer with compress ratio 0 and a biased (not hashed) router;
        # it shares the target's embedding and head.
        return [*self.block(p, 0, False), *self.fp8(f"{p}.e_proj", s.hidden, s.hidden),
                *self.fp8(f"{p}.h_proj", s.hidden, s.hidden), self.norm(f"{p}.enorm", s.hidden),
                self.norm(f"{p}.hnorm", s.hidden), self.norm(f"{p}.norm", s.hidden),
                *self.mhc(f"{p}.", "head", self.hc, 1)]


def plan(shape, cfg: dict, where: str, layers: int) -> Plan:
    """The checkpoint of SHAPE's first LAYERS decoder layers (and its next-n layer), from
    its config fields CFG (read from WHERE); a ModelError naming the field or the number
    when it cannot be written."""
    from .config import checkpoint_config
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= shape.layers:
        raise ModelError(f"--layers {layers!r} is not valid for {shape.name}; valid: 1 to "
                         f"{shape.layers} (its num_hidden_layers)")
    out_cfg = checkpoint_config(cfg, where, shape, layers)
    names = _Names(cfg, shape)
    groups = [("globals", names.globals())]
    for i in range(layers):
        groups.append((f"layer {i}", names.block(f"layers.{i}", shape.compress_ratios[i],
                                                  i < shape.hash_layers)))
    for i in range(shape.mtp):
        groups.append((f"next-n layer {i}", names.nextn(i)))
    n = len(groups)
    shards = [Shard(f"model-{k + 1:05d}-of-{n:05d}.safetensors", what, tensors)
              for k, (what, tensors) in enumerate(groups)]
    return Plan(model=shape.name, layers=layers, mtp=shape.mtp, config=out_cfg, shards=shards)
