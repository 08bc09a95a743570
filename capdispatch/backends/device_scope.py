"""The CUDA device a kernel launch runs on.

Triton (and any launcher that reads the current device) launches on the *current*
CUDA device, not the tensors' device: on a mixed box a call with tensors on cuda:1
from a thread whose current device is cuda:0 would launch on the wrong card. Every
backend launch goes through ``on_device(tensor.device)``. CPU tensors (the Triton
interpreter) need no scope, and neither does a launch on the device that is already
current, which is every launch in a serving process (one device per rank): there the
scope is one index comparison rather than a device switch and back.
"""
from __future__ import annotations

import contextlib

import torch

from .device_facts import facts as _facts

__all__ = ["capability", "cdiv", "on_device", "on_device_of"]

_NO_SCOPE = contextlib.nullcontext()


def on_device(device: torch.device):
    """A context that makes DEVICE current for the launches inside it (no-op off CUDA
    and when DEVICE is current already)."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return _NO_SCOPE
    return torch.cuda.device(device)


def on_device_of(t: torch.Tensor):
    """``on_device(t.device)`` for the launch path: reads the tensor's device index
    (``is_cuda``, ``get_device``) and the current device (``torch._C._cuda_getDevice``)
    without building a ``torch.device`` or going through ``torch.cuda.current_device``'s
    lazy-init check (a CUDA tensor means CUDA is initialised), a fraction of a
    microsecond where the device is current already."""
    if not t.is_cuda:
        return _NO_SCOPE
    index = t.get_device()
    if index == torch._C._cuda_getDevice():
        return _NO_SCOPE
    return torch.cuda.device(index)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: plain integer arithmetic on the host
    (``triton.cdiv`` goes through Triton's constexpr-function call, a few us a launch)."""
    return -(-a // b)


def capability(device: torch.device) -> tuple:
    """The compute capability launches on DEVICE are planned for: the card's own, or the
    emulated card's (device_facts); never another device's."""
    return _facts(device).cc
