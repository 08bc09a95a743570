"""The typed records the adapter's modules hand each other (frozen attrs)."""
from __future__ import annotations

from typing import Optional

import attrs


def _strs(values) -> dict:
    return {str(k): str(v) for k, v in (values or {}).items()}


def _strs_or_none(values):
    return None if values is None else _strs(values)


@attrs.frozen
class LaunchInputs:
    """What a launch asks of the adapter: the model, what the user set on SGLang's
    command line and in the environment, and capdispatch's own inputs. The launcher
    attaches it to SGLang's server-args record (pickled to every scheduler), so each
    rank decides from the same inputs; `dispatch sglang plan` builds one from its flags.

    CAPDISPATCH_POLICY, CAPDISPATCH_SET and CAPDISPATCH_STRICT are read from the
    environment of the process that decides (`env=`), never stored here."""
    model: Optional[str]
    kv_cache_dtype: Optional[str]
    ops: tuple                                   # the ops that apply (applicable_ops)
    reason: str
    explicit_fields: frozenset = frozenset()     # ServerArgs fields the user gave
    field_values: dict = attrs.field(factory=dict, converter=_strs)   # their values, as text
    # The route switches the user set, recorded by the launcher before SGLang's own
    # defaults ran; None: not recorded (the launcher's plugin did not run).
    user_env: Optional[dict] = attrs.field(default=None, converter=_strs_or_none)
    selections: tuple = ()                       # extra "op=backend" (dispatch sglang plan --set)
    selection_origin: str = "--set"
    policy: tuple = ()                           # extra policy paths (dispatch sglang plan --policy)
    assume_libs: tuple = ()                      # NAME[==VERSION] (dispatch sglang plan --assume-lib)
    strict: bool = False
    applied: dict = attrs.field(factory=dict)    # what the launcher set: name -> value
    devices: tuple = ()                          # the launcher's view of the GPUs (descriptions)
    schema: int = 1
    libs: Optional[str] = None                   # a library profile (dispatch sglang plan --libs)


@attrs.frozen
class PlanOptions:
    """capdispatch's own inputs of `dispatch sglang plan` (--set, --policy,
    --assume-lib, --strict, --libs), carried into SGLang's in-process resolution on
    the ServerArgs object so the plugin's launch step decides with them too.
    LIBS names a library profile that replaces this machine's inventory in the
    plan's decision (None: this machine's libraries)."""
    selections: tuple = ()
    selection_origin: str = "--set"
    policy: tuple = ()
    assume_libs: tuple = ()
    strict: bool = False
    libs: Optional[str] = None


@attrs.frozen
class RankState:
    """One rank of this process (never another GPU's): its card, its decision, what it routed."""
    gpu_id: int
    spec: object                 # DeviceSpec
    key: tuple                   # (device type, index) the route wrappers look tensors up by
    inputs: LaunchInputs
    release: object              # knobs.Release
    resolved: tuple              # ops decided (the same list on every rank)
    choices: dict                # op -> decide.OpChoice for this rank's card
    changes: tuple               # SGLang architecture facts corrected: (what, before, after)
    env: Optional[dict] = None   # the process environment the rank reads and switches (None: os.environ)
    agreed: object = None        # the group Plan after agreement
    moe_launch: object = None    # moe_plan.LaunchValue: the launch's moe_runner_backend, as SGLang resolved it
    proof: Optional[str] = None  # the rank's verification line (proof.verified), None on a simulated card
    agreement: Optional[dict] = None   # the group's record after agreement (rank.agree; in the report)
    report: Optional[str] = None       # where the rank's report was last written (report.py)


@attrs.frozen
class SglangRun:
    """What SGLang's own argument preparation and resolution gave (`-- SGLANG ARGS`)."""
    inputs: LaunchInputs
    tp_size: int
    layout: dict                 # gpus.gpu_ids keywords other than tp_size
    fields: dict                 # the ServerArgs fields and environment names the plan shows
