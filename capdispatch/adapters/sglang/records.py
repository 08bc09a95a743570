"""The typed records the adapter's modules hand each other (frozen attrs): what a launch
asks, the SGLang settings, the decision per op and device, a rank's state."""
from __future__ import annotations

from typing import Optional

import attrs

import capdispatch as cd


def _strs(values) -> dict:
    return {str(k): str(v) for k, v in (values or {}).items()}


def _strs_or_none(values):
    return None if values is None else _strs(values)


@attrs.frozen
class PlanOptions:
    """capdispatch's own inputs that `dispatch sglang plan` adds to a launch's (--set,
    --policy, --assume-lib, --strict, --libs), carried into SGLang's in-process resolution
    on the ServerArgs object so the plugin's launch step decides with them too. LIBS names
    a library profile that replaces this machine's inventory in the plan's decision (None:
    this machine's libraries). A real launch has none of them: it reads CAPDISPATCH_POLICY,
    CAPDISPATCH_SET and CAPDISPATCH_STRICT from the environment of the process that decides."""
    selections: tuple = ()                       # "op=backend"
    selection_origin: str = "--set"
    policy: tuple = ()                           # policy file paths
    assume_libs: tuple = ()                      # NAME[==VERSION]
    strict: bool = False
    libs: Optional[str] = None


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
    options: PlanOptions = PlanOptions()         # what `dispatch sglang plan` adds
    applied: dict = attrs.field(factory=dict)    # what the launcher set: name -> value
    devices: tuple = ()                          # the launcher's view of the GPUs (descriptions)
    schema: int = 1


@attrs.frozen
class Agreement:
    """The TP group's record after agreement (rank.agree): the ranks' devices, this rank's
    index, the decision's digest and the digest with every rank's route-install outcomes
    in it, those outcomes (per rank, op -> outcome), and what a rank did not carry out."""
    ranks: tuple                 # device ids in rank order
    rank: int
    plan_digest: str
    digest: str
    installs: tuple              # per rank: {op: "installed" | "failed: ..." | action}
    not_carried_out: tuple = ()  # one line per op and rank
    rehearsal: dict | None = None  # the recorded rehearsal's verdict for this group (rehearsal.check)

    @property
    def agreed(self) -> bool:
        return not self.not_carried_out

    def to_dict(self) -> dict:
        out = {"ranks": list(self.ranks), "rank": self.rank, "plan_digest": self.plan_digest,
               "digest": self.digest, "installs": [dict(i) for i in self.installs], "agreed": self.agreed,
               "not_carried_out": list(self.not_carried_out)}
        if self.rehearsal is not None:
            out["rehearsal"] = self.rehearsal
        return out


@attrs.frozen
class RankState:
    """One rank of this process (never another GPU's): its card, its decision, what it routed."""
    gpu_id: int
    spec: cd.DeviceSpec
    key: tuple                   # (device type, index) the route wrappers look tensors up by
    inputs: LaunchInputs
    release: object              # knobs.Release
    resolved: tuple              # ops decided (the same list on every rank)
    choices: dict                # op -> OpChoice for this rank's card
    changes: tuple               # SGLang architecture facts corrected: (what, before, after)
    env: Optional[dict] = None   # the process environment the rank reads and switches (None: os.environ)
    agreed: Optional[cd.Plan] = None     # the group's decision after agreement
    moe_launch: Optional[SglangSetting] = None   # the launch's moe_runner_backend, as SGLang resolved it
    proof: Optional[str] = None  # the rank's verification line (proof.verified), None on a simulated card
    agreement: Optional[Agreement] = None   # the group's record after agreement (in the report)
    report: Optional[str] = None       # where the rank's report was last written (report.py)
    emulated: Optional[dict] = None    # the card this rank emulates, and on what (emulate.install)


@attrs.frozen
class SglangRun:
    """What SGLang's own argument preparation and resolution gave (`-- SGLANG ARGS`)."""
    inputs: LaunchInputs
    tp_size: int
    layout: dict                 # gpus.gpu_ids keywords other than tp_size
    fields: dict                 # the ServerArgs fields and environment names the plan shows


# ------------------------------------------------------------------ the decision

