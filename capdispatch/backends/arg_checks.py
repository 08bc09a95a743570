"""Tensor-argument checks the ops' entry points share. Each raises capdispatch's
ArgumentTypeError / ArgumentError naming the argument, what it needs and what it got;
the op-specific checks (shapes, layouts) stay in each op's module.

Imported by the ops' reference modules, which import torch: never by ``import capdispatch``.
"""
from __future__ import annotations

import math

import torch

from ..errors import ArgumentError, ArgumentTypeError

__all__ = ["INDEX_DTYPES", "tensor", "dtype_in", "index_dtype", "same_device", "unit_last_stride", "finite_float"]

INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(x, name: str) -> torch.Tensor:
    """X, raising unless it is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _dtype_names(dtypes) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def dtype_in(t: torch.Tensor, name: str, dtypes: tuple) -> torch.Tensor:
    """T, raising unless its dtype is one of DTYPES ("k must be bfloat16, got torch.float32")."""
    if t.dtype not in dtypes:
        raise ArgumentTypeError(f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}")
    return t


def index_dtype(t: torch.Tensor, name: str) -> torch.Tensor:
    """T, raising unless it holds int32 or int64 ids."""
    return dtype_in(t, name, INDEX_DTYPES)


def same_device(t: torch.Tensor, name: str, device: torch.device, other: str) -> torch.Tensor:
    """T, raising unless it is on DEVICE, the device of the argument named OTHER."""
    if t.device != device:
        raise ArgumentError(f"{name} is on {t.device}, {other} is on {device}")
    return t


def unit_last_stride(t: torch.Tensor, name: str) -> torch.Tensor:
    """T, raising unless its last dimension is unit-stride (an empty T passes)."""
    if t.numel() and t.stride(-1) != 1:
        raise ArgumentError(f"{name}'s last dim must be unit-stride, got strides {t.stride()}")
    return t


def finite_float(x, name: str):
    """X, raising unless it is a finite Python float (or int): a scale read on the host."""
    if not isinstance(x, (float, int)) or isinstance(x, bool) or not math.isfinite(x):
        raise ArgumentTypeError(f"{name} must be a finite Python float, got {x!r}")
    return x
