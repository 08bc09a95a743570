"""capdispatch's SGLang plugin.

Installed as the entry point `capdispatch` in SGLang's general plugin group
`sglang.srt.plugins`, so SGLang runs `register()` in its launcher and in every
scheduler (TP-rank) process. See docs/sglang.md.

Modules: versions (tested range), knobs (+ knobs.yaml: the knob map), records
(the typed records between modules), gpus (the launch's GPUs), decide (the one
decision pass, without SGLang), render (text: the plan and the log lines),
launch (main process), rank (per rank + agreement), sglang_facts (SGLang's
architecture facts, corrected per rank), routes, compat (the SGLang APIs the
code calls, per release entry's `api`), and `dispatch sglang plan`:
cli (argparse front), plan (the plan as records, with SGLang's own resolution
run in process).
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
    from . import knobs, versions
    verdict = versions.check(sglang_version, knobs.load())
    if not verdict.ok:
        _done["result"] = False
        log.warning(verdict.message)
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import launch, rank
    release = knobs.load().release(verdict.version)
    hooks = release.hooks
    launch.register_step(release)
    HookRegistry.register(hooks.rank, rank.after_configure, HookType.AFTER)
    HookRegistry.register(hooks.group, rank.after_parallel_ready, HookType.AFTER)
    _done["result"] = True
    return True
