"""One reading of each kind of input, shared by every command, the Python API and the
SGLang plugin: comma lists of devices and ops, yes/no variables, the cache directory
(the policy path list of CAPDISPATCH_POLICY is read in policies.stack). Each refusal is a BadInput naming the source (a flag or a
variable), the value and what is valid."""
from __future__ import annotations

import difflib
import importlib.util
import logging
import os

from ..errors import BadInput
from ..marked_yaml import did_you_mean

FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("", "0", "false", "no", "off")
DEVICE_FORMS = "cuda:N, cpu or sim:NAME (NAME from `dispatch catalog`, or sm_86, sm_90, ...)"

# Every variable capdispatch reads, with what it does (`dispatch env` lists them); tests check
# this list against the package's source.
VARIABLES = {
    "CAPDISPATCH_POLICY": "policy files, os.pathsep-separated, layered below --policy",
    "CAPDISPATCH_SET": "explicit choices OP=BACKEND[,...], above every policy",
    "CAPDISPATCH_STRICT": "1: an explicit choice that cannot run is an error",
    "CAPDISPATCH_SGLANG_DEVICES": "the SGLang plugin's simulated GPUs (sim:NAME,...)",
    "CAPDISPATCH_VERIFY": "what an unverified or failed canary does (above the policy's verify)",
    "CAPDISPATCH_CACHE_DIR": "where canary verdicts are cached (default: the user's cache directory)",
    "CAPDISPATCH_LOCK": "a lock file explain and verify compare the decisions with",
    "CAPDISPATCH_REPORT_DIR": "where each SGLang rank writes its decision report (default: the user's "
                              "cache directory)",
    "CAPDISPATCH_IMPORT_TIMEOUT": "seconds a library's import may take on a real device (default 60), "
                                  "and a plugin's import and register() (default 20)",
    "CAPDISPATCH_DEBUG": "1: an internal error shows its traceback",
    "CAPDISPATCH_REQUIRE_REHEARSAL": "1: an SGLang launch needs a passed `dispatch rehearse` verdict for its "
                                     "cards, software and decisions",
    "CAPDISPATCH_REHEARSE_FAULT": "RANK:OP:KIND: a fault planted on one rank of `dispatch rehearse` "
                                  "(for testing the rehearsal itself)",
    "CUDA_VISIBLE_DEVICES": "which GPUs cuda:N numbers, and in what order",
    "CUDA_DEVICE_ORDER": "PCI_BUS_ID makes CUDA's numbering match NVML's",
    "TRITON_INTERPRET": "1: Triton kernels run on the CPU under Triton's interpreter",
    "NO_COLOR": "set: no colour in the matrix",
    "FORCE_COLOR": "set: colour in the matrix even when piped",
}

_warned: set = set()      # unknown names already warned of in this process


def unknown_variables(env) -> list:
    """(name, closest known name or None) for each CAPDISPATCH_ variable of ENV that
    capdispatch does not read, sorted."""
    pre = "CAPDISPATCH_"
    known = [k[len(pre):] for k in VARIABLES if k.startswith(pre)]
    # The names after the shared prefix are compared, so that any name is not close to all.
    return [(k, next((pre + c for c in difflib.get_close_matches(k[len(pre):], known, n=1, cutoff=0.7)),
                     None))
            for k in sorted(k for k in env if isinstance(k, str) and k.startswith(pre) and k not in VARIABLES)]


def unknown_note(names, close=None, where: bool = True) -> str:
    """The one sentence about variables capdispatch does not read: each with its did-you-mean
    (and, WHERE, which command lists those it reads)."""
    close = dict(close) if close is not None else dict(unknown_variables(dict.fromkeys(names, "")))
    said = [n + (f" (did you mean {close[n]}?)" if close.get(n) else "") for n in names]
    return f"capdispatch reads none of {', '.join(said)}" + (
        "; `dispatch env` lists the variables it reads" if where else "")


def warn_unknown_variables(env) -> None:
    """One WARNING line, once per process, for CAPDISPATCH_ variables capdispatch does not read
    (a misspelt name is otherwise silently ignored)."""
    new = [(k, c) for k, c in unknown_variables(env) if k not in _warned]
    if new:
        _warned.update(k for k, _ in new)
        logging.getLogger("capdispatch").warning(unknown_note([k for k, _ in new], new))


