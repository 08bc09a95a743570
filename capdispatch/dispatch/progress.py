"""A progress line on stderr, never on stdout (JSON output stays clean): rich's transient
bar on a terminal, as `dispatch verify` draws it; plain lines when stderr is not a
terminal (a log, CI), one per finished item or changed state."""
from __future__ import annotations

import collections
import sys
from typing import Optional


class Progress:
    """WHAT (a verb: 'verifying') over TOTAL items (None: a state, no count)."""

    def __init__(self, what: str, total: Optional[int] = None, stream=None):
        self.what, self.total, self.done = what, total, 0
        self.stream = stream if stream is not None else sys.stderr
        self.bar, self.last = None, None
        if _isatty(self.stream) and total != 0:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as Bar, TextColumn, TimeElapsedColumn
            columns = [TextColumn("{task.description}")]
            if total:
                columns += [BarColumn(), TextColumn("{task.completed}/{task.total}")]
            self.bar = Bar(*columns, TimeElapsedColumn(), console=Console(file=self.stream), transient=True)
            self.task = self.bar.add_task(what, total=total)

    def __enter__(self):
        if self.bar:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)

    def update(self, text: str, *, log: bool = False) -> None:
        """Show TEXT as the current state; without a terminal, a line when LOG and it changed."""
        if self.bar:
            self.bar.update(self.task, description=f"{self.what} {text}")
        elif log and text != self.last:
            self._line(text)
        self.last = text

    def advance(self, text: str) -> None:
        """One item finished (TEXT: which, and how it ended)."""
        self.done += 1
        if self.bar:
            self.bar.advance(self.task)
        else:
            self._line(f"[{self.done}/{self.total}] {text}" if self.total else text)

    def _line(self, text: str) -> None:
        print(f"{self.what}: {text}", file=self.stream, flush=True)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


def rank_phase(where: str) -> str:
    """A rank's progress file as a phase: 'moe (layer 1, decode step 2)' -> 'decode step 2'."""
    where = where.strip() or "starting"
    if where.endswith(")") and " (" in where:
        inner = where[where.index(" (") + 2:-1]
        return inner.split(", ", 1)[1] if ", " in inner else inner
    return where


def ranks_line(states, steps: int) -> str:
    """The ranks' phases in one line: '3 rank(s): 2 decode step 2/3, 1 prefill'."""
    counts = collections.Counter(rank_phase(s) for s in states)
    parts = [f"{n} {phase}" + (f"/{steps}" if phase.startswith("decode step") else "")
             for phase, n in counts.items()]
    return f"{len(states)} rank(s): " + ", ".join(parts)


class RanksWatch:
    """`dispatch rehearse`'s progress: called with every rank's progress text while the ranks
    run (runner.rehearse's ON_PROGRESS), with None when they are done."""

    def __init__(self, steps: int, stream=None):
        self.steps, self.stream, self.progress, self.states = steps, stream, None, []

    def __call__(self, states) -> None:
        if states is None:
            if self.progress is not None:
                self.progress.__exit__(None, None, None)
                self.progress = None
            return
        if self.progress is None:
            self.progress = Progress("rehearsing", stream=self.stream).__enter__()
        # An empty read is a rank rewriting its file: it keeps the state read before.
        before = self.states + [""] * (len(states) - len(self.states))
        self.states = [s or b for s, b in zip(states, before)]
        self.progress.update(ranks_line(self.states, self.steps), log=True)
