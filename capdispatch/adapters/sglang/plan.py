"""What `dispatch sglang plan` shows, as data: one decision (decide.decide_in with one
Context: the plan's policies, selections and library inventory) for the launch's GPUs, as
frozen records (LaunchPlan); `LaunchPlan.to_dict()` is the plan JSON schema
(docs/sglang.md). With `-- SGLANG ARGS` the launch is what SGLang's own argument
resolution makes of them, run in this process with the plugin's launch step
(sglang_resolution). No rendering here (render.py writes the text from the records)."""
from __future__ import annotations

import logging
import os
from typing import Optional
import enum
import importlib.util
import sys
import types

import attrs

import capdispatch as cd

SCHEMA = 2
# What the --brief summary of the mixed-group divergences says of the full warnings.
BRIEF_HINT = "without --brief the plan lists each"
PLATFORM_FACTS = ("is_sm90", "is_sm100", "is_sm120", "is_blackwell", "device_sm")
# Where SGLang has no platform facade (an empty `arch.platform`), the probes its readers call.
PLATFORM_PROBES = ("is_sm90_supported", "is_sm100_supported", "is_sm120_supported", "is_blackwell_supported",
                   "get_device_sm")


@attrs.frozen
class SglangRelease:
    """The SGLang the plan is for: its version, whether it is installed here, the knob
    map's tested range, and whether the version is inside it."""
    version: str
    installed: bool
    tested: str
    in_range: bool

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class ModelInfo:
    """The launch's model architecture (ASSUMED: no SGLang arguments were given) and KV dtype."""
    architecture: Optional[str]
    assumed: bool
    kv_cache_dtype: Optional[str]

    def to_dict(self) -> dict:
        return attrs.asdict(self)


@attrs.frozen
class RankPlan:
    """One rank: its GPU, its card, per op its choice, and the SGLang platform facts set for it
    (its probes', where SGLang has no platform facade)."""
    rank: int
    gpu_id: int
    device: cd.DeviceSpec
    choices: dict                # op -> records.OpChoice
    arch: dict                   # platform fact -> value

    def to_dict(self) -> dict:
        return {"rank": self.rank, "gpu_id": self.gpu_id, "device": self.device.to_dict(),
                "ops": {op: c.to_dict() for op, c in self.choices.items()}, "arch": dict(self.arch)}


@attrs.frozen
class ShapeRejection:
    """A backend a rank's shapes put outside its declared range, with the check's need and found."""
    device: str
    op: str
    backend: str
    code: str
    need: str
    found: str
    wording: str                 # the check's one wording (need vs found)

    def to_dict(self) -> dict:
        return attrs.asdict(self)


def _launch_dict(s) -> dict:
    return {"kind": s.kind, "name": s.name, "value": s.value, "wants": s.rule.value, "action": s.action,
            "why": s.why, "devices": list(s.devices)}


def _sglang_dict(s) -> dict:
    return {"kind": s.kind, "name": s.name, "ops": list(s.ops), "action": s.action, "user": s.user,
            "wants": {v: list(ds) for v, ds in s.wants.items()}, "without": list(s.without),
            "routed": dict(s.routed), "why": s.why}


@attrs.frozen
class LaunchPlan:
    """The plan for a launch. Outside the tested range only SGLANG and NOTE say anything.
    LAUNCH: the launch settings (records.GroupSetting with a rule); SGLANG_SETTINGS: the
    SGLang settings the choices need (reported); INVENTORY: whose libraries the decision
    used, as `dispatch explain --format json` says it; SHAPES: the model's RankShape
    (None: no --model); RESOLVED: the fields SGLang's own resolution gave (`-- SGLANG ARGS`)."""
    sglang: SglangRelease
    note: Optional[str] = None
    inventory: dict = attrs.field(factory=dict)
    model: Optional[ModelInfo] = None
    ops: tuple = ()
    reason: str = ""
    gpu_ids: tuple = ()
    launch: tuple = ()
    ranks: tuple = ()
    sglang_settings: tuple = ()
    warnings: tuple = ()
    divergent: tuple = ()     # the mixed-group divergences among WARNINGS
    mixed_summary: str = ""   # them as one line, for --brief
    shapes: Optional[cd.RankShape] = None
    shape_rejections: tuple = ()
    resolved: Optional[dict] = None

    @property
    def whose(self) -> str:
        return self.inventory.get("whose", "this machine's")

    def to_dict(self) -> dict:
        """The plan JSON (schema SCHEMA, docs/sglang.md)."""
        out = {"schema": SCHEMA, "sglang": self.sglang.to_dict()}
        if not self.sglang.in_range:
            out.update(note=self.note, launch=[], ranks=[], sglang_settings=[], warnings=[])
            return out
        out.update(
            inventory=dict(self.inventory), model=self.model.to_dict(), ops=list(self.ops), reason=self.reason,
            gpu_ids=list(self.gpu_ids), launch=[_launch_dict(s) for s in self.launch],
            ranks=[r.to_dict() for r in self.ranks],
            sglang_settings=[_sglang_dict(s) for s in self.sglang_settings], warnings=list(self.warnings),
            shapes=self.shapes.to_dict() if self.shapes is not None else None,
            shape_rejections=[r.to_dict() for r in self.shape_rejections])
        if self.resolved is not None:
            out["sglang_resolved"] = dict(self.resolved)
        return out


