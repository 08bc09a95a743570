"""Probing a device: cuda:N through torch or NVML, cpu, or sim:NAME.

Nothing here runs at import time; every probe reads the environment when it
is called, so CUDA_VISIBLE_DEVICES set late still counts.
"""
from __future__ import annotations

import contextlib
import os
import platform as _platform
import sys
from typing import Optional
import re
from importlib import metadata

from ..errors import CapdispatchError
from . import catalog
from .spec import DeviceSpec


class ProbeError(CapdispatchError, RuntimeError):
    """A real device could not be probed (no driver, no such index, ...).
    `reason` is the message without the advice `hint` that follows it."""

    def __init__(self, reason: str, hint: str = ""):
        super().__init__(f"{reason}; {hint}" if hint else reason)
        self.reason, self.hint = reason, hint


SIM_HINT = ("to plan for a GPU this machine does not have, simulate it: --device sim:NAME "
            "(`dispatch catalog` lists the names)")


def nvml_failure(exc) -> str:
    """Why NVML could not start, in words, with what to do."""
    kind = type(exc).__name__
    if isinstance(exc, ImportError):
        return "NVML bindings not installed (pip install nvidia-ml-py, or capdispatch[nvml])"
    if kind == "NVMLError_LibraryNotFound":
        return "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver is installed"
    if kind == "NVMLError_DriverNotLoaded":
        return "the NVIDIA driver is not loaded (nvidia-smi says more)"
    if kind == "NVMLError_NoPermission":
        return "no permission to open the NVIDIA device files"
    if kind == "NVMLError_LibRmVersionMismatch":
        return "the NVML library and the loaded kernel driver differ in version (reboot, or reload the driver)"
    return f"NVML could not start: {exc}"


def _torch_failure() -> str:
    """Why torch sees no CUDA device, without initialising CUDA where it can be avoided."""
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "torch is not installed"
    if torch_cuda_version() is None:
        return f"torch {version} is a CPU build"
    return f"torch {version} (CUDA {torch_cuda_version()}) sees no CUDA device"


class AssumeCudaError(CapdispatchError, ValueError):
    """A bad --assume-cuda value."""


MAX_INDEX_DIGITS = 6     # no host has a million GPUs; longer is a typo or junk


def _shown(text) -> str:
    return ascii(text) if len(text) <= 80 else f"{ascii(text[:60])}... ({len(text)} characters)"


def parse_device(text: str) -> tuple:
    """'cuda:1' -> ('cuda', '1'); 'sim:rtx-3080' -> ('sim', 'rtx-3080'); 'cpu' -> ('cpu', '')."""
    if not isinstance(text, str):
        raise catalog.UnknownDeviceError(
            f"bad device {text!r}: expected a string cuda:N, cpu or sim:NAME, or a DeviceSpec")
    text = text.strip()
    if text == "cpu":
        return ("cpu", "")
    if text == "cuda":
        return ("cuda", "0")
    kind, sep, rest = text.partition(":")
    if sep and kind in ("cuda", "sim") and rest.strip():
        if kind == "cuda" and not (rest.isascii() and rest.isdigit()
                                   and len(rest) <= MAX_INDEX_DIGITS):
            raise catalog.UnknownDeviceError(
                f"bad device {_shown(text)}: a CUDA device is cuda:N with N a device index "
                f"(0, 1, ...; `dispatch devices` lists them)")
        return (kind, rest.strip())
    if sep and kind == "sim":
        raise catalog.UnknownDeviceError(
            f"bad device {_shown(text)}: sim: needs a NAME (one of {', '.join(catalog.names())})")
    raise catalog.UnknownDeviceError(
        f"bad device {_shown(text)}: expected cuda:N, cpu, or sim:NAME "
        f"(NAME one of {', '.join(catalog.names())})")


def check_assume_cuda(value: Optional[str]) -> Optional[str]:
    """--assume-cuda: a CUDA toolkit version such as 12.8 or 13.0 (None: not given)."""
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"\d{1,2}\.\d{1,2}(\.\d{1,3})?", value.strip(), re.ASCII):
        raise AssumeCudaError(f"bad --assume-cuda {_shown(str(value))}: expected a CUDA toolkit "
                              f"version such as 12.8 or 13.0")
    return value.strip()


def probe(device, *, via: str = "auto", assume_cuda: Optional[str] = None) -> DeviceSpec:
    """The facts of DEVICE ('cuda:N', 'cpu', 'sim:NAME', or a DeviceSpec)."""
    if isinstance(device, DeviceSpec):
        return device
    kind, rest = parse_device(str(device))
    if kind == "cpu":
        return probe_cpu()
    if kind == "sim":
        return catalog.simulate(rest, cuda=check_assume_cuda(assume_cuda))
    try:
        return _probe_cuda(int(rest), via)
    except ProbeError as exc:
        raise ProbeError(exc.reason, SIM_HINT) from None