def shown(value, limit: int = 60) -> str:
    """VALUE as a message quotes it: ascii(), cut to LIMIT characters."""
    text = value if isinstance(value, str) else str(value)
    return ascii(text) if len(text) <= limit else f"{ascii(text[:limit])}... ({len(text)} characters)"


def env_flag(env, name: str) -> bool:
    """A yes/no environment variable: 1/true/yes/on, or 0/false/no/off/empty (any case)."""
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in FLAG_ON:
        return True
    if value in FLAG_OFF:
        return False
    raise BadInput(f"{name}={shown(raw, 40)} is not a yes/no value (valid: {', '.join(FLAG_ON)} to "
                   f"turn it on; {', '.join(v for v in FLAG_OFF if v)} or empty to leave it off)")


def split_list(values, source: str, what: str, valid: str) -> list:
    """The entries of VALUES (one string, or the strings of a repeated flag), each split
    on commas and stripped. An empty entry (a leading, trailing or doubled comma, a value
    of only spaces) is refused: it is a typo more often than a choice, and where position
    matters (entry N is cuda:N) it would move every entry after it."""
    if isinstance(values, str):
        values = [values]
    out = []
    for value in values:
        if not isinstance(value, str):
            raise BadInput(f"{source}: {shown(repr(value))} is not text (valid: {what}[,{what}...] "
                           f"with {what} {valid})")
        parts = [p.strip() for p in value.split(",")]
        if not all(parts):
            why = "is empty" if not value.strip() else "has an empty entry"
            given = f"{source} {shown(value)}" if source.startswith("-") else f"{source}={shown(value)}"
            raise BadInput(f"{given} {why} (valid: {what}[,{what}...] with {what} "
                           f"{valid}; no leading, trailing or doubled commas)")
        out += parts
    return out


def device_list(values, source: str) -> list:
    """Devices from a flag (repeatable, commas) or a variable: ['sim:rtx-5090', 'cuda:0']."""
    return split_list(values, source, "DEV", DEVICE_FORMS)


def api_devices(devices, source: str = "devices=") -> list:
    """The API's device group: a list of ids or specs, or one string read as --device reads
    it ("sim:rtx-5090,sim:rtx-3080"); an empty group is refused, not planned as nothing."""
    if isinstance(devices, str):
        devices = device_list(devices, source)
    try:
        devices = list(devices)
    except TypeError:
        raise BadInput(f"{source}: {shown(repr(devices))} is not a list of devices (valid: "
                       f"[DEV, ...] or 'DEV[,DEV...]' with DEV {DEVICE_FORMS})") from None
    if not devices:
        raise BadInput(f"{source}: no device given (valid: [DEV, ...] or 'DEV[,DEV...]' with DEV "
                       f"{DEVICE_FORMS})")
    return devices


def op_list(values, source: str, registry) -> list:
    """Op names from a flag (repeatable, commas) or a variable, each a registered op;
    a name given twice counts once."""
    ops = split_list(values, source, "OP", f"one of {', '.join(registry.ops)}")
    for op in ops:
        if op not in registry.ops:
            raise BadInput(f"{source}: unknown op {shown(op)}{did_you_mean(op, registry.ops)} "
                           f"(valid: {', '.join(registry.ops)})")
    return list(dict.fromkeys(ops))


def check_cache_dir(env, name: str = "CAPDISPATCH_CACHE_DIR") -> None:
    """Refuse a cache directory variable that names something other than a directory."""
    raw = env.get(name, "")
    if not raw:
        return
    path = os.path.expanduser(raw)
    if os.path.exists(path) and not os.path.isdir(path):
        raise BadInput(f"{name}={shown(raw)} is not a directory (valid: a directory, created when "
                       f"missing; unset: the user's cache directory)")


def needs_torch(what: str) -> None:
    """One line and exit 2 where torch is not installed: WHAT (e.g. "dispatch rehearse runs
    the group's kernels") says what needs it; planning needs none. Found, not imported: the
    command imports it where it runs kernels."""
    try:
        found = importlib.util.find_spec("torch") is not None
    except ValueError:          # sys.modules["torch"] is None: its import is halted
        found = False
    if not found:
        raise BadInput(f"{what}, which need torch: torch is not installed (pip install "
                       f"'capdispatch[torch]', or your own CUDA build of torch); planning needs "
                       f"none: dispatch explain, plan, lock, sglang plan")
