"""From timings to buckets: the fastest backend per size, an incumbent kept inside the
noise band, adjacent sizes with one winner merged. Pure: no torch, no device.

The stability law: with the previous calibration as incumbent, a size keeps its
backend unless another is faster by more than the band, so re-measuring on the same
card (each time within a factor sqrt(1 + noise) of the last) writes the same buckets.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import attrs

from ..errors import ArgumentError


@attrs.frozen
class Choice:
    size: int
    winner: str
    order: tuple          # winner first, then the others by time
    times: dict           # backend -> ms, the backends whose output passed the check
    kept: bool            # the incumbent, kept within the noise band though not the fastest


@attrs.frozen
class Run:
    """Adjacent sizes with one winner: one bucket. UPPER None: the catch-all."""
    upper: Optional[int]
    winner: str
    order: tuple
    choices: tuple


def choose(times: dict, noise: float, incumbent: Callable[[int], Optional[str]] = lambda s: None) -> list:
    """TIMES: size -> {backend: ms}. The fastest backend wins a size unless the incumbent
    for it is within NOISE (a fraction: 0.05 is 5%) of the fastest."""
    out = []
    for size in sorted(times):
        t = times[size]
        if not t:
            raise ArgumentError(f"size {size}: no backend was measured")
        fastest = min(t, key=lambda b: (t[b], b))
        inc = incumbent(size)
        keep = inc is not None and inc in t and inc != fastest and t[inc] <= t[fastest] * (1 + noise)
        winner = inc if keep else fastest
        rest = sorted((b for b in t if b != winner), key=lambda b: (t[b], b))
        out.append(Choice(size, winner, (winner, *rest), dict(t), keep))
    return out


def merge(choices) -> list:
    """Runs of adjacent sizes with one winner; the last run is the catch-all. Inside a
    run the fallbacks go by their mean time relative to the fastest at each size."""
    groups = []
    for c in choices:
        if groups and groups[-1][-1].winner == c.winner:
            groups[-1].append(c)
        else:
            groups.append([c])
    runs = []
    for i, g in enumerate(groups):
        names = {b for c in g for b in c.times}
        winner = g[0].winner

        def score(b):
            ratios = [c.times[b] / min(c.times.values()) if b in c.times else math.inf for c in g]
            return (sum(ratios) / len(ratios), b)
        rest = sorted((b for b in names if b != winner), key=score)
        upper = None if i == len(groups) - 1 else g[-1].size
        runs.append(Run(upper, winner, (winner, *rest), tuple(g)))
    return runs


def smooth(choices, noise: float) -> list:
    """Neighbouring sizes within the noise band keep one winner. Going up the ladder, a size
    whose winner differs from the size below takes that size's winner instead when it is
    within NOISE of the fastest here; then going down, likewise with the size above.
    Timings a few percent apart then give one bucket, not an A/B/A/B run of buckets that
    noise wrote. Never picks a backend more than the band slower than the fastest at any
    size, and never adds a bucket."""
    out = list(choices)
    for order in (range(1, len(out)), range(len(out) - 2, -1, -1)):
        for i in order:
            c = out[i]
            other = out[i - 1] if order.step == 1 else out[i + 1]
            w, t = other.winner, c.times
            if w != c.winner and w in t and t[w] <= min(t.values()) * (1 + noise):
                rest = sorted((b for b in t if b != w), key=lambda b: (t[b], b))
                out[i] = Choice(c.size, w, (w, *rest), dict(t), True)
    return out
