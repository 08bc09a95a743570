"""Ops and the backends that implement them, with what each backend needs."""
from .base import (DECODE_SIZES, AnyFeature, Backend, Check, ComputeCapability, Facts, Feature, Library,
                   Op, Platform, ShapeRange, SizeArg, TORCH, TRITON, TritonTarget, failed_checks)
from .cases import Comparison
from .launch_limits import TileTarget, card_target, tiles_as
from .plugins import PluginInfo
from .registry import Registry, build, builtin
from .signature import Out

__all__ = ["DECODE_SIZES", "SizeArg", "AnyFeature", "Backend", "Check", "Comparison", "ComputeCapability", "Facts", "Feature", "Library",
           "Op", "Out", "Platform", "PluginInfo", "Registry", "ShapeRange", "TORCH", "TRITON", "TileTarget", "TritonTarget", "build", "builtin",
           "card_target", "failed_checks", "tiles_as"]
