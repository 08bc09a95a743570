"""Terminal rendering: the op x device matrix, symbols that fit the output's encoding,
and wrapping to the terminal's width (every command's text wraps through `wrap`).
`rich` is imported only when a matrix is drawn."""
from __future__ import annotations

import io
import os
import shutil
import sys
import textwrap
from typing import Optional, Sequence

import attrs

WIDTH = 100    # the width when the output is not a terminal (piped, a file)
NARROWEST = 40

# Cell kinds, each with a mark (after the backend name), a colour, and a legend line.
KINDS = {
    "first": ("", "green", None),
    "fallback": ("*", "yellow", "* fallback: the first preference cannot run on that device"),
    "downgraded": ("!", "bold red", "! downgraded: an explicit choice cannot run there (see warnings)"),
    "uniform": ("=", "cyan", "= changed by mixed_group: uniform (alone the device would run another)"),
    "routed": ("^", "magenta", "^ routed: capdispatch's kernel serves SGLang's call site there"),
    "none": ("", "dim", None),
}


@attrs.frozen
class Cell:
    text: str
    kind: str = "first"      # a key of KINDS


@attrs.frozen
class Row:
    label: str
    cells: tuple             # Cell per column
    diverges: bool = False   # the group's devices run different backends


@attrs.frozen
class Symbols:
    ok: str
    bad: str
    arrow: str
    differs: str


UNICODE = Symbols("✓", "✗", "->", "≠")
ASCII = Symbols("+", "x", "->", "!=")


def encodes(text: str, stream=None) -> bool:
    """Whether STREAM's encoding (default: stdout's) can write TEXT."""
    enc = getattr(stream if stream is not None else sys.stdout, "encoding", None) or "ascii"
    try:
        text.encode(enc)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def symbols(stream=None) -> Symbols:
    return UNICODE if encodes("✓✗≠─│", stream) else ASCII


def use_color(stream=None, env=None) -> bool:
    """Colour only on a terminal, never under NO_COLOR (https://no-color.org) or TERM=dumb;
    FORCE_COLOR turns it on anywhere."""
    env = os.environ if env is None else env
    if env.get("NO_COLOR"):
        return False
    if env.get("FORCE_COLOR"):
        return True
    stream = stream if stream is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and env.get("TERM") != "dumb"


def terminal_width(stream=None) -> int:
    """The columns text on STREAM (default: stdout) wraps at, read when called: the
    terminal's width (COLUMNS overrides it, as shutil reads it), WIDTH when not a terminal."""
    stream = stream if stream is not None else sys.stdout
    try:
        if not stream.isatty():
            return WIDTH
    except (AttributeError, OSError, ValueError):
        return WIDTH
    return max(NARROWEST, shutil.get_terminal_size((WIDTH, 24)).columns)


def _column_width(header: str, rows: Sequence[Row], i: int) -> int:
    return 3 + max([len(x) for x in header.split("\n")]
                   + [len(r.cells[i].text) + 1 for r in rows if i < len(r.cells)])


def natural_width(columns: Sequence[str], rows: Sequence[Row], corner: str = "op") -> int:
    """The width of the matrix with no cell folded."""
    width = max(len(corner), *(len(r.label) + 2 for r in rows)) + 4 if rows else len(corner) + 4
    return width + sum(_column_width(c, rows, i) for i, c in enumerate(columns))


def _chunks(columns, rows, corner: str, width: int) -> list:
    """Column index ranges whose tables each fit WIDTH (at least one column each)."""
    base = natural_width([], rows, corner)
    out, start, used = [], 0, base
    for i, c in enumerate(columns):
        w = _column_width(c, rows, i)
        if i > start and used + w > width:
            out.append(range(start, i))
            start, used = i, base
        used += w
    out.append(range(start, len(columns)))
    return out


def render_matrix(columns: Sequence[str], rows: Sequence[Row], *, title: str = "",
                  caption: str = "", corner: str = "op", color: Optional[bool] = None,
                  width: Optional[int] = None, ascii_only: Optional[bool] = None,
                  stream=None) -> str:
    """A table: one row per op, one column per device (COLUMNS: header text, may hold
    newlines), a mark per cell kind, divergent rows flagged, a legend of the marks used.
    COLOR / ASCII_ONLY / WIDTH default to what STREAM (stdout) supports. Columns that do
    not fit WIDTH wrap: the table continues below, the op labels repeated."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    color = use_color(stream) if color is None else color
    ascii_only = (not encodes("─│≠", stream)) if ascii_only is None else ascii_only
    sym = ASCII if ascii_only else UNICODE
    width = terminal_width(stream) if width is None else width
    chunks = _chunks(columns, rows, corner, width)
    # Never fold a backend name: a single column wider than the terminal stays whole.
    width = max(width, *(natural_width([columns[i] for i in ch], [
        Row(r.label, tuple(r.cells[i] for i in ch if i < len(r.cells)), r.diverges) for r in rows],
        corner) for ch in chunks))
    used = set()
    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=color, no_color=not color,
                      color_system="standard" if color else None, highlight=False,
                      emoji=False, legacy_windows=False, soft_wrap=False)
    for n, chunk in enumerate(chunks):
        table = Table(title=(title or None) if n == 0 else None, title_justify="left", caption=None,
                      box=box.ASCII2 if ascii_only else box.SIMPLE_HEAVY, show_lines=False,
                      pad_edge=False, header_style="bold" if color else "",
                      title_style="bold" if color else "", safe_box=True)
        table.add_column(corner, no_wrap=True, style="bold" if color else "")
        for i in chunk:
            table.add_column(columns[i], overflow="fold")
        for row in rows:
            label = Text(row.label + (f" {sym.differs}" if row.diverges else ""),
                         style="yellow" if (color and row.diverges) else "")
            cells = []
            for i in chunk:
                if i >= len(row.cells):
                    continue
                mark, style, _ = KINDS[row.cells[i].kind]
                used.add(row.cells[i].kind)
                cells.append(Text(row.cells[i].text + mark, style=style if color else ""))
            table.add_row(label, *cells)
        if n:
            console.print("")
        console.print(table)
    legend = [KINDS[k][2] for k in KINDS if k in used and KINDS[k][2]]
    if any(r.diverges for r in rows):
        legend.append(f"{sym.differs} the group's devices run different backends for that op")
    for line in legend + ([caption] if caption else []):
        console.print(Text(line, style="dim" if color else ""), overflow="fold")
    lines = [line.rstrip() for line in buf.getvalue().splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    return "\n".join(line for i, line in enumerate(lines)
                     if line or (i and lines[i - 1] and i + 1 < len(lines)))


def wrap(text: str, indent: str = "", *, hang: str = "  ", width: Optional[int] = None,
         stream=None, break_long: bool = True) -> list:
    """TEXT as lines of at most WIDTH columns (default: terminal_width(STREAM)): the first
    with INDENT, the rest with INDENT + HANG; a word longer than a line is broken unless
    not BREAK_LONG (a URL stays whole to be copied)."""
    width = terminal_width(stream) if width is None else width
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent + hang,
                         break_on_hyphens=False, break_long_words=break_long) or [indent]


def wrap_lines(lines, *, hang: str = "  ", width: Optional[int] = None, stream=None,
               break_long: bool = True) -> list:
    """Each of LINES wrapped (its own leading spaces kept as its indent)."""
    width = terminal_width(stream) if width is None else width
    out = []
    for line in lines:
        body = line.lstrip(" ")
        out += (wrap(body, line[:len(line) - len(body)], hang=hang, width=width, break_long=break_long)
                if body else [line])
    return out
