"""SGLang's own argument preparation and resolution, with the plugin's launch
step, run in this process for `dispatch sglang plan -- SGLANG ARGS`. The process
environment and the plugin's log level are restored afterwards, whatever happens."""
from __future__ import annotations

import logging
import os


def run(sglang_args, release, env: dict, options, *, tp=None):
    """Prepare and resolve SGLANG_ARGS as `python -m sglang.launch_server` would,
    under ENV (the environment a launch would see) and OPTIONS (records.PlanOptions).
    Returns a records.SglangRun."""
    import capdispatch as cd

    from . import launch
    from .records import SglangRun
    argv = list(sglang_args)
    given = launch.cli_fields(argv)
    before = dict(os.environ)
    logger = logging.getLogger("capdispatch.sglang")
    level = logger.level
    try:
        os.environ.clear()
        os.environ.update(env)
        logger.setLevel(logging.ERROR)   # the plan says it all
        vision_placeholder()
        from sglang.srt.arg_groups.overrides import resolution_result
        from sglang.srt.server_args import prepare_server_args
        if tp is not None:
            if "tp_size" in given:
                if prepare_server_args(argv).tp_size != tp:
                    raise cd.BadInput(f"--tp {tp} disagrees with SGLang's --tp-size in the SGLang arguments")
            else:
                argv += ["--tp-size", str(tp)]
        if "log_level" not in given:
            argv += ["--log-level", "warning"]
        launch.register_step(release.hooks["resolution_step"])
        try:
            sa = prepare_server_args(argv)
        except SystemExit as exc:
            raise cd.BadInput(f"SGLang rejected the arguments {' '.join(sglang_args)!r} "
                              f"(argparse exit {exc.code})") from None
        setattr(sa, launch.OPTIONS_ATTR, options)
        try:
            sa.resolve_once()
        except (cd.BadInput, cd.Unsatisfiable):
            raise
        except Exception as exc:
            raise cd.BadInput(f"SGLang's argument resolution failed: {type(exc).__name__}: {exc}") from None
        inputs = getattr(sa, launch.INPUTS_ATTR, None)
        if inputs is None:      # the plugin's step did not run: read the record as a rank would
            inputs = launch.record_inputs(sa, release, lambda f: resolution_result(sa, f))
        names = {s.name for s in release.settings if s.kind == "field"} | {"kv_cache_dtype", "tp_size"}
        fields = {f: resolution_result(sa, f) for f in sorted(names)}
        fields.update({s.name: os.environ.get(s.name) for s in release.settings if s.kind == "env"})
        layout = {f: resolution_result(sa, f) for f in ("pp_size", "nnodes", "node_rank", "base_gpu_id",
                                                         "gpu_id_step", "dp_size")}
        layout["dp_attention"] = (bool(resolution_result(sa, "enable_dp_attention"))
                                  or resolution_result(sa, "attn_dp_size") > 1)
        return SglangRun(inputs, resolution_result(sa, "tp_size"), layout, fields)
    finally:
        os.environ.clear()
        os.environ.update(before)
        logger.setLevel(level)


def vision_placeholder() -> None:
    """SGLang's argument resolution imports torchvision (sglang.srt.configs, for multimodal
    models), which a CPU planning machine rarely has: PyPI's torchvision is built for CUDA
    torch and does not load against a CPU one. Where torchvision is absent, this process
    (planning only: it never serves) gets placeholder modules, put in after transformers has
    decided torchvision is unavailable, so no vision code path is taken. The tests' prelude
    (tests/sglang_prelude.py) calls it too."""
    import enum
    import importlib.util
    import sys
    import types
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
