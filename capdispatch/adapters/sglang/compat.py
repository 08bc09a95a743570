"""The SGLang APIs the adapter's code calls, per release: what the knob map's data
cannot say (how the resolution step is wrapped, how a field is read or declared
mid-resolution, where a rank's GPU id comes from). A release entry's `api` (knobs.yaml)
picks one class here; no other module of the adapter asks which SGLang it runs on.

Imports SGLang only inside the methods (never at import).
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import contextvars
import dataclasses
import io
import logging
import re
import sys

log = logging.getLogger("capdispatch.sglang")


class Rejected(Exception):
    """SGLang's argument parser refused the arguments (argparse's SystemExit CODE, and the
    error line it printed, without its usage)."""

    def __init__(self, code, message: str = ""):
        super().__init__(code)
        self.code, self.message = code, message


def parsed(fn, *args):
    """FN(*ARGS) (SGLang's argument parsing) with what its parser prints on stderr held
    back: a refusal is Rejected with argparse's one error line, not SGLang's whole usage."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            return fn(*args)
    except SystemExit as exc:
        lines = [ln for ln in held.getvalue().splitlines() if "error:" in ln]
        raise Rejected(exc.code, lines[-1].split("error:", 1)[1].strip() if lines else "") from None
    finally:
        rest = "\n".join(ln for ln in held.getvalue().splitlines()
                         if not ln.startswith(("usage:", " ")) and "error:" not in ln)
        if rest:        # SGLang's warnings and log lines still reach stderr
            print(rest, file=sys.stderr)


class ResolutionFailed(Exception):
    """SGLang's argument resolution raised ERROR (capdispatch's own refusals pass as they are)."""

    def __init__(self, error):
        super().__init__(error)
        self.error = error


def _resolving(fn, *args):
    import capdispatch as cd
    try:
        return fn(*args)
    except (cd.BadInput, cd.Unsatisfiable):
        raise
    except Exception as exc:
        raise ResolutionFailed(exc) from None


def explicit_fields(launch_command) -> set:
    """ServerArgs fields the user gave, from the record's launch command (the CLI
    argv, already merged with --config, or `Engine(k=v, ...)`)."""
    if not launch_command:
        return set()
    text = str(launch_command)
    if text.startswith("Engine("):
        try:
            call = ast.parse(text, mode="eval").body
            return {k.arg for k in call.keywords if k.arg}
        except SyntaxError:
            return set(re.findall(r"(?:\(|, )([A-Za-z_]\w*)=", text))
    return cli_fields(text.split())


def cli_fields(argv) -> set:
    """Fields set on an SGLang command line, parsed by SGLang's own parser with
    every default replaced by a marker (abbreviations and --opt=value included)."""

    from sglang.srt.server_args import ServerArgs

    class _Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    parser = _Parser(add_help=False)
    ServerArgs.add_cli_args(parser)
    unset = object()
    for action in parser._actions:
        action.default = unset
        action.required = False
    try:
        ns, _ = parser.parse_known_args(list(argv))
    except ValueError as exc:
        log.debug("capdispatch: cannot parse the launch command (%s); treating no field as user-set", exc)
        return set()
    return {k for k, v in vars(ns).items() if v is not unset}



class Api0523:
    """SGLang 0.5.23: register_resolution_hook, the overrides helpers, a msgspec record
    that keeps its launch command, publish before the rank hook, get_device().gpu_id."""

    name = "0.5.23"

    def register_step(self, step: str, hook, *, apply: bool = False) -> None:
        """Wrap SGLang's resolution step STEP with HOOK(server_args, previous)."""
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
        register_resolution_hook(step)(hook)

    def view(self, server_args):
        """The record as resolved so far (mid-resolution)."""
        from sglang.srt.arg_groups.overrides import resolving_view
        return resolving_view(server_args)

    def resolved(self, server_args, field: str):
        from sglang.srt.arg_groups.overrides import resolution_result
        return resolution_result(server_args, field)

    def model_config(self, server_args):
        from sglang.srt.arg_groups.overrides import model_config_of
        return model_config_of(server_args)

    def declare(self, server_args, source: str, fields: dict) -> None:
        from sglang.srt.arg_groups.overrides import declare_resolution
        declare_resolution(server_args, source, **fields)

    def explicit_fields(self, server_args) -> set:
        return explicit_fields(server_args.launch_command)

    def attn_dp_size(self, read) -> int:
        """The attention-DP width; READ(field) gives a field's value."""
        return read("attn_dp_size")

    def resolve_argv(self, argv, before):
        """SGLang's preparation and resolution of ARGV; BEFORE(server_args) runs between them."""
        from sglang.srt.server_args import prepare_server_args
        sa = parsed(prepare_server_args, argv)
        before(sa)
        _resolving(sa.resolve_once)
        return sa

    def group_gpu_id(self, kwargs):
        """The GPU id of the rank whose group hook runs (None: no agreement here)."""
        from sglang.srt.runtime_context import get_device
        return get_device().gpu_id

    def keeps_global_expert_ids(self, runner_backend: str) -> bool:
        """Whether SGLang's standard dispatcher hands a MoE layer whose method reports no
        runner (capdispatch's) global expert ids under the launch's RUNNER_BACKEND. 0.5.23
        keys the mapping on the layer's own runner (StandardDispatcher: the layer's
        `runner_backend`), so such a layer always gets EP-local ids."""
        return False


# Set by Api0517.resolve_argv while SGLang prepares a record: 0.5.17 resolves inside
# ServerArgs.__post_init__, so what must be on the record first is applied by the step.
_BEFORE: contextvars.ContextVar = contextvars.ContextVar("capdispatch_before_step", default=None)


def step_around(hook):
    """A HookRegistry AROUND wrapper (original, self) of a step method that calls
    HOOK(server_args, previous); `capdispatch_hook` names HOOK."""
    def around(original, server_args):
        before = _BEFORE.get()
        if before is not None:
            before(server_args)
        return hook(server_args, original)
    around.capdispatch_hook = hook
    return around


class Api0517(Api0523):
    """SGLang 0.5.17: the step is a ServerArgs method run from the dataclass's
    __post_init__ (so prepare_server_args resolves), declarations are a stash
    (`_resolved_overrides`) materialized at the end of __post_init__, the record
    keeps no launch command, there is no attn_dp_size field, and the group hook is
    init_torch_distributed(*, ps, is_draft_worker, ...)."""

    name = "0.5.17"

    def register_step(self, step: str, hook, *, apply: bool = False) -> None:
        # Inside load_plugins SGLang applies the hooks once every plugin registered
        # (a target applied early would miss later hooks); APPLY: outside it.
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        HookRegistry.register(step, step_around(hook), HookType.AROUND)
        if apply:
            HookRegistry.apply_hooks()

    def view(self, server_args):
        from sglang.srt.arg_groups.overrides import resolved_view
        return resolved_view(server_args)

    def resolved(self, server_args, field: str):
        return getattr(self.view(server_args), field)

    def model_config(self, server_args):
        return server_args.get_model_config()

    def declare(self, server_args, source: str, fields: dict) -> None:
        # SGLang's own check first: a field it cannot resolve is refused before the stash changes.
        from sglang.srt.arg_groups.overrides import validate_declarations
        entry = (source, dict(fields))
        validate_declarations(server_args, [entry])
        stash = getattr(server_args, "_resolved_overrides", None)
        if stash is None:
            stash = server_args._resolved_overrides = []
        stash.append(entry)

    def explicit_fields(self, server_args) -> set:
        """The record keeps no launch command: a field whose value differs from ServerArgs'
        default and that no resolution step declared was given by the user (command line
        or Engine keyword) or set by an earlier step; either way it is not capdispatch's
        to set. A record the user built field by field counts whole."""
        if not dataclasses.is_dataclass(server_args):
            raise TypeError(f"capdispatch: SGLang 0.5.17's ServerArgs is a dataclass, got "
                            f"{type(server_args).__name__}; the knob map's api does not match this SGLang")
        declared = {f for _, d in getattr(server_args, "_resolved_overrides", None) or () for f in d}
        out = set()
        for f in dataclasses.fields(server_args):
            if f.name in declared:
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                out.add(f.name)          # no default: always given
                continue
            value = server_args.__dict__.get(f.name, default)
            try:
                same = bool(value == default)
            except Exception:           # a value that does not compare: given
                same = False
            if not same:
                out.add(f.name)
        return out

    def attn_dp_size(self, read) -> int:
        # Not a field here: SGLang derives it where it needs it.
        return read("dp_size") if read("enable_dp_attention") else 1

    def resolve_argv(self, argv, before):
        from sglang.srt.server_args import prepare_server_args
        token = _BEFORE.set(before)
        try:
            return parsed(_resolving, prepare_server_args, argv)
        finally:
            _BEFORE.reset(token)

    # 0.5.17's StandardDispatcher.__init__ sets skip_local_expert_mapping from the
    # launch-wide get_moe_runner_backend(), not the layer's method: under these values every
    # layer's top-k ids stay global (and "aiter" maps only its mask, never the ids).
    GLOBAL_ID_BACKENDS = frozenset({"flashinfer_cutlass", "flashinfer_cutedsl", "flashinfer_trtllm",
                                    "experimental_sgl_trtllm", "flashinfer_trtllm_routed", "hpc_ops",
                                    "flashinfer_mxfp4", "aiter"})

    def keeps_global_expert_ids(self, runner_backend: str) -> bool:
        return str(runner_backend) in self.GLOBAL_ID_BACKENDS

    def group_gpu_id(self, kwargs):
        # A draft worker's call comes after its target's, which agreed for the rank.
        if kwargs.get("is_draft_worker"):
            return None
        ps = kwargs.get("ps")
        if ps is None or getattr(ps, "gpu_id", None) is None:
            raise TypeError("capdispatch: init_torch_distributed was called without ps=ParallelState "
                            "(gpu_id); the TP group cannot agree")
        return ps.gpu_id


_BY_NAME = {a.name: a for a in (Api0523(), Api0517())}
APIS = tuple(_BY_NAME)       # the values a release entry's `api` takes


def of(release):
    """The API of RELEASE (a knobs.Release, checked at load: its `api` is one of APIS)."""
    return _BY_NAME[release.api]
