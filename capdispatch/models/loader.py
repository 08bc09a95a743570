"""`load_model(name_or_path)`: a built-in name, or a config.json (or its folder)."""
from __future__ import annotations

import json
import os
from importlib import resources
import yaml

from ..safe_io import printable
from .config import parse
from .errors import ModelError
from .shape import ModelShape

DATA = "builtin.yaml"


def _builtin_data() -> dict:
    # Read on each call: a few kB, and no process-global state to go stale.

    text = resources.files("capdispatch.models").joinpath(DATA).read_text("utf-8")
    return yaml.safe_load(text)["models"]


def builtin_names() -> list:
    return sorted(_builtin_data())


def builtin_entry(name: str) -> dict:
    """A built-in's data: summary, published (its config.json's address), config, formats."""
    data = _builtin_data()
    if name not in data:
        raise _unknown(name, data)
    return data[name]


def _unknown(name: str, data) -> ModelError:
    from ..policies import did_you_mean
    hint = did_you_mean(name, list(data))
    return ModelError(f"model {name!r} is neither a built-in model nor an existing file"
                      f"{hint}; built-ins: {', '.join(sorted(data))}; or give the path of a "
                      f"Hugging Face config.json (or of the folder holding it)")


def _load_builtin(name: str, entry: dict) -> ModelShape:
    where = f"capdispatch/models/{DATA} ({name})"
    shape = parse(entry["config"], where, name=name,
                  source=f"built-in: {entry['published']}")
    declared = {k: (v["dtype"], v["scale"], tuple(v["block"]) if v["block"] else None)
                for k, v in entry["formats"].items()}
    derived = {f.kind: (f.dtype, f.scale, f.block) for f in shape.formats}
    if declared != derived:
        raise ModelError(f"{where}: formats {declared} disagree with what its config states "
                         f"{derived}")
    return shape


# A published config.json is a few KiB; anything past this bound is not one.
CONFIG_LIMIT = 1 << 20
# Deeper than any config.json nests (quantization_config, rope_scaling: two levels).
MAX_DEPTH = 32


def _read_json(path: str):
    from ..safe_io import FileError, read_bytes
    try:
        data = read_bytes(path, limit=CONFIG_LIMIT, what="config.json")
    except FileError as exc:
        raise ModelError(str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(f"{path}: not UTF-8 text ({exc.reason})") from None
    _check_depth(path, text)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})") from None
    except (ValueError, RecursionError):   # an integer of thousands of digits
        raise ModelError(f"{path}: holds a number thousands of digits long; no config field is "
                         f"that large") from None


def _check_depth(path: str, text: str) -> None:
    """Refuse nesting deeper than MAX_DEPTH before parsing (json recurses per level)."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise ModelError(f"{path}: nested deeper than {MAX_DEPTH} levels; a config.json is flat "
                                 f"but for a few objects")
        elif ch in "]}":
            depth -= 1


def load_model(name_or_path) -> ModelShape:
    """The model-shape record of a built-in (`deepseek-v4-flash`, `deepseek-v4-pro`) or of
    a Hugging Face config.json; every missing or invalid field is a ModelError naming the
    file, the field, its value and what is valid."""
    if isinstance(name_or_path, ModelShape):
        return name_or_path
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ModelError(f"model {name_or_path!r} is not a name or a path")
    text = os.fspath(name_or_path)
    data = _builtin_data()
    if text in data:
        return _load_builtin(text, data[text])
    if not text or not os.path.exists(text):
        if text.lower() in data:
            return _load_builtin(text.lower(), data[text.lower()])
        raise _unknown(text, data)
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if os.path.isdir(text) and not os.path.exists(path):
        raise ModelError(f"{text}: a folder without a config.json; give a config.json or the "
                         f"folder of a Hugging Face checkpoint")
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
    stem = os.path.splitext(os.path.basename(path))[0]
    name = folder if stem == "config" and folder else stem
    # name and source are shown on every page that names the model: a path's control
    # characters print escaped there (the file is opened by PATH itself)
    return parse(_read_json(path), path, name=printable(name), source=printable(path))
