"""capdispatch: which kernel runs each op on each GPU, and why.

This module is the users' face: probe, plan, resolve, explain, bind, batch, lock,
verify. Plugin and adapter authors import `capdispatch.extend`; benchmarks import
`capdispatch.bench` (docs/api.md lists all three). Every name is the code's own, imported
plainly; where that name is a generic verb its module is lent instead (`capdispatch.lock.freeze`).

Importing this package imports neither torch nor any kernel library, reads no
environment variable and probes no device: all of that happens when a decision
is made.
"""
from __future__ import annotations

from . import proof
from .backends.batch_scope import batch, given
from .capabilities import DeviceSpec, ProbeError, UnknownDeviceError, probe
from .capabilities.lib_profiles import target_libs
from .dispatch import (AgreementError, BadInput, Context, GroupDivergenceError, NoBackendError, OpHandle,
                       Plan, Resolution, StrictFallbackError, Unsatisfiable, Verification, agree, bind,
                       context, matrix, plan, plan_in, policy_from_dict, render_matrix, resolve,
                       resolve_group, verify_decisions)
from .dispatch import agreement, lock
from .dispatch.binding import bind_resolution
from .dispatch.lock import Drift, Lock, LockDriftError, LockError
from .errors import CapdispatchError, ExitCode, UnsupportedDeviceError
from .models import Layout, ModelError, ModelShape, RankShape, builtin_names, load_model
from .policies import PolicyError, SelectionError
from .proof.rehearsals import RehearsalRequiredError, RehearsalVerdict, rehearsal_verdict
from .version import __version__

__all__ = [
    # Errors: one root, one exit-code table.
    "CapdispatchError", "ExitCode", "BadInput", "Unsatisfiable", "NoBackendError", "StrictFallbackError",
    "GroupDivergenceError", "UnsupportedDeviceError", "UnknownDeviceError", "ProbeError", "PolicyError",
    "SelectionError", "ModelError", "AgreementError",
    # Devices and the libraries a group is planned with.
    "probe", "DeviceSpec", "target_libs",
    # Decisions, their explanation, and binding them to callables.
    "resolve", "resolve_group", "plan", "plan_in", "Plan", "matrix", "render_matrix", "Context", "context",
    "Resolution", "policy_from_dict", "bind", "bind_resolution", "OpHandle", "batch", "given",
    # One group, one decision: agreement (agreement.digest), canary verdicts (proof.lookup),
    # rehearsal verdicts, and lock files (lock.freeze, lock.load, lock.compare, lock.check).
    "agree", "agreement", "verify_decisions", "Verification", "proof", "rehearsal_verdict",
    "RehearsalVerdict", "RehearsalRequiredError", "lock", "Lock", "Drift", "LockError", "LockDriftError",
    # The model-shape record: a model's facts and one rank's shapes under a layout.
    "load_model", "builtin_names", "ModelShape", "RankShape", "Layout",
]


def __dir__():
    # The face is __all__: the submodules imported on the way (capdispatch.dispatch, ...)
    # are implementation, reachable but not listed.
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})