def newest(k) -> str:
    """No SGLang here: plan with the knob map's newest tested release."""
    from packaging.version import Version
    return str(max(Version(s.version) for r in k.releases for s in r.spec if s.operator in (">=", "==")))


def _devices(ids, env):

    from . import gpus
    try:
        return gpus.devices(ids, env=env, via="nvml")
    except cd.ProbeError as exc:
        hint = exc.hint or "simulate them with --device sim:NAME[,sim:NAME...]"
        raise cd.BadInput(f"cannot read the launch's GPUs ({', '.join(f'cuda:{g}' for g in ids)}) "
                          f"without initialising CUDA: {exc.reason}; {hint}") from None


def check_libraries(options, env) -> None:
    """A bad --libs or --assume-lib name is refused now, before SGLang runs."""
    cd.context(libs=options.libs, assume_libs=list(options.assume_libs) or None, env=env)


def profile_release(libs) -> Optional[str]:
    """The SGLang version a --libs profile describes (the plan is then for that release's
    knob map, installed here or not); None for none, `local` or a profile without SGLang."""
    from capdispatch import extend
    if not isinstance(libs, str) or libs not in extend.lib_profile_names():
        return None
    lib = extend.lib_profile(libs).get("sglang")
    return lib.version if lib is not None else None


def with_target_libs(options, env):
    """OPTIONS with whose libraries named by the one rule (cd.target_libs) over the node's
    simulated GPUs when nothing names them, so that SGLang's in-process resolution (the
    plugin's launch step, which binds with this machine's libraries unless told) decides
    with the plan's libraries."""

    from . import gpus
    listed = gpus.simulated_devices(env) or []
    if options.libs is not None or options.assume_libs or not listed \
            or not all(d.startswith("sim:") for d in listed):
        return options
    try:
        specs = [cd.probe(d) for d in listed]
    except cd.UnknownDeviceError:
        return options      # refused when the launch's GPUs are read, naming the entry
    return attrs.evolve(options, libs=cd.target_libs(specs))


def decision(specs, release, inputs, *, env, shapes=None):
    """decide.decide_in with the one Context every op, rank and settings row of the plan
    reads: the plan's libraries (inputs.options), or with none named the ones the
    devices choose (cd.target_libs)."""

    from . import decide
    ctx = decide.context_of(release, inputs, env)
    if shapes is not None:
        ctx = attrs.evolve(ctx, shapes=shapes)
    return decide.decide_in(ctx, specs, inputs.ops, release, env=env,
                            explicit_fields=inputs.explicit_fields, field_values=inputs.field_values,
                            user_env=inputs.user_env), ctx


def inventory_dict(d, ctx) -> dict:
    """Whose libraries the decision used, as `dispatch explain --format json` says it."""
    if d.plan is not None:
        return dict(d.plan.whose)
    return dict(ctx.inventory.to_dict(), note="")


def rank_plan(i, gpu_id, spec, d, release) -> RankPlan:
    from . import sglang_facts
    facts = sglang_facts.facts(spec, release.arch)
    platform = {f: facts[src] for f, src in release.arch["platform"].items() if f in PLATFORM_FACTS}
    if not release.arch["platform"]:
        platform = {p: facts[p] for p in PLATFORM_PROBES if p in release.arch["probes"]}
    return RankPlan(i, gpu_id, spec, {op: row[spec.id] for op, row in d.choices.items()}, platform)


