"""Writing a Plan: a sibling temporary folder filled shard by shard, then renamed to the
target only when every shard and the index are complete; on any failure the temporary
folder is removed and nothing is left at the target.

Each shard is a safetensors file written as a stream: the header first (every offset is
known from the plan), then each tensor's bytes as they are drawn, in row chunks, so at
most one chunk of one tensor is in memory. Values come from torch generators seeded from
the seed and the tensor's name: the same seed gives the same bytes, whatever the layers.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import time
from typing import Callable, Optional
import secrets

import attrs

from ...errors import BadInput
from ...safe_io import FileError

INDEX = "model.safetensors.index.json"
CHUNK = 1 << 24              # elements drawn at a time (16 Mi: <= 64 MiB of fp32 scratch)
# torch dtypes by safetensors name, resolved when torch is imported.
_TORCH = {"F8_E4M3": "float8_e4m3fn", "F8_E8M0": "float8_e8m0fnu", "I8": "int8",
          "BF16": "bfloat16", "F32": "float32", "I64": "int64"}
E4M3_MAX = 448.0


@attrs.frozen
class Written:
    path: str
    model: str
    layers: int
    mtp: int
    shards: int
    tensors: int
    bytes: int
    seconds: float
    seed: int


def _torch():
    try:
        import numpy  # noqa: F401  (the bytes of a tensor reach the file through it)
        import torch
    except ImportError as exc:
        raise BadInput(f"writing a checkpoint needs torch and numpy ({exc.name} is not "
                       f"installed): pip install 'capdispatch[torch]'") from None
    if not hasattr(torch, "float8_e8m0fnu"):
        raise BadInput(f"writing a checkpoint needs torch with float8_e8m0fnu (2.7 or later); "
                       f"this is torch {torch.__version__}: pip install -U torch")
    return torch


def generator(torch, seed: int, name: str):
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def _coprime(n: int, start: int) -> int:
    k = start
    while math.gcd(k, n) != 1:
        k += 1
    return k


def chunks(torch, t, seed: int):
    """The bytes of tensor T (a plan.Tensor), as uint8 torch tensors in storage order."""
    d = t.draw
    dtype = getattr(torch, _TORCH[t.dtype])
    rows = t.shape[0]
    per_row = math.prod(t.shape[1:])
    step = max(1, CHUNK // max(per_row, 1))
    g = generator(torch, seed, t.name)
    for r0 in range(0, rows, step):
        shape = (min(step, rows - r0), *t.shape[1:])
        if d.kind == "fp8":
            x = (torch.randn(shape, generator=g) * d.sigma).clamp_(-E4M3_MAX, E4M3_MAX)
            out = x.to(dtype)
        elif d.kind == "normal":
            out = (torch.randn(shape, generator=g) * d.sigma).to(dtype)
        elif d.kind == "fp4":
            out = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        elif d.kind == "scale":
            out = torch.full(shape, d.byte, dtype=torch.uint8)
        elif d.kind == "ones":
            out = torch.ones(shape, dtype=dtype)
        elif d.kind == "zeros":
            out = torch.zeros(shape, dtype=dtype)
        elif d.kind == "tid2eid":
            # Row t: experts (a*t + b*j) mod E for j < topk, distinct since gcd(b, E) = 1.
            a, b = _coprime(d.experts, 7), _coprime(d.experts, 37)
            tok = torch.arange(r0, r0 + shape[0], dtype=torch.int64)[:, None]
            out = (a * tok + b * torch.arange(d.topk, dtype=torch.int64)[None, :]) % d.experts
        else:
            raise AssertionError(d.kind)
        yield out.contiguous().view(torch.uint8).reshape(-1)


def header(shard) -> bytes:
    """The safetensors header of SHARD: its length (u64 little-endian), then the JSON,
    padded with spaces to a multiple of 8 bytes."""
    meta: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard.tensors:
        meta[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_shard(path: str, shard, seed: int) -> None:
    """Write SHARD to PATH, one chunk of one tensor in memory at a time."""
    torch = _torch()
    with open(path, "xb") as fh:
        fh.write(header(shard))
        for t in shard.tensors:
            done = 0
            for c in chunks(torch, t, seed):
                fh.write(c.numpy())
                done += c.numel()
            if done != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {done} bytes, planned {t.nbytes}")


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.1f} GiB"


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _check_target(out: str, need: int) -> str:
    """The parent folder of OUT, after refusing a target that exists and is not an empty
    folder, a parent that is not a folder, and a disk without room."""
    parent = os.path.dirname(out) or "."
    if os.path.lexists(out):
        if not os.path.isdir(out) or os.path.islink(out):
            raise FileError(out, "exists and is not a folder; give a new folder (or an empty one)")
        try:
            entries = os.listdir(out)
        except OSError as exc:
            raise FileError(out, f"cannot be read: {_why(exc)}") from None
        if entries:
            raise FileError(out, f"is not empty ({len(entries)} entries); give a new folder (or an "
                                 f"empty one): nothing is written over")
    if not os.path.isdir(parent):
        what = "does not exist" if not os.path.lexists(parent) else "is not a folder"
        raise FileError(parent, f"{what}; the checkpoint's folder is created inside an existing one")
    try:
        free = shutil.disk_usage(parent).free
    except OSError as exc:
        raise FileError(parent, f"cannot be read: {_why(exc)}") from None
    if free < need:
        raise FileError(parent, f"has {_gib(free)} free; the checkpoint needs {_gib(need)} "
                                f"(fewer --layers need less)")
    return parent


def _sibling(out: str, parent: str) -> str:
    """A new hidden folder beside OUT (made with the umask's mode, as OUT will have)."""
    while True:
        tmp = os.path.join(parent, f".{os.path.basename(out)}.{secrets.token_hex(4)}.partial")
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue
        except OSError as exc:
            raise FileError(parent, f"cannot create a folder in it: {_why(exc)}") from None


def write(plan, out, seed: int = 0, progress: Optional[Callable] = None) -> Written:
    """Write PLAN as a Hugging Face folder at OUT (a new or empty folder). PROGRESS, if
    given, is called as progress(done, total, shard) after each shard."""
    start = time.monotonic()
    out = os.path.abspath(os.fspath(out))
    parent = _check_target(out, plan.nbytes)
    _torch()
    tmp = _sibling(out, parent)
    current = tmp
    try:
        current = os.path.join(tmp, "config.json")
        with open(current, "x", encoding="utf-8") as fh:
            json.dump(plan.config, fh, indent=2)
            fh.write("\n")
        weight_map = {}
        for i, shard in enumerate(plan.shards):
            current = os.path.join(tmp, shard.file)
            write_shard(current, shard, seed)
            weight_map.update((t.name, shard.file) for t in shard.tensors)
            if progress is not None:
                progress(i + 1, len(plan.shards), shard)
        current = os.path.join(tmp, INDEX)
        with open(current, "x", encoding="utf-8") as fh:
            json.dump({"metadata": {"total_size": plan.nbytes}, "weight_map": weight_map}, fh,
                      indent=2)
            fh.write("\n")
        current = out
        os.rename(tmp, out)         # an empty folder at OUT is replaced (POSIX rename)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FileError(current, f"cannot be written: {_why(exc)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Written(path=out, model=plan.model, layers=plan.layers, mtp=plan.mtp,
                   shards=len(plan.shards), tensors=plan.tensors, bytes=plan.nbytes,
                   seconds=round(time.monotonic() - start, 3), seed=seed)
