"""What the engine rehearsal launches: the ranks' GPUs, SGLang's command, the environment
that turns capdispatch's plugin on or off, and the fixed set of requests."""
from __future__ import annotations

import os
import random
import socket
from importlib.metadata import entry_points
from typing import Optional

import attrs

from ..errors import RehearseError

SERVER_MODULE = "sglang.launch_server"
PLUGIN = "capdispatch"                   # the entry point's name in sglang.srt.plugins
PLUGINS_ENV = "SGLANG_PLUGINS"           # SGLang's allow-list of general plugins
PLUGIN_GROUP = "sglang.srt.plugins"
NO_PLUGIN = "capdispatch-off"            # an allow-list entry that names no plugin
HOST = "127.0.0.1"
FIRST_TOKEN = 3                          # prompt ids start above the special ids 0..2

# Inclusive bounds, checked before anything starts.
BOUNDS = {"prompt": (16, 16384), "steps": (2, 1024), "requests": (1, 64), "port": (1024, 65535)}
MAX_TIMEOUT_S = 86400.0

# SGLang flags the rehearsal sets itself, and the flag of ours that sets each (None: fixed).
GRAPHS_OFF = "--disable-cuda-graph"   # the reference run: torch references run eagerly
OWN_FLAGS = {"--model-path": "--model", "--model": "--model", "--tp-size": "--tp", "--tp": "--tp",
             "--base-gpu-id": "--device", "--device": "--device", "--port": "--port", "--host": None,
             "--skip-tokenizer-init": None, "--disable-radix-cache": None, "--random-seed": "--seed"}


@attrs.frozen
class Launch:
    """One server launch's arguments (after `python -m sglang.launch_server`)."""
    model: str                 # the checkpoint folder
    gpu_ids: tuple             # CUDA ordinals of the ranks, in rank order
    port: int
    seed: int
    extra: tuple = ()          # the user's SGLang arguments (after --)

    @property
    def tp(self) -> int:
        return len(self.gpu_ids)

    def argv(self) -> list:
        return ["--model-path", self.model, "--skip-tokenizer-init", "--tp-size", str(self.tp),
                "--base-gpu-id", str(self.gpu_ids[0]), "--device", "cuda", "--host", HOST,
                "--port", str(self.port), "--disable-radix-cache", "--random-seed", str(self.seed),
                *self.extra]


def gpu_ids(values, tp: Optional[int]) -> tuple:
    """The ranks' CUDA ordinals from --device values (rehearse's device reader) and --tp: one
    cuda:N (or emu:NAME@cuda:N) with --tp T is N..N+T-1; several must be consecutive (SGLang
    places rank R on base + R). The CPU is refused in one line."""
    return tuple(g for g, _ in ranks(values, tp))


def ranks(values, tp: Optional[int]) -> tuple:
    """Per rank (CUDA ordinal, the catalog card it emulates or None), from --device and --tp."""
    from .. import devices
    devs = devices.parse_list(values)
    for d in devs:
        if d.run == "cpu":
            raise RehearseError(f"--device {d.text}: --engine sglang serves on CUDA devices; give cuda:N"
                                + (f" or emu:{d.decide[4:]}@cuda:N" if d.emulated else ""))
    ids = tuple(int(d.run[5:]) for d in devs)
    cards = tuple(d.decide[4:] if d.emulated else None for d in devs)
    if len(ids) == 1 and tp is not None:
        return tuple((g, cards[0]) for g in range(ids[0], ids[0] + tp))
    if tp is not None and tp != len(ids):
        raise RehearseError(f"--tp {tp} with {len(ids)} devices: give one device per rank, or one "
                            f"device and --tp")
    if list(ids) != list(range(ids[0], ids[0] + len(ids))):
        raise RehearseError(f"--device {','.join(d.text for d in devs)}: SGLang puts rank R on "
                            f"cuda:(first + R), so the devices must be consecutive, e.g. "
                            f"cuda:{ids[0]},cuda:{ids[0] + 1}")
    return tuple(zip(ids, cards))