@attrs.frozen
class BucketChoice:
    """One size bucket of a routed or kept op: sizes in (LOWER, UPPER] (None: from 1 /
    every larger size), the backend capdispatch decided for them, and what runs there."""
    lower: Optional[int]
    upper: Optional[int]
    backend: str             # capdispatch's decision for these sizes
    action: str              # "routed" (capdispatch's kernel) | "kept" (SGLang's own call stays)
    runs: str                # the kernel that runs: `backend` where routed, SGLang's own where kept

    def label(self) -> str:
        if self.upper is not None:
            return f"<={self.upper}"
        return f">{self.lower}" if self.lower is not None else "any"


@attrs.frozen
class OpChoice:
    op: str
    device: str
    resolution: Optional[cd.Resolution]   # None where no decision was needed
    action: str              # "routed" | "kept" | "reported"
    why: str
    setting: tuple = ()      # SglangSetting...: what SGLang needs to run this backend itself
    warning: Optional[str] = None   # to log: SGLang's kernel kept where it cannot run (a user switch)
    # The kernel that runs: a capdispatch backend's name ("torch/flashmla" across buckets),
    # SGLang's own by the backend it is, or "sglang" where it has no capdispatch name.
    runs: Optional[str] = None
    buckets: tuple = ()      # BucketChoice...: per size bucket, where the resolution has buckets
    # How the rank's route install went (rank.apply_routes): "installed", "failed: <why>",
    # "removed" (SGLang's own again); None where the rank did not touch a route.
    install: Optional[str] = None

    @property
    def routed(self) -> bool:
        """A capdispatch kernel replaces SGLang's own at the call site (for some sizes at least)."""
        return self.action == "routed"

    @property
    def backend(self):
        """capdispatch's backend, or None where no decision was needed (SGLang's own runs)."""
        return None if self.resolution is None else self.resolution.backend

    @property
    def routed_backends(self) -> str:
        """The capdispatch backends a routed op runs ("torch/triton" across buckets)."""
        if self.buckets:
            return "/".join(dict.fromkeys(b.backend for b in self.buckets if b.action == "routed"))
        return self.backend

    @property
    def kind(self) -> str:
        """How the plan's matrix marks this cell: its resolution's kind (resolution_kind),
        except where SGLang's own kernel runs in place of the decision (a kept op with no
        routable site): that cell names SGLang's kernel, marked only as downgraded when
        an explicit choice was not carried out (the warning says so)."""
        if self.action == "kept" and self.resolution is not None and self.runs != self.backend:
            return "downgraded" if self.warning else "first"
        return resolution_kind(self.resolution)

    @property
    def host(self) -> Optional[str]:
        """Where SGLang's own kernel runs here by the release's statement of what it needs
        (knobs.yaml `needs`; Resolution.host_of), its label: "SGLang's own kernel
        (sglang-kernel 0.4.5 sgl_kernel.flash_mla)"; else None."""
        res = self.resolution
        if res is None or self.runs is None:
            return None
        labels = [res.host_of(b.runs) for b in self.bucket_rows() if b.action == "kept"] if res.buckets \
            else [res.host_of(self.runs)] if self.action == "kept" else []
        return next((h for h in labels if h is not None), None)

    def bucket_rows(self) -> tuple:
        """The size buckets with what runs there and how: the choice's own per-bucket rows
        (a route keeps SGLang's call for some sizes), else the resolution's buckets carried
        out as the whole op is. Empty without buckets."""
        res = self.resolution
        if res is None or not res.buckets:
            return ()
        if self.buckets:
            return self.buckets
        return tuple(BucketChoice(b.lower, b.upper, b.backend, self.action,
                                  b.backend if self.action == "routed" else self.runs) for b in res.buckets)

    def to_dict(self) -> dict:
        """One op on one rank, as the plan JSON and the rank report give it: what runs, how,
        and why. `backend` is capdispatch's decision (the catch-all bucket's), `runs` the
        kernel that runs (SGLang's own where kept), `host` SGLang's own kernel by the release's
        statement where it runs, `buckets` per size bucket."""
        res = self.resolution
        key = (res.size_key or "size") if res is not None else "size"
        return {"backend": self.backend, "runs": self.runs, "action": self.action, "routed": self.routed,
                "why": self.why, "kind": self.kind,
                "setting": [s.label for s in self.setting] if self.setting else None,
                "source": res.source if res else None,
                "downgraded_from": res.downgraded_from if res else None,
                "host": self.host,
                "size_key": res.size_key if res is not None and res.buckets else None,
                "buckets": [{key: b.label(), "lower": b.lower, "upper": b.upper, "backend": b.backend,
                             "action": b.action, "runs": b.runs} for b in self.bucket_rows()]}


