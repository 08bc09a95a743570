"""The face of plugin and adapter authors: what a backend plugin or a serving adapter
builds on, beside the users' face (`capdispatch`).

The registry of declarations (`registry.builtin()`, `Registry`, `Op`, `Backend`), the MoE
weight record and its one-time preparation (`moe.MoeWeights`, `moe.prepare`), the V4 KV
layout's constants (`v4_layout.TOKEN_BYTES`: a route tells V4 cache views apart by it), an
emulated card's launch facts for the kernels on a real device (`emulate_card`), what a
model calls (`model_calls(architecture)`: the one reader of capdispatch/models/calls.yaml), the matrix's
cells, one reader of each input kind, the shared command-line options (`options.add`,
`options.Parser`, `options.check_layout`), the one command handler (`command.run`), shell
completion (`completion.devices`, ...), the marked YAML reader and bounded file I/O for an
adapter's own files, and what a serving adapter says of its engine's own kernels
(`Hosted`: a backend the engine runs itself, judged by the engine's statement in the
requirement vocabulary `Library`, `Feature`, `AnyFeature`, `ComputeCapability`, `Platform`,
`TritonTarget`; `capdispatch.context(hosted=...)`). Torch-free at import, like the users' face.
"""
from __future__ import annotations

from .backends import Backend, Op, Registry, moe, registry, v4_layout
from .backends.base import AnyFeature, Check, ComputeCapability, Feature, Library, Platform, TritonTarget
from .backends.device_facts import emulate_card
from .capabilities.lib_profiles import lookup as lib_profile, names as lib_profile_names
from .dispatch import command, completion, options
from .dispatch.inputs import device_list, env_flag, op_list
from .dispatch.render import Cell, Row, wrap, wrap_lines
from .dispatch.resolver import HOST_NOT_VERIFIED, Hosted
from .errors import ArgumentError, ArgumentTypeError
from .marked_yaml import Reader, did_you_mean
from .models import model_calls
from .policies import load_marked
from .safe_io import FileError, read_bytes, shown, write_atomic

def feature_names() -> tuple:
    """The device features a requirement may name (capabilities/features.yaml)."""
    from .capabilities import features
    return tuple(features.rules())


__all__ = [
    "registry", "Registry", "Op", "Backend", "moe", "v4_layout",
    "Cell", "Row", "wrap", "wrap_lines",
    "device_list", "op_list", "env_flag", "options", "command", "completion", "ArgumentError",
    "ArgumentTypeError", "did_you_mean",
    "Reader", "load_marked", "read_bytes", "write_atomic", "shown", "FileError", "model_calls",
    "Hosted", "HOST_NOT_VERIFIED", "Library", "Feature", "AnyFeature", "ComputeCapability", "Platform",
    "TritonTarget", "feature_names", "emulate_card", "Check", "lib_profile", "lib_profile_names",
]
