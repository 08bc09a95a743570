"""One reading of each kind of input, shared by every command, the Python API and the
SGLang plugin: comma lists of devices and ops, yes/no variables, the cache directory
(the policy path list of CAPDISPATCH_POLICY is read in policies.stack). Each refusal is a BadInput naming the source (a flag or a
variable), the value and what is valid."""
from __future__ import annotations

import os

from .errors import BadInput

FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("", "0", "false", "no", "off")
DEVICE_FORMS = "cuda:N, cpu or sim:NAME (NAME from `dispatch catalog`, or sm_86, sm_90, ...)"


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
    from ..policies.loader import did_you_mean
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


def device_specs(values, source: str, *, via: str = "auto", assume_cuda=None) -> list:
    """device_list(VALUES), each read (probed or simulated) as one group; an unknown device
    names SOURCE. Empty: [] (the caller's default, e.g. the local devices)."""
    from .group import unique_ids
    from .resolver import as_spec
    specs = []
    for dev in device_list(values, source):
        try:
            specs.append(as_spec(dev, via=via, assume_cuda=assume_cuda))
        except BadInput as exc:
            raise BadInput(f"{source}: {exc}") from None
    return unique_ids(specs) if specs else []
