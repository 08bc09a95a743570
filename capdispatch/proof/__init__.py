"""Proof on the card: canaries run in child processes, and the cache of their verdicts.

Imports nothing heavy: the child process and the canaries import torch when they run.
"""
from . import cache
from .cache import CardCache, cache_dir, clear, lookup, open_card, store
from .verdict import OUTCOMES, Verdict

__all__ = ["OUTCOMES", "CardCache", "Verdict", "cache", "cache_dir", "clear", "lookup",
           "open_card", "store"]