def _probe_cuda(index: int, via: str) -> DeviceSpec:
    if via == "torch" or (via == "auto" and _torch_cuda_initialized()):
        return probe_torch(index)
    if via in ("nvml", "auto"):
        try:
            return probe_nvml(index)
        except ProbeError as exc:
            if via == "nvml":
                raise
            nvml_why = str(exc)
        try:
            return probe_torch(index)
        except ProbeError as exc:
            raise ProbeError(f"cuda:{index}: cannot read it: NVML: {nvml_why.partition(': ')[2]}; "
                             f"torch: {str(exc).partition(': ')[2]}") from None
    raise ValueError(f"probe via {via!r}: expected auto, torch or nvml")


def probe_cpu(notes=()) -> DeviceSpec:
    return DeviceSpec(id="cpu", name=_platform.processor() or _platform.machine() or "cpu",
                      platform="cpu", probe="cpu", notes=tuple(notes))


def _torch_cuda_initialized() -> bool:
    # Only ask torch if someone already imported it: probing must not pay for it.
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def cuda_from_local(version: str) -> Optional[str]:
    """'2.11.0+cu130' -> '13.0': the CUDA toolkit a torch wheel was built for."""
    from packaging.version import InvalidVersion, Version
    try:
        local = Version(version).local or ""
    except InvalidVersion:
        return None
    if local.startswith("cu") and local[2:].isdigit() and len(local) >= 5:
        digits = local[2:]
        return f"{int(digits[:-1])}.{digits[-1]}"
    return None


def torch_cuda_version() -> Optional[str]:
    """CUDA toolkit of the installed torch build, from its metadata (no import)."""
    try:
        found = cuda_from_local(metadata.version("torch"))
    except metadata.PackageNotFoundError:
        return None
    if found is None:   # a build without the +cuXYZ label: read torch/version.py, don't import it
        found = _cuda_from_version_file()
    return found


def _cuda_from_version_file() -> Optional[str]:
    try:
        path = metadata.distribution("torch").locate_file("torch/version.py")
        text = open(path, encoding="utf-8").read()
    except (metadata.PackageNotFoundError, OSError):
        return None
    return cuda_from_version_text(text)


