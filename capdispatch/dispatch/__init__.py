"""Decisions: resolver, groups, binding, explain, the command line."""
from .binding import OpHandle, bind
from .errors import (BadInput, GroupDivergenceError, NoBackendError, StrictFallbackError,
                     Unsatisfiable)
from .explain import Plan, plan
from .group import GroupResolution, resolve_group
from .resolver import Candidate, Resolution, resolve
from .verify import Verification, verify_decisions

__all__ = ["BadInput", "Candidate", "GroupDivergenceError", "GroupResolution", "NoBackendError",
           "OpHandle", "Plan", "Resolution", "StrictFallbackError", "Unsatisfiable", "bind",
           "Verification", "plan", "resolve", "resolve_group", "verify_decisions"]
