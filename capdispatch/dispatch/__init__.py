"""Decisions: resolver, groups, binding, explain, agreement, the command line."""
from ..policies import PolicyError
from .agreement import AgreementError, agree
from .binding import OpHandle, bind
from .errors import (BadInput, GroupDivergenceError, NoBackendError, StrictFallbackError,
                     Unsatisfiable)
from .explain import Plan, matrix, plan, plan_in
from .render import Cell, Row, render_matrix
from .group import GroupResolution, resolve_group
from .resolver import Candidate, Context, Resolution, context, policy_from_dict, resolve
from .verify import Verification, verify_decisions

__all__ = ["AgreementError", "BadInput", "Candidate", "Cell", "Context", "GroupDivergenceError",
           "GroupResolution", "NoBackendError", "OpHandle", "Plan", "PolicyError", "Resolution", "Row",
           "StrictFallbackError", "Unsatisfiable", "Verification", "agree", "bind", "context", "matrix",
           "plan", "plan_in", "policy_from_dict", "render_matrix", "resolve", "resolve_group",
           "verify_decisions"]
