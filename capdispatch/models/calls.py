"""What a model calls of capdispatch's ops (calls.yaml): per architecture, each op, on which
layers, how many times per layer, at what size per phase, and whether it works on the KV pool. The one declaration `plan --speed`, the rehearsal and the
SGLang knob map's check read; pure Python, read on each call (a few lines, nothing cached)."""
from __future__ import annotations

import os
import re
from typing import Optional

import attrs

from .errors import ModelError

DATA = "calls.yaml"
ARCHITECTURE = "DeepseekV4ForCausalLM"      # the architecture ModelShape describes (config.py)
PHASES = ("prefill", "decode")
SIZES = ("tokens", "requests")
SCALES = ("heads", "experts", "moe_intermediate")    # what a calibration records of its rank
_LAYERS = re.compile(r"every|compress_ratio (\d+)")


class CallsError(ModelError):
    """calls.yaml cannot be used: FILE:LINE: where: what is wrong."""

    def __init__(self, path: str, line: Optional[int], message: str):
        self.path, self.line = path, line
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


@attrs.frozen
class OpCalls:
    """One op a model calls: LAYERS ("every", or "compress_ratio N"), PER_LAYER calls on each
    of them, and per phase the size of one call ("tokens" or "requests"; a phase absent: not
    called in it). KV_POOL: it reads or writes the model's KV pool, so it runs only where the
    KV cache is that pool (an engine's adapter says under which KV-cache dtypes it is)."""
    op: str
    layers: str
    sizes: tuple            # ((phase, "tokens" | "requests"), ...) in PHASES' order
    scale: tuple = ()       # the rank's shapes its work grows with (SCALES)
    per_layer: int = 1      # calls on each layer that calls it
    kv_pool: bool = False   # works on the KV pool: runs under the pool's KV-cache dtypes only

    def per_forward(self, shape) -> int:
        """Calls in one forward of SHAPE (a ModelShape or RankShape): PER_LAYER on each of its
        layers that call it."""
        ratios = tuple(shape.compress_ratios)[:shape.layers]
        m = _LAYERS.fullmatch(self.layers)
        layers = shape.layers if m[1] is None else sum(1 for r in ratios if r == int(m[1]))
        return layers * self.per_layer

    def size(self, phase: str, n: int, next_n: int) -> Optional[int]:
        """The op's size in one call of PHASE for N (decode: requests; prefill: prompt
        tokens); None: the op is not called in PHASE."""
        kind = dict(self.sizes).get(phase)
        if kind is None:
            return None
        return n * next_n if kind == "tokens" and phase == "decode" else n


@attrs.frozen
class ModelCalls:
    """What one architecture calls, in the declaration's order; SOURCE: FILE:LINE."""
    architecture: str
    source: str
    calls: tuple            # OpCalls...

    @property
    def ops(self) -> tuple:
        return tuple(c.op for c in self.calls)

    def get(self, op: str) -> Optional[OpCalls]:
        return next((c for c in self.calls if c.op == op), None)

    def not_called(self, op: str) -> str:
        """The one wording of an op the model does not call."""
        return (f"{self.architecture} does not call op {op!r} ({self.source} lists "
                f"{', '.join(self.ops)}); add it there to have it predicted and rehearsed")

    def phase_ops(self, phase: str) -> tuple:
        return tuple(c.op for c in self.calls if dict(c.sizes).get(phase))

    @property
    def any_kv_cache_dtype(self) -> tuple:
        """The ops that run whatever the KV-cache dtype: those not declared `kv_pool`."""
        return tuple(c.op for c in self.calls if not c.kv_pool)


def _path() -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), DATA)


def read(path: Optional[str] = None, *, valid_ops=None) -> dict:
    """Architecture -> ModelCalls from PATH (default the packaged calls.yaml). VALID_OPS: the
    op names it may list (default: the registry's)."""
    from ..marked_yaml import Reader
    path = path or _path()
    if valid_ops is None:
        from ..backends import builtin
        valid_ops = list(builtin().ops)
    r = Reader.from_file(path, limit=1 << 16, error=CallsError, kind="model calls file")
    top = r.fields(r.root(), "the model calls", required=("schema", "architectures"), top=True)
    if r.integer(top["schema"], "schema") != 1:
        raise r.err(top["schema"], "schema: only 1 is known")
    out = {}
    for arch, knode, node in r.mapping(top["architectures"], "architectures"):
        where = f"architectures.{arch}"
        calls = []
        for op, onode, body in r.mapping(node, where):
            r.name(onode, where, valid_ops, noun="op")
            w = f"{where}.{op}"
            f = r.fields(body, w, required=("layers",), optional=PHASES + ("scale", "per_layer", "kv_pool"))
            layers = r.text(f["layers"], f.where("layers"), need="every or compress_ratio N")
            if not _LAYERS.fullmatch(layers):
                raise r.err(f["layers"], f"{f.where('layers')}: {layers!r} is not valid "
                                         f"(valid: every, compress_ratio N)")
            sizes = tuple((p, r.choice(f[p], f.where(p), SIZES)) for p in PHASES if p in f)
            if not sizes:
                raise r.err(body, f"{w}: names no phase (give prefill, decode or both)")
            scale = r.names(f["scale"], f.where("scale"), SCALES, noun="shape") if "scale" in f else ()
            per_layer = r.integer(f["per_layer"], f.where("per_layer")) if "per_layer" in f else 1
            if per_layer < 1:
                raise r.err(f["per_layer"], f"{f.where('per_layer')}: {per_layer} is not valid "
                                            f"(valid: an integer >= 1, the calls on each layer)")
            kv_pool = r.boolean(f["kv_pool"], f.where("kv_pool")) if "kv_pool" in f else False
            calls.append(OpCalls(op, layers, sizes, scale, per_layer, kv_pool))
        out[arch] = ModelCalls(arch, f"{r.path}:{r.line(knode)}", tuple(calls))
    return out


def model_calls(architecture: str = ARCHITECTURE, *, path: Optional[str] = None) -> ModelCalls:
    """What ARCHITECTURE calls; a ModelError naming the file and the architectures it declares."""
    data = read(path)
    if architecture not in data:
        raise ModelError(f"{path or DATA}: declares no calls of architecture {architecture!r} "
                         f"(declared: {', '.join(data) or 'none'})")
    return data[architecture]
