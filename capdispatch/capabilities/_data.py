"""Reading the package's own YAML data files (safe loader only)."""
from __future__ import annotations

import functools
from importlib import resources

import yaml


@functools.lru_cache(maxsize=None)
def load(name: str) -> dict:
    # Static package data, the same for every device: safe to keep.
    text = resources.files("capdispatch.capabilities").joinpath(name).read_text("utf-8")
    return yaml.safe_load(text)
