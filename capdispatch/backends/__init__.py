"""Ops and the backends that implement them, with what each backend needs."""
from .base import (AnyFeature, Backend, Check, ComputeCapability, Facts, Feature, Library,
                   Op, Platform, TritonTarget)
from .registry import Registry, builtin

__all__ = ["AnyFeature", "Backend", "Check", "ComputeCapability", "Facts", "Feature", "Library",
           "Op", "Platform", "Registry", "TritonTarget", "builtin"]