def family(device) -> Optional[str]:
    """The device family knobs.yaml keys entries by: 'sm90', 'sm100', 'sm120', ... (compute-
    capability major x 10) for a CUDA device, probed or simulated; None for any other (the
    CPU) or one without a compute capability, which takes an entry's `other`."""
    cc = getattr(device, "cc", None)
    return f"sm{cc[0] * 10}" if cc and getattr(device, "platform", None) == "cuda" else None


def resolution_kind(res) -> str:
    """How the matrix marks a resolution (capdispatch's explain marks): first preference,
    fallback, downgraded explicit choice, or changed by mixed_group: uniform."""
    if res is None:
        return "first"
    if res.downgraded_from:
        return "downgraded"
    if res.source.startswith("mixed_group: uniform"):
        return "uniform"
    return "fallback" if res.fallback else "first"


# ------------------------------------------------------------------ SGLang settings

def _label(kind: str, name: str, value) -> str:
    """How plans and warnings name a server-args field or an environment switch."""
    return f"{name}={value}" if kind == "field" else f"env {name}={value}"


@attrs.frozen
class SglangSetting:
    """One SGLang setting: a server-args field or an environment variable and its value
    (what a knob-map entry or route needs, or the launch's value of a field). ORIGIN says
    where the value comes from, where that matters; USER: the user set it."""
    kind: str                     # "field" | "env"
    name: str
    value: str
    origin: str = attrs.field(default="", kw_only=True)
    user: bool = attrs.field(default=False, kw_only=True)

    @property
    def label(self) -> str:
        return _label(self.kind, self.name, self.value)


@attrs.frozen
class LaunchRule(SglangSetting):
    """A knob-map `settings` row: capdispatch sets this setting at launch, the same for
    every rank, when a device decides one of BACKENDS (None: any) for one of OPS (and, with
    ROUTED, routes it) -- unless the user set it."""
    ops: tuple = attrs.field(kw_only=True)
    backends: Optional[tuple] = attrs.field(kw_only=True)     # None: any backend
    routed: bool = attrs.field(kw_only=True)
    why: str = attrs.field(kw_only=True)


@attrs.frozen
class GroupSetting:
    """One SGLang setting over the group and what capdispatch does with it. A launch
    setting (RULE given): "set" (capdispatch sets the rule's value) or "kept" (the user's
    stands). A setting the decided backends need, reported and never set: "agree" (one
    value for every device), "split" (devices need different values, SGLang takes one),
    "none" (no device needs it), "kept" (the user set it)."""
    kind: str                     # "field" | "env"
    name: str
    action: str
    why: str
    ops: tuple = ()
    wants: dict = attrs.field(factory=dict)     # value -> (device, ...) that need it
    user: Optional[str] = None                  # the user's value, when the user set it
    without: tuple = ()           # devices running one of `ops` decided, neither set nor routed (reported)
    routed: dict = attrs.field(factory=dict)    # device -> capdispatch backend routed at SGLang's call site
    rule: Optional[LaunchRule] = None           # the knob-map row of a launch setting

    @property
    def value(self) -> Optional[str]:
        """The value in force: the user's, else the one every device wants (None: none or split)."""
        if self.user is not None:
            return self.user
        return next(iter(self.wants)) if len(self.wants) == 1 else None

    @property
    def devices(self) -> tuple:
        return tuple(dict.fromkeys(d for ds in self.wants.values() for d in ds))

    @property
    def label(self) -> str:
        return _label(self.kind, self.name, self.value)


@attrs.frozen
class Decision:
    """One decision pass (decide.decide_in) over a group."""
    ops: tuple
    resolved: tuple          # the ops capdispatch decided (see decide.resolved_ops)
    devices: tuple           # DeviceSpecs in group order
    plan: Optional[cd.Plan]  # every op of `resolved` decided over `devices` (None when empty)
    choices: dict            # op -> {device id: OpChoice}
    settings: tuple          # GroupSetting... with a rule: the launch settings that fire
    sglang: tuple            # GroupSetting...: the SGLang settings the choices need, reported, never set
    warnings: tuple          # to log: downgrades, divergences, user settings kept against a need
