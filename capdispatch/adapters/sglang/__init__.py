"""capdispatch's SGLang plugin.

Installed as the entry point `capdispatch` in SGLang's general plugin group
`sglang.srt.plugins`, so SGLang runs `register()` in its launcher and in every
scheduler (TP-rank) process. See docs/sglang.md.

Modules: versions (tested range), knobs (+ knobs.yaml: the knob map), records
(the typed records between modules), rig (the launch's GPUs), decide (the one
decision pass, without SGLang), render (text: the plan and the log lines),
launch (main process), rank (per rank + agreement), archfacts, routes, and
`dispatch sglang plan`: cli (argparse front), plan (the plan as data),
sglang_run (SGLang's own resolution, in process).
"""
from __future__ import annotations

import logging

log = logging.getLogger("capdispatch.sglang")

_done: dict = {}      # per process: register() acts once


def register(*, sglang_version=None) -> bool:
    """Register capdispatch's hooks with SGLang (cheap: registration only; no
    device is probed and no setting changes here). Outside the tested SGLang
    range: one WARNING, nothing registered. Returns whether hooks were registered.

    SGLANG_VERSION replaces the installed version (for checking the range)."""
    if "result" in _done:
        return _done["result"]
    from . import versions
    verdict = versions.check(sglang_version)
    if not verdict.ok:
        _done["result"] = False
        log.warning(verdict.message)
        return False
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import knobs, launch, rank
    hooks = knobs.load().release(verdict.version).hooks
    register_resolution_hook(hooks.resolution_step)(launch.resolution_hook)
    HookRegistry.register(hooks.rank, rank.after_configure, HookType.AFTER)
    HookRegistry.register(hooks.group, rank.after_parallel_ready, HookType.AFTER)
    _done["result"] = True
    return True
