"""The layout of benchmarks/results/: the newest run of each series at the top, older runs in archive/.

A series is one benchmark kind on one card: a result file is named
`<kind>_<card>_<YYYYMMDDTHHMMSS[Z]>.<ext>` and its series is everything before the
timestamp (`attention_nvidia_h200`, `moe_tiles_nvidia_h200`, `overhead_cpu-host`,
`cli_cold`). A log folder (the logs of one day's runs on one machine) is named
`<rig>-<YYYY-MM-DD>[-<what>]`; the newest folder of each rig stays at the top.

    python benchmarks/results_dir.py [DIR]

moves every older run and log folder of DIR (default benchmarks/results) into
DIR/archive/, which is what to run after copying a run's files in. Writers call
`archive_previous(out_dir, series)` before writing a new run, which does the same for
that series when out_dir is benchmarks/results and nothing elsewhere. Every benchmark
takes its `--out DIR` from `add_out`.
"""
from __future__ import annotations

import os
import re
import sys

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARCHIVE = "archive"
RUN = re.compile(r"^(?P<series>.+?)_(?P<stamp>\d{8}T\d{6}Z?)\.(?P<ext>[A-Za-z0-9]+)$")
SESSION = re.compile(r"^(?P<rig>[a-z0-9]+)-(?P<date>\d{4}-\d{2}-\d{2})(?:-(?P<what>[a-z0-9-]+))?$")


def add_out(parser, *, default=RESULTS, required: bool = False, help: str | None = None):
    """The benchmarks' --out DIR, the folder a run writes its result files into: DEFAULT
    (benchmarks/results, whatever the working directory), or REQUIRED; HELP says what the
    script writes there where the shared words are not enough."""
    if help is None:
        help = "folder the result files are written into" + (
            "" if required else " (default: benchmarks/results)" if default == RESULTS
            else " (default: none: nothing is written)" if default is None else f" (default: {default})")
    return parser.add_argument("--out", metavar="DIR", default=None if required else default,
                               required=required, help=help)


def parse_run(name: str):
    """(series, stamp) of a timestamped result file name, or None."""
    m = RUN.match(name)
    return (m["series"], m["stamp"].rstrip("Z")) if m else None


def parse_session(name: str):
    """(rig, date) of a log folder name, or None."""
    m = SESSION.match(name)
    return (m["rig"], m["date"]) if m else None


def is_results_dir(out_dir: str, results: str | None = None) -> bool:
    return os.path.realpath(out_dir) == os.path.realpath(RESULTS if results is None else results)


def archive_previous(out_dir: str, series: str, results: str | None = None) -> list:
    """Before a new run of `series` is written into `out_dir`: when out_dir is the results
    folder, move the series' top-level files (timestamped, and an untimestamped
    `<series>.<ext>`) into its archive/. Returns the paths moved to."""
    if not os.path.isdir(out_dir) or not is_results_dir(out_dir, results):
        return []
    names = [n for n in sorted(os.listdir(out_dir)) if os.path.isfile(os.path.join(out_dir, n))
             and ((parse_run(n) or (None,))[0] == series or os.path.splitext(n)[0] == series)]
    return [_move(out_dir, n) for n in names]


def _scan(results: str):
    """{series: {stamp: [names]}} of the top-level result files (stamp "" for an
    untimestamped `<series>.<ext>`) and {rig: [(date, name)]} of the log folders."""
    runs, sessions = {}, {}
    for n in sorted(os.listdir(results)):
        p = os.path.join(results, n)
        if os.path.isfile(p):
            series, stamp = parse_run(n) or (os.path.splitext(n)[0], "")
            runs.setdefault(series, {}).setdefault(stamp, []).append(n)
        elif os.path.isdir(p) and parse_session(n):
            rig, date = parse_session(n)
            sessions.setdefault(rig, []).append((date, n))
    return runs, sessions


def tidy(results: str = RESULTS) -> list:
    """Keep the newest run of each series and the newest log folder of each rig at the
    top of `results`; move the rest into archive/. Returns the paths moved to."""
    runs, sessions = _scan(results)
    old = []
    for by_stamp in runs.values():
        newest = max(by_stamp)          # a timestamped run is newer than an untimestamped one
        old += [n for stamp, names in by_stamp.items() if stamp != newest for n in names]
    for folders in sessions.values():
        newest = max(folders)
        old += [name for key in folders if key != newest for name in [key[1]]]
    return [_move(results, n) for n in sorted(old)]


def top_level_duplicates(results: str = RESULTS) -> list:
    """A message for each series with more than one run, and each rig with more than one
    log folder, at the top of `results`."""
    runs, sessions = _scan(results)
    found = [(f"series {s!r}", sorted(st or "untimestamped" for st in by)) for s, by in runs.items()]
    found += [(f"rig {r!r}", sorted(n for _, n in folders)) for r, folders in sessions.items()]
    return [f"{os.path.basename(os.path.normpath(results))}/ holds {len(v)} runs of {what} at the top "
            f"({', '.join(v)}); keep the newest there and move the rest into {ARCHIVE}/ "
            "(python benchmarks/results_dir.py)"
            for what, v in sorted(found) if len(v) > 1]


def _move(folder: str, name: str) -> str:
    dest_dir = os.path.join(folder, ARCHIVE)
    os.makedirs(dest_dir, exist_ok=True)
    dest = os.path.join(dest_dir, name)
    if os.path.exists(dest):
        raise FileExistsError(f"cannot archive {os.path.join(folder, name)}: {dest} exists already "
                              "(an archived run is never overwritten)")
    os.rename(os.path.join(folder, name), dest)
    return dest


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = argv[0] if argv else RESULTS
    for dest in tidy(folder):
        print(f"archived {os.path.relpath(dest, folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
