"""The benchmarks' face: what they measure with and against, as calibration and serving do.

A fresh registry (`registry.build(plugins=False)`: built-ins only), the unchecked torch
ops, size-keyed dispatch (`sized.dispatcher`), launch tile targets, the V4 KV page
(`v4_layout.bytes_per_page`), the compile matrix, calibration's inputs, timer and served
forward (`served.forward`, `served.capture_max_bs`), the speed model and the memory
estimate. Importing it imports torch (benchmarks measure with it); planning imports the
users' face only.
"""
from __future__ import annotations

from .backends import compile_matrix, registry, v4_layout
from .backends.base import SizeArg
from .backends.launch_limits import TileTarget, card_target, tiles_as
from .backends.torch_ops import without_checks
from .calibrate import inputs, served
from .calibrate.ladder import SERVED_ROUTE_SKEW
from .calibrate.timing import cuda_timer
from .dispatch import sized, speed
from .models import memory

__all__ = [
    "registry", "without_checks", "SizeArg", "sized", "TileTarget", "tiles_as", "card_target",
    "v4_layout", "compile_matrix", "inputs", "cuda_timer", "served", "SERVED_ROUTE_SKEW", "speed",
    "memory",
]