def rank_shapes(model, tp_size):
    """The RankShape of MODEL ({"name", "ep", "dp_attention", "next_n"}) at TP_SIZE, or None."""
    if model is None:
        return None
    return cd.load_model(model["name"]).for_rank(tp_size, model["ep"], model["dp_attention"],
                                                 next_n=model["next_n"])


def shape_rejections(d) -> tuple:
    """Every backend a rank's shapes put outside its declared range (ShapeRejection...)."""
    out = []
    for op, row in d.choices.items():
        for did, c in row.items():
            res = c.resolution
            for cand in (res.candidates if res is not None else ()):
                for ch in cand.checks:
                    if ch.code.startswith("shape:") and not ch.ok:
                        out.append(ShapeRejection(did, op, cand.backend, ch.code, ch.need, ch.found, ch.wording))
    return tuple(out)


def build(*, tp=None, sglang_args=None, options, env: dict, model=None) -> LaunchPlan:
    """The plan for a launch. OPTIONS: records.PlanOptions; ENV: the environment a
    launch would see (CAPDISPATCH_POLICY, CAPDISPATCH_STRICT, the simulated GPUs); MODEL:
    {"name", "ep", "dp_attention", "next_n"} to check the kernels' shape ranges at each
    rank's shapes (None: not checked)."""

    from . import decide, knobs, gpus, versions
    from .records import LaunchInputs
    if tp is not None and tp < 1:
        raise cd.BadInput(f"--tp {tp}: expected an integer >= 1")
    check_libraries(options, env)
    target = profile_release(options.libs)
    options = with_target_libs(options, env)
    k = knobs.load()
    installed = versions.installed()
    if sglang_args is not None and installed is None:
        raise cd.BadInput("SGLang arguments were given after `--` but SGLang is not installed; "
                          "install it, or plan without `-- ...` (a DeepSeek-V4 launch with defaults)")
    if sglang_args is not None and target is not None and target != installed:
        raise cd.BadInput(f"--libs {options.libs} plans for SGLang {target}, but the arguments after `--` are "
                          f"read by the SGLang installed here ({installed}); plan without `-- ...`, or "
                          f"with --libs naming {installed}'s profile or none")
    version = target or installed or newest(k)
    verdict = versions.check(version, k)
    release_info = SglangRelease(version, installed == version, verdict.tested, verdict.ok)
    if not verdict.ok:
        return LaunchPlan(release_info, note=verdict.message)
    release = k.release(version)
    fields = None
    if sglang_args is not None:
        run = sglang_resolution(sglang_args, release, env, options, tp=tp)
        inputs, tp_size, layout, fields = run.inputs, run.tp_size, run.layout, run.fields
        assumed = False
    else:
        arch = next(iter(release.models))
        ops, reason = decide.applicable_ops(release, arch, "auto")
        inputs = LaunchInputs(arch, "auto", ops, reason, frozenset(), {},
                              {n: env[n] for n in release.route_env_names() if n in env}, options)
        found = gpus.simulated_devices(env)
        tp_size, layout, assumed = tp or (len(found) if found else 1), {}, True
    ids = gpus.gpu_ids(tp_size=tp_size, **layout)
    shapes = rank_shapes(model, tp_size)
    specs = _devices(ids, env)
    d, ctx = decision(specs, release, inputs, env=env, shapes=shapes)
    return LaunchPlan(
        release_info, inventory=inventory_dict(d, ctx.for_devices(specs)),
        model=ModelInfo(inputs.model, assumed, inputs.kv_cache_dtype),
        ops=tuple(inputs.ops), reason=inputs.reason, gpu_ids=tuple(ids), launch=d.settings,
        ranks=tuple(rank_plan(i, g, spec, d, release) for i, (g, spec) in enumerate(zip(ids, specs))),
        sglang_settings=d.sglang, warnings=tuple(d.warnings), shapes=shapes,
        divergent=tuple(g.divergence for g in (d.plan.ops.values() if d.plan else ()) if g.divergence),
        mixed_summary=d.plan.mixed_summary(BRIEF_HINT, len(inputs.ops)) if d.plan else "",
        shape_rejections=shape_rejections(d) if shapes is not None else (), resolved=fields)


