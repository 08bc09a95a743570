"""Host-side helpers of the Triton kernel modules: which way their kernels were built,
the toolbox's @triton.jit modules built the same way, and the device check before a launch.
"""
from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path

import torch
import triton

from ...errors import ArgumentError, UnsupportedDeviceError
from ..device_facts import facts

__all__ = ["interpreted", "jit_module", "check_device"]


def interpreted(kernel) -> bool:
    """Whether KERNEL was built for Triton's CPU interpreter: ``triton.jit`` chooses when
    it decorates (TRITON_INTERPRET=1 when the kernel's module is imported)."""
    return not isinstance(kernel, triton.runtime.jit.JITFunction)


def _probe(x):
    return x


_lock = threading.RLock()   # a toolbox module loads the modules it uses


def jit_module(name: str) -> types.ModuleType:
    """The toolbox module NAME (e.g. ``"codec"``) with its @triton.jit helpers built the
    way a kernel decorated now is built, compiled or interpreted.

    An interpreted kernel cannot call a compiled helper, nor the reverse, and a process
    may import a kernel module both ways (the tests reload one under the interpreter),
    so each way gets its own copy of the module, loaded once."""
    mode = "interpreted" if interpreted(triton.jit(_probe)) else "compiled"
    full = f"{__package__}._{name}_{mode}"
    with _lock:
        mod = sys.modules.get(full)
        if mod is None:
            spec = importlib.util.spec_from_file_location(full, Path(__file__).with_name(f"{name}.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[full] = mod
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                del sys.modules[full]
                raise
    return mod


def check_device(t: torch.Tensor, *, interpreted: bool, kernels: str, native_fp8: bool = False,
                 instead: str = "") -> None:
    """Raise when T's device cannot run the KERNELS (e.g. "Triton KV-cache kernels"):
    CPU tensors need kernels built for the interpreter, and the native-fp8 variants need
    compute capability >= 8.9 on NVIDIA cards (INSTEAD names what runs below that)."""
    if t.is_cpu:     # (is_cpu / is_cuda: no torch.device built on the launch path)
        if not interpreted:
            raise ArgumentError(f"{kernels} need CUDA tensors, got tensors on {t.device} "
                                "(CPU tensors only when imported with TRITON_INTERPRET=1)")
        return
    if native_fp8 and t.is_cuda and torch.version.hip is None:
        f = facts(t.device)          # the card's own, or the emulated card's
        if not f.fp8:
            cc = f.cc
            raise UnsupportedDeviceError(f"native-fp8 {kernels} need compute capability >= 8.9, "
                                         f"{f.label} has {cc[0]}.{cc[1]}; {instead}")
