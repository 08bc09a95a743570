"""The kernel benchmarks' ``--tiles`` option: run capdispatch's Triton kernels with the
launch-table entries of the card they run on (``card``, the default), or with those
the 99 KB-shared-memory cards get (``99kb``: SM86, SM89, SM120, 101376 B per block),
restricting shared memory as those cards would (capdispatch.backends.launch_limits).

A ``99kb`` run is its own results series (``<kind>_<card>_99kb_<stamp>``) and times
only the capdispatch Triton backends, each checked against the op's reference first.
"""
from __future__ import annotations

import contextlib

TILES = ("card", "99kb")
LABEL_99KB = "99 KB tiles (as sm_86/sm_89/sm_120 get them)"
CARDS_99KB = ("sm_86", "sm_89", "sm_120")


def add_argument(parser) -> None:
    parser.add_argument("--tiles", choices=TILES, default="card",
                        help="launch-table entries: this card's own (card, default) or those the 99 KB "
                             "cards SM86/SM89/SM120 get, with their shared-memory limit (99kb)")


def check_backends(parser, args, triton_backends) -> None:
    """A ``--tiles`` other than ``card`` times the Triton backends: refuse a ``--backends``
    list that names none of them (argparse's usage error, exit 2)."""
    if args.tiles != "card" and not any(b in triton_backends for b in args.backends):
        parser.error(f"--tiles {args.tiles} times the Triton backends ({', '.join(triton_backends)}); "
                     f"--backends names none")


def suffix(mode: str) -> str:
    """What the results series name gains: '' or '_99kb'."""
    return "" if mode == "card" else "_" + mode


def label(mode: str) -> str:
    return "this card's own tiles" if mode == "card" else LABEL_99KB


def target(mode: str):
    """The bench.TileTarget of MODE, or None for the card's own tiles. The 99 KB
    target is sm_86's; the three cards' shared memory must agree (the catalog says so)."""
    _check_mode(mode)
    if mode == "card":
        return None
    from capdispatch import bench
    targets = [bench.card_target(k) for k in CARDS_99KB]
    sizes = {t.shared_bytes for t in targets}
    if len(sizes) != 1:
        raise ValueError(f"the 99 KB cards {CARDS_99KB} disagree on shared memory per block: {sorted(sizes)}")
    return bench.TileTarget(capability=targets[0].capability, shared_bytes=targets[0].shared_bytes, label=LABEL_99KB)


def checked(mode: str, fn):
    """Call FN under MODE's tiles, compiling and checking every launch first:
    (result or None, launches (launch_limits.Launch records), exception or None)."""
    t = target(mode)
    if t is None:
        return fn(), [], None
    from capdispatch import bench
    with bench.tiles_as(t) as scope:
        try:
            return fn(), list(scope.launches), None
        except Exception as exc:   # noqa: BLE001 - e.g. no entry fits: the card would fail the same way
            return None, list(scope.launches), exc


def timing(mode: str):
    """A context for the timing loop: MODE's tiles without the per-launch compile check
    (run ``checked`` on the same shape first)."""
    t = target(mode)
    if t is None:
        return contextlib.nullcontext()
    from capdispatch import bench
    return bench.tiles_as(t, check=False)


def launch_rows(launches) -> list:
    """JSON rows of the distinct checked launches, in order."""
    out, seen = [], set()
    for r in launches:
        key = (r.kernel, tuple(sorted(r.config.items())), r.fits)
        if key in seen:
            continue
        seen.add(key)
        config = {k: v if isinstance(v, (bool, int, float, str)) or v is None else str(v) for k, v in r.config.items()}
        out.append(dict(kernel=r.kernel, config=config, shared_bytes=r.shared, registers=r.registers,
                        spills=r.spills, fits=r.fits))
    return out


def _entry(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def describe(rows, limit: int | None = None) -> str:
    """One line per launch row: the entry and its compiled facts; a skipped entry says why."""
    parts = []
    for r in rows:
        facts = ", ".join(s for s in (
            f"{r['shared_bytes']} B shared" if r["shared_bytes"] is not None else "",
            f"{r['registers']} regs" if r["registers"] is not None else "",
            f"{r['spills']} B spilled" if r["spills"] is not None else "") if s)
        state = "ran" if r["fits"] else f"skipped (over {limit} B)" if limit else "skipped (over the limit)"
        parts.append(f"{r['kernel']} [{_entry(r['config'])}] {facts or 'no compile facts'}: {state}")
    return "; ".join(parts)


def entries_table(label: str, limit, heads: tuple, rows, ran_head: str = "fits",
                  skipped: str = "no: the card fails here") -> list:
    """Markdown lines of a --tiles run's launch-table entries. HEADS: the leading columns
    (name, alignment); ROWS: (leading cells, launch row of launch_rows) pairs."""
    num = lambda v: "—" if v is None else str(v)  # noqa: E731
    return ["", f"Launch-table entries ({label}; compiled on this GPU, at most {limit} B of shared memory "
            "per block):", "",
            "| " + " | ".join(h for h, _ in heads) + f" | kernel | entry | shared B | registers | spills B | {ran_head} |",
            "| " + " | ".join(a for _, a in heads) + " | --- | --- | ---: | ---: | ---: | --- |"] + [
        "| " + " | ".join(str(c) for c in cells) + f" | {e['kernel']} | {_entry(e['config'])} | "
        f"{num(e['shared_bytes'])} | {num(e['registers'])} | {num(e['spills'])} | "
        f"{'yes' if e['fits'] else skipped} |" for cells, e in rows]


def header_lines(mode: str) -> list:
    """Markdown lines a results file of MODE starts its body with."""
    if mode == "card":
        return []
    t = target(mode)
    return [f"- tiles: **{LABEL_99KB}**: launch-table lookups answer for compute capability "
            f"{t.capability[0]}.{t.capability[1]} and every capdispatch Triton launch is compiled first and "
            f"skipped when it needs more than {t.shared_bytes} B of shared memory per block, as on those "
            "cards; kernels are compiled for and timed on this GPU (its SM count, occupancy and compiler "
            "target are this GPU's, not the 99 KB cards'); the native-fp8 variants are what SM89 and SM120 get "
            "(Triton admits fp8e4nv from 8.9), SM86 runs the uint8 ones"]


def _check_mode(mode: str) -> None:
    if mode not in TILES:
        raise ValueError(f"--tiles {mode!r}: valid values are {', '.join(TILES)}")