def sglang_resolution(sglang_args, release, env: dict, options, *, tp=None):
    """SGLang's own argument preparation and resolution of SGLANG_ARGS, as `python -m
    sglang.launch_server` would run them, with the plugin's launch step, in this process,
    under ENV (the environment a launch would see) and OPTIONS (records.PlanOptions). The
    process environment and the plugin's log level are restored afterwards, whatever
    happens. Returns a records.SglangRun."""
    from . import compat, launch
    from .records import SglangRun
    api = compat.of(release)
    argv = list(sglang_args)
    prepare_server_args = _server_args_module().prepare_server_args
    given = launch.cli_fields(argv)
    before = dict(os.environ)
    logger = logging.getLogger("capdispatch.sglang")
    level = logger.level
    try:
        os.environ.clear()
        os.environ.update(env)
        logger.setLevel(logging.ERROR)   # the plan says it all
        resolution_result = api.resolved
        try:
            if tp is not None:
                if "tp_size" in given:
                    if compat.parsed(prepare_server_args, argv).tp_size != tp:
                        raise cd.BadInput(f"--tp {tp} disagrees with SGLang's --tp-size in the SGLang arguments")
                else:
                    argv += ["--tp-size", str(tp)]
            if "log_level" not in given:
                argv += ["--log-level", "warning"]
            launch.register_step(release, apply=True)
            sa = api.resolve_argv(argv, lambda sa: setattr(sa, launch.OPTIONS_ATTR, options))
        except compat.Rejected as exc:
            raise cd.BadInput(f"SGLang rejected the arguments {' '.join(sglang_args)!r}: "
                              f"{exc.message or f'argparse exit {exc.code}'}") from None
        except compat.ResolutionFailed as failed:
            exc = failed.error
            raise cd.BadInput(f"SGLang's argument resolution failed: {type(exc).__name__}: {exc}") from None
        inputs = launch.stashed(sa)
        if inputs is None:      # the plugin's step did not run: read the record as a rank would
            inputs = launch.record_inputs(sa, release, lambda f: resolution_result(sa, f))
        names = {s.name for s in release.settings if s.kind == "field"} | {"kv_cache_dtype", "tp_size"}
        fields = {f: resolution_result(sa, f) for f in sorted(names)}
        fields.update({s.name: os.environ.get(s.name) for s in release.settings if s.kind == "env"})
        layout = {f: resolution_result(sa, f) for f in ("pp_size", "nnodes", "node_rank", "base_gpu_id",
                                                         "gpu_id_step", "dp_size")}
        layout["dp_attention"] = (bool(resolution_result(sa, "enable_dp_attention"))
                                  or api.attn_dp_size(lambda f: resolution_result(sa, f)) > 1)
        return SglangRun(inputs, resolution_result(sa, "tp_size"), layout, fields)
    finally:
        os.environ.clear()
        os.environ.update(before)
        logger.setLevel(level)


def _server_args_module():
    """sglang.srt.server_args, or a one-line error: SGLang's import can fail on what it needs
    beside it here (a module it imports, a transformers release it clashes with)."""
    from . import versions
    try:
        vision_placeholder()    # before SGLang's first import: 0.5.17's package imports torchvision
        import sglang.srt.server_args as server_args
    except Exception as exc:    # whatever SGLang's import raises, named as SGLang's
        raise cd.Unsatisfiable(f"SGLang {versions.installed()} cannot be imported here to read the arguments "
                               f"after `--`: {type(exc).__name__}: {' '.join(str(exc).split())} (install what SGLang needs beside it, "
                               f"or plan without `-- SGLANG ARGS`)") from None
    return server_args


def vision_placeholder() -> None:
    """SGLang's argument resolution imports torchvision (sglang.srt.configs, for multimodal
    models), which a CPU planning machine rarely has: PyPI's torchvision is built for CUDA
    torch and does not load against a CPU one. Where torchvision is absent, this process
    (planning only: it never serves) gets placeholder modules, put in after transformers has
    decided torchvision is unavailable, so no vision code path is taken. The tests' prelude
    (tests/sglang_prelude.py) calls it too."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    import transformers.utils.import_utils as iu
    if iu.is_torchvision_available():
        return

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        LANCZOS = "lanczos"

    def placeholder(name):
        m = types.ModuleType(name)

        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            if attr == "InterpolationMode":
                return InterpolationMode
            return type(attr, (), {"__init__": lambda self, *a, **k: None})
        m.__getattr__ = __getattr__
        m.__capdispatch_placeholder__ = True
        sys.modules[name] = m

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.transforms.v2", "torchvision.io", "torchvision.ops"):
        placeholder(name)
