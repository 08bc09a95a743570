"""capdispatch: which kernel runs each op on each GPU, and why.

Importing this package imports neither torch nor any kernel library, reads no
environment variable and probes no device: all of that happens when a decision
is made.
"""
from __future__ import annotations

from .version import __version__  # noqa: F401

_API = {
    "CapdispatchError": ("capdispatch.errors", "CapdispatchError"),
    "ExitCode": ("capdispatch.errors", "ExitCode"),      # every command's exit status, one table
    "ArgumentError": ("capdispatch.errors", "ArgumentError"),
    "ArgumentTypeError": ("capdispatch.errors", "ArgumentTypeError"),
    "UnsupportedDeviceError": ("capdispatch.errors", "UnsupportedDeviceError"),
    "probe": ("capdispatch.capabilities", "probe"),
    "DeviceSpec": ("capdispatch.capabilities", "DeviceSpec"),
    "resolve": ("capdispatch.dispatch", "resolve"),
    "resolve_group": ("capdispatch.dispatch", "resolve_group"),
    "plan": ("capdispatch.dispatch", "plan"),
    "matrix": ("capdispatch.dispatch", "matrix"),
    "render_matrix": ("capdispatch.dispatch", "render_matrix"),
    "wrap_text": ("capdispatch.dispatch.render", "wrap"),         # text at the terminal's width
    "wrap_lines": ("capdispatch.dispatch.render", "wrap_lines"),
    "bind": ("capdispatch.dispatch", "bind"),
    "bind_resolution": ("capdispatch.dispatch.binding", "bind_resolution"),
    "OpHandle": ("capdispatch.dispatch", "OpHandle"),
    "Resolution": ("capdispatch.dispatch", "Resolution"),
    "NoBackendError": ("capdispatch.dispatch", "NoBackendError"),
    "Unsatisfiable": ("capdispatch.dispatch", "Unsatisfiable"),
    "BadInput": ("capdispatch.dispatch", "BadInput"),
    "StrictFallbackError": ("capdispatch.dispatch", "StrictFallbackError"),
    "GroupDivergenceError": ("capdispatch.dispatch", "GroupDivergenceError"),
    "PolicyError": ("capdispatch.policies", "PolicyError"),
    "SelectionError": ("capdispatch.policies", "SelectionError"),
    "UnknownDeviceError": ("capdispatch.capabilities", "UnknownDeviceError"),
    "ProbeError": ("capdispatch.capabilities", "ProbeError"),
    "Context": ("capdispatch.dispatch", "Context"),
    "context": ("capdispatch.dispatch", "context"),
    "plan_in": ("capdispatch.dispatch", "plan_in"),
    "Plan": ("capdispatch.dispatch.explain", "Plan"),     # what plan() and plan_in() return
    "target_libs": ("capdispatch.capabilities.lib_profiles", "target_libs"),   # whose libraries plan a group
    # One reading of each kind of input, for the command line, the API and the adapters.
    "device_list": ("capdispatch.dispatch.inputs", "device_list"),
    "op_list": ("capdispatch.dispatch.inputs", "op_list"),
    "env_flag": ("capdispatch.dispatch.inputs", "env_flag"),
    # For commands of adapters: the shared options (declared once, checked at parse time,
    # completed by the shell), the parser they go on, and the one command handler.
    "add_option": ("capdispatch.dispatch.options", "add"),
    "CommandParser": ("capdispatch.dispatch.options", "Parser"),
    "run_command": ("capdispatch.dispatch.command", "run"),
    "check_layout": ("capdispatch.dispatch.options", "check_layout"),
    # Shell completion of an argparse action (argcomplete), for commands of adapters.
    "complete_devices": ("capdispatch.dispatch.completion", "devices"),
    "complete_ops": ("capdispatch.dispatch.completion", "ops"),
    "complete_selections": ("capdispatch.dispatch.completion", "selections"),
    "complete_libraries": ("capdispatch.dispatch.completion", "libraries"),
    "complete_profiles": ("capdispatch.dispatch.completion", "profiles"),
    "policy_from_dict": ("capdispatch.dispatch", "policy_from_dict"),
    "agree": ("capdispatch.dispatch", "agree"),
    "AgreementError": ("capdispatch.dispatch", "AgreementError"),
    "plan_digest": ("capdispatch.dispatch.agreement", "digest"),
    "verify_decisions": ("capdispatch.dispatch", "verify_decisions"),
    # The cached canary verdict of a backend on a card (None: not verified with today's software).
    "cached_verdict": ("capdispatch.proof", "lookup"),
    "Verification": ("capdispatch.dispatch", "Verification"),
    # The recorded `dispatch rehearse` verdict of a group's cards, software and decisions.
    "rehearsal_verdict": ("capdispatch.proof.rehearsals", "verdict_for"),
    "RehearsalVerdict": ("capdispatch.proof.rehearsals", "RehearsalVerdict"),
    "RehearsalRequiredError": ("capdispatch.proof.rehearsals", "RehearsalRequiredError"),
    "lock": ("capdispatch.dispatch.lock", "freeze"),
    "load_lock": ("capdispatch.dispatch.lock", "load"),
    "compare_lock": ("capdispatch.dispatch.lock", "compare"),
    "check_lock": ("capdispatch.dispatch.lock", "check"),
    "Lock": ("capdispatch.dispatch.lock", "Lock"),
    "Drift": ("capdispatch.dispatch.lock", "Drift"),
    "LockError": ("capdispatch.dispatch.lock", "LockError"),
    "LockDriftError": ("capdispatch.dispatch.lock", "LockDriftError"),
    # For adapters and plugins: the registry of declarations, the MoE weight record and its
    # one-time preparation, the matrix's cells, the did-you-mean helper of every error.
    "registry": ("capdispatch.backends", "builtin"),
    "batch": ("capdispatch.backends.batch_scope", "batch"),
    "given": ("capdispatch.backends.batch_scope", "given"),
    "MoeWeights": ("capdispatch.backends.moe", "MoeWeights"),
    "prepare_moe_weights": ("capdispatch.backends.moe", "prepare"),
    "Cell": ("capdispatch.dispatch", "Cell"),
    "Row": ("capdispatch.dispatch", "Row"),
    "did_you_mean": ("capdispatch.policies", "did_you_mean"),
    # The model-shape record: a model's facts and one rank's shapes under a layout.
    "load_model": ("capdispatch.models", "load_model"),
    "builtin_models": ("capdispatch.models", "builtin_names"),
    "ModelShape": ("capdispatch.models", "ModelShape"),
    "RankShape": ("capdispatch.models", "RankShape"),
    "ModelLayout": ("capdispatch.models", "Layout"),
    "ModelError": ("capdispatch.models", "ModelError"),
    "load_marked": ("capdispatch.policies", "load_marked"),
    # The marked YAML reader of every YAML input (file:line in each error), for adapters' files.
    "YamlReader": ("capdispatch.marked_yaml", "Reader"),
    # Bounded, non-blocking reading of a regular file (adapters read their own files so).
    "read_file": ("capdispatch.safe_io", "read_bytes"),
    "FileError": ("capdispatch.safe_io", "FileError"),
    # Atomic replacement of a regular file (no temporary file left on failure), and a path
    # as messages show it (control characters escaped), for adapters' own files.
    "write_file": ("capdispatch.safe_io", "write_atomic"),
    "show_path": ("capdispatch.safe_io", "shown"),
    # For benchmarks: what they measure with and against, as calibration and serving do.
    # A name whose attribute is None is the module itself, a namespace of related names.
    "build_registry": ("capdispatch.backends.registry", "build"),    # a new one (plugins=False: built-ins only)
    "without_checks": ("capdispatch.backends.torch_ops", "without_checks"),
    "SizeArg": ("capdispatch.backends.base", "SizeArg"),
    "size_dispatcher": ("capdispatch.dispatch.sized", "dispatcher"),
    "TileTarget": ("capdispatch.backends.launch_limits", "TileTarget"),
    "tiles_as": ("capdispatch.backends.launch_limits", "tiles_as"),
    "card_tile_target": ("capdispatch.backends.launch_limits", "card_target"),
    "kv_page_bytes": ("capdispatch.backends.v4_layout", "bytes_per_page"),
    "compile_matrix": ("capdispatch.backends.compile_matrix", None),
    "calibration_inputs": ("capdispatch.calibrate.inputs", None),
    "cuda_timer": ("capdispatch.calibrate.timing", "cuda_timer"),
    "served_forward": ("capdispatch.calibrate.served", "forward"),
    "served_capture_max_bs": ("capdispatch.calibrate.served", "capture_max_bs"),
    "SERVED_ROUTE_SKEW": ("capdispatch.calibrate.ladder", "SERVED_ROUTE_SKEW"),
    "speed_model": ("capdispatch.dispatch.speed", None),
    "memory_estimate": ("capdispatch.models.memory", None),
}

__all__ = sorted(_API)


def __dir__():
    # The face is __all__: submodules imported on the way (capdispatch.dispatch, ...) are
    # implementation, reachable but not listed.
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__") and n.endswith("__")})


def __getattr__(name):
    if name in _API:
        import importlib
        module, attr = _API[name]
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'capdispatch' has no attribute {name!r}")
