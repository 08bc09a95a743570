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
adapter's own files. Torch-free at import, like the users' face.
"""
from __future__ import annotations

from .backends import Backend, Op, Registry, moe, registry, v4_layout
from .backends.device_facts import emulate_card
from .dispatch import command, completion, options
from .dispatch.inputs import device_list, env_flag, op_list
from .dispatch.render import Cell, Row, wrap, wrap_lines
from .errors import ArgumentError, ArgumentTypeError
from .marked_yaml import Reader, did_you_mean
from .models import model_calls
from .policies import load_marked
from .safe_io import FileError, read_bytes, shown, write_atomic

__all__ = [
    "registry", "Registry", "Op", "Backend", "moe", "v4_layout",
    "Cell", "Row", "wrap", "wrap_lines",
    "device_list", "op_list", "env_flag", "options", "command", "completion", "ArgumentError",
    "ArgumentTypeError", "did_you_mean",
    "Reader", "load_marked", "read_bytes", "write_atomic", "shown", "FileError", "model_calls",
    "emulate_card",
]