def cuda_from_version_text(text: str) -> Optional[str]:
    """The `cuda = '13.0'` line of torch/version.py (None on a CPU build)."""
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([0-9.]+)['\"]", text, flags=re.M)
    return m.group(1) if m else None


def _torch_cannot_have_cuda() -> bool:
    # Installed metadata says: no torch, or a CPU build. Then importing it (seconds) cannot help.
    try:
        metadata.version("torch")
    except metadata.PackageNotFoundError:
        return True
    return "torch" not in sys.modules and torch_cuda_version() is None


def probe_torch(index: int) -> DeviceSpec:
    if _torch_cannot_have_cuda():
        raise ProbeError(f"cuda:{index}: {_torch_failure()}")
    try:
        import torch
    except ImportError:
        raise ProbeError(f"cuda:{index}: torch is not installed") from None
    if not torch.cuda.is_available():
        raise ProbeError(f"cuda:{index}: {_torch_failure()}")
    count = torch.cuda.device_count()
    if index >= count:
        raise ProbeError(f"cuda:{index}: no such device; torch sees {count} (cuda:0..cuda:{count - 1})")
    p = torch.cuda.get_device_properties(index)
    smem = getattr(p, "shared_memory_per_block_optin", None)
    uuid = getattr(p, "uuid", None)
    entry = catalog.match_name(p.name)
    return DeviceSpec(
        id=f"cuda:{index}", name=p.name, platform="cuda", vendor="NVIDIA",
        cc=(p.major, p.minor), sm_count=p.multi_processor_count,
        smem_optin_per_block=smem, memory=p.total_memory,
        cuda=torch.version.cuda, uuid=str(uuid) if uuid is not None else None,
        probe="torch", catalog_key=entry["key"] if entry else None,
    )


def _visible_to_physical(index: int, nvml) -> tuple:
    """Map CUDA's index N to an NVML handle, honouring CUDA_VISIBLE_DEVICES."""
    notes = []
    total = nvml.nvmlDeviceGetCount()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        order = list(range(total))
    else:
        order = [v.strip() for v in visible.split(",") if v.strip()]
        # CUDA stops at the first entry that is not a valid device.
        valid = []
        for v in order:
            if v.isdigit() and int(v) < total:
                valid.append(int(v))
            elif v.startswith(("GPU-", "MIG-")):
                valid.append(v)
            else:
                break
        order = valid
    if index >= len(order):
        raise ProbeError(f"cuda:{index}: no such device; {len(order)} visible "
                         f"(CUDA_VISIBLE_DEVICES={visible!r}, {total} on the bus)")
    target = order[index]
    if isinstance(target, int):
        handle = nvml.nvmlDeviceGetHandleByIndex(target)
    else:
        handle = nvml.nvmlDeviceGetHandleByUUID(target)
    names = {nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(total)}
    if len(names) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        notes.append("mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA's "
                     "default FASTEST_FIRST order may differ from NVML's PCI order; "
                     "set CUDA_DEVICE_ORDER=PCI_BUS_ID so cuda:N means the same card everywhere")
    return handle, notes


@contextlib.contextmanager
def nvml_session(where: str = ""):
    """pynvml (nvidia-ml-py), imported when called, initialised for the block and shut down
    after it: the one NVML session every caller opens (probing, `dispatch env`, a verdict's
    driver). Bindings that are missing or NVML that cannot start (nvml_failure says why), or
    an NVMLError a query in the block raises ("NVML query failed: ..."), is a ProbeError
    prefixed with WHERE ('cuda:1: '). Shutting down is best effort: a session whose answers
    are read is not failed by its close. Nothing is kept between sessions: each one asks
    the driver again."""
    try:
        import pynvml as nvml
    except ImportError as exc:
        raise ProbeError(f"{where}{nvml_failure(exc)}") from None
    try:
        nvml.nvmlInit()
    except Exception as exc:   # NVMLError subclasses, or a broken binding
        raise ProbeError(f"{where}{nvml_failure(exc)}") from None
    try:
        yield nvml
    except nvml.NVMLError as exc:
        raise ProbeError(f"{where}NVML query failed: {exc}") from None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:   # noqa: BLE001 - NVMLError, or a broken binding: the answers stand
            pass


def probe_nvml(index: int) -> DeviceSpec:
    """Facts through NVML: never initialises CUDA in this process."""
    with nvml_session(f"cuda:{index}: ") as nvml:
        handle, notes = _visible_to_physical(index, nvml)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else name
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle).total
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        sm_count = None
        try:
            sm_count = int(nvml.nvmlDeviceGetAttributes_v2(handle).multiprocessorCount) or None
        except (nvml.NVMLError, AttributeError):
            pass
    entry = catalog.match_name(name)
    if sm_count is None and entry is not None:
        sm_count = entry.get("sm_count")
        notes.append(f"SM count from the catalog entry {entry['key']!r} (NVML does not report it)")
    arch = catalog.arch_entry((major, minor))
    smem = arch.get("smem_optin_per_block") if arch else None
    if smem is not None:
        notes.append(f"opt-in shared memory from the sm_{major}{minor} architecture table (NVML does not report it)")
    return DeviceSpec(
        id=f"cuda:{index}", name=name, platform="cuda", vendor="NVIDIA",
        cc=(major, minor), sm_count=sm_count, smem_optin_per_block=smem, memory=memory,
        cuda=torch_cuda_version(), uuid=uuid, probe="nvml",
        catalog_key=entry["key"] if entry else None, notes=tuple(notes),
    )


def _nvml_count() -> int:
    """Visible devices by NVML; ProbeError (with the reason) when NVML cannot start."""
    with nvml_session() as nvml:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        total = nvml.nvmlDeviceGetCount()
        return total if visible is None else sum(1 for _ in _iter_visible(visible, total))


def local_devices(*, via: str = "auto") -> list:
    """Every local CUDA device (without initialising CUDA when NVML works), else cpu
    with notes saying why. VIA 'nvml' or 'torch' is an explicit way: if it cannot
    run, or finds no device, ProbeError says why."""
    why = []
    if via == "nvml" or (via == "auto" and not _torch_cuda_initialized()):
        try:
            count = _nvml_count()
        except ProbeError as exc:
            if via == "nvml":
                raise ProbeError(f"--probe nvml: {exc}", SIM_HINT) from None
            why.append(f"NVML: {exc}")
        else:
            if count:
                return [probe(f"cuda:{i}", via="nvml") for i in range(count)]
            if via == "nvml":
                raise ProbeError(f"--probe nvml: NVML sees no visible NVIDIA device "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})",
                                 SIM_HINT)
            why.append("NVML: no visible NVIDIA device")
    count = 0
    if not _torch_cannot_have_cuda():
        try:
            import torch
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except Exception as exc:   # a torch that fails to import is a fact, not a crash
            why.append(f"torch failed to import: {type(exc).__name__}: {exc}")
    if count:
        return [probe(f"cuda:{i}", via="torch") for i in range(count)]
    why.append(f"torch: {_torch_failure()}")
    if via == "torch":
        raise ProbeError(f"--probe torch: {_torch_failure()}", SIM_HINT)
    return [probe_cpu(notes=[f"no CUDA device found ({'; '.join(why)}); {SIM_HINT}"])]


def _iter_visible(visible: str, total: int):
    for v in visible.split(","):
        v = v.strip()
        if v.isdigit() and int(v) < total:
            yield v
        elif v.startswith(("GPU-", "MIG-")):
            yield v
        else:
            return