def devices_value(ranked) -> Optional[str]:
    """The plugin's device list (adapters/sglang/gpus.SIM_ENV) that makes each emulated rank
    of RANKED ((gpu id, card or None), ...) decide as its card on its GPU: entry N is cuda:N,
    `emu:CARD@cuda:N` where rank N emulates. None where no rank emulates (NVML's cards)."""
    if not any(card for _, card in ranked):
        return None
    cards = dict(ranked)
    return ",".join(f"emu:{cards[g]}@cuda:{g}" if cards.get(g) else f"cuda:{g}"
                    for g in range(max(cards) + 1))


def check_bounds(**values) -> None:
    for name, v in values.items():
        lo, hi = BOUNDS[name]
        if v is not None and not lo <= v <= hi:
            raise RehearseError(f"--{name} {v}: expected an integer from {lo} to {hi} with --engine sglang")


def check_timeout(flag: str, v: float) -> None:
    if not 0 < v <= MAX_TIMEOUT_S:
        raise RehearseError(f"{flag} {v:g}: expected seconds above 0, at most {MAX_TIMEOUT_S:g} (one day)")


def check_extra(extra) -> tuple:
    """The user's SGLang arguments, refusing the flags the rehearsal sets itself."""
    for a in extra:
        flag = a.split("=", 1)[0]
        if flag in OWN_FLAGS:
            ours = OWN_FLAGS[flag]
            how = f"use {ours}" if ours else "the rehearsal sets it"
            raise RehearseError(f"-- {a}: dispatch rehearse sets {flag} itself ({how})")
    return tuple(extra)


def checkpoint(path: str) -> str:
    """PATH as a checkpoint folder holding config.json (the engine serves a folder, not a name)."""
    folder = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(folder):
        raise RehearseError(f"--model {path}: --engine sglang serves a checkpoint folder (`dispatch "
                            f"checkpoint --out DIR` writes one); {path!r} is not a folder")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise RehearseError(f"--model {path}: no config.json in {folder} (expected a Hugging Face folder)")
    return folder


def installed_plugins() -> list:
    """The names in SGLang's general plugin group installed here (what SGLang would load)."""
    return sorted({ep.name for ep in entry_points(group=PLUGIN_GROUP)})


def environment(base: dict, *, plugin: bool, report_dir: str, installed=None,
                devices: Optional[str] = None) -> dict:
    """BASE with capdispatch's plugin ON (in SGLANG_PLUGINS where the user restricts it) or OFF
    (SGLANG_PLUGINS listing every other plugin: the user's list, else every installed one,
    else a name that matches none), the plugin's reports going to REPORT_DIR, and DEVICES
    (devices_value) as the plugin's device list where a rank emulates a card."""
    from ...adapters.sglang import gpus, report
    env = dict(base)
    env[report.ENV_DIR] = report_dir
    if devices is not None:
        if env.get(gpus.SIM_ENV, devices) != devices:
            raise RehearseError(f"{gpus.SIM_ENV}={env[gpus.SIM_ENV]} is set, but --device emulates a card "
                                f"(the rehearsal sets {gpus.SIM_ENV}={devices} for the plugin); unset it")
        env[gpus.SIM_ENV] = devices
    given = [x.strip() for x in env.get(PLUGINS_ENV, "").split(",") if x.strip()]
    if plugin:
        if given and PLUGIN not in given:
            env[PLUGINS_ENV] = ",".join([*given, PLUGIN])
        return env
    others = [n for n in (given or (installed_plugins() if installed is None else installed)) if n != PLUGIN]
    env[PLUGINS_ENV] = ",".join(others) or NO_PLUGIN
    return env


def requests(seed: int, count: int, prompt: int, vocab: int) -> tuple:
    """COUNT prompts of PROMPT token ids, drawn from SEED below VOCAB (the same every run)."""
    rng = random.Random(f"capdispatch-engine-{seed}")
    top = max(FIRST_TOKEN + 1, min(vocab, 1 << 17))
    return tuple(tuple(rng.randrange(FIRST_TOKEN, top) for _ in range(prompt)) for _ in range(count))


def free_port() -> int:
    try:
        with socket.socket() as s:
            s.bind((HOST, 0))
            return s.getsockname()[1]
    except OSError as exc:
        raise RehearseError(f"no free TCP port on {HOST} for SGLang's server ({exc.strerror or exc})") from None
