"""docs/policies.md, "What the default orders rest on": the table of each op's default order
per card family and what each position rests on, checked against the code, so that it
cannot drift from default.yaml and the backends' requirements:

* every op of default.yaml has one row per family, no more;
* a row's order is the order default.yaml and the requirements give that family: the
  backends whose checks other than installed libraries pass on a simulated card of it
  (SM80/86: sim:sm_80 and sim:sm_86 alike), in the policy's order;
* each position of the order has exactly one entry, in order, saying measured, projected,
  guess or only; a measured entry names the card and cites a results file;
* every file the section cites exists.
"""
from __future__ import annotations

import functools
import os
import re

import pytest
import yaml

import capdispatch as cd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "policies.md")
SECTION = "## What the default orders rest on"
FAMILIES = {"SM80/86": ("sim:sm_80", "sim:sm_86"), "SM89": ("sim:sm_89",), "SM90": ("sim:sm_90",),
            "SM100": ("sim:sm_100",), "SM120": ("sim:sm_120",)}
KINDS = ("measured", "projected", "guess", "only")
_ROW = re.compile(r"^\| `(?P<op>[a-z_0-9]+)` \| (?P<family>[A-Z0-9/]+) \| (?P<order>[^|]+) \| (?P<why>.+) \|$")
_ITEM = re.compile(r"^`(?P<backend>[a-z_0-9]+)`: (?P<kind>[a-z]+)\b(?P<rest>.*)$")
_PATH = re.compile(r"`((?:benchmarks|docs|capdispatch)/[^`]+)`|\b(docs/[A-Za-z0-9_./-]+\.md)\b")


def _section(text: str) -> str:
    assert text.count(SECTION) == 1, f"{DOC}: the section {SECTION!r} must be there once"
    body = text.split(SECTION, 1)[1]
    return body.split("\n## ", 1)[0]


@functools.lru_cache(maxsize=None)
def _rows():
    with open(DOC, encoding="utf-8") as f:
        sec = _section(f.read())
    rows = []
    for line in sec.splitlines():
        if line.startswith("| `"):
            m = _ROW.match(line)
            assert m, f"{DOC}: a table row that does not read as | `op` | family | order | evidence |: {line[:120]}"
            rows.append(m.groupdict())
    return sec, rows


def _policy_ops() -> list:
    with open(os.path.join(ROOT, "capdispatch", "policies", "default.yaml"), encoding="utf-8") as f:
        return list(yaml.safe_load(f)["ops"])


@functools.lru_cache(maxsize=None)
def _hardware_order(op: str, device: str) -> tuple:
    """The backends of OP's order whose checks other than installed libraries pass on DEVICE."""
    res = cd.resolve(op, device)
    return tuple(c.backend for c in res.candidates
                 if all(ch.ok for ch in c.checks if not ch.code.startswith("library:")))


def _names(cell: str) -> tuple:
    names = tuple(n.strip() for n in cell.split(","))
    assert all(re.fullmatch(r"`[a-z_0-9]+`", n) for n in names), cell
    return tuple(n.strip("`") for n in names)


def _check_coverage(rows):
    got = sorted((r["op"], r["family"]) for r in rows)
    want = sorted((op, fam) for op in _policy_ops() for fam in FAMILIES)
    assert got == want, f"rows missing: {sorted(set(want) - set(got))}; extra or twice: " \
                        f"{sorted(p for p in got if got.count(p) > 1 or p not in want)}"


def _check_orders(rows, family):
    for r in rows:
        if r["family"] != family:
            continue
        for dev in FAMILIES[family]:
            want = _hardware_order(r["op"], dev)
            assert _names(r["order"]) == want, \
                f"{DOC}: {r['op']} {family} lists {_names(r['order'])}, {dev} runs {want} in default.yaml's order"


def _check_entries(rows):
    for r in rows:
        order = _names(r["order"])
        items = [i.strip() for i in r["why"].split("<br>")]
        parsed = [_ITEM.match(i) for i in items]
        assert all(parsed), f"{r['op']} {r['family']}: an entry not of the form `backend`: kind ...: {items}"
        assert tuple(m["backend"] for m in parsed) == order, \
            f"{r['op']} {r['family']}: entries {[m['backend'] for m in parsed]} against the order {order}"
        for m in parsed:
            where = f"{r['op']} {r['family']} {m['backend']}"
            assert m["kind"] in KINDS, f"{where}: {m['kind']!r} is not one of {KINDS}"
        measured = [m for m in parsed if m["kind"] == "measured"]
        if measured:
            assert "benchmarks/results/" in r["why"], f"{r['op']} {r['family']}: measured, but no results file cited"
            assert "H200" in r["why"] or "H100" in r["why"], f"{r['op']} {r['family']}: measured on which card?"


def _check_files(sec):
    paths = {a or b for a, b in _PATH.findall(sec)}
    assert any(p.startswith("benchmarks/results/") for p in paths)
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"{DOC}: cited files that do not exist: {missing}"


def test_every_op_has_one_row_per_family():
    _check_coverage(_rows()[1])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_order_column_is_what_the_family_runs(family):
    _check_orders(_rows()[1], family)


def test_each_position_says_what_it_rests_on():
    _check_entries(_rows()[1])


def test_cited_files_exist():
    _check_files(_rows()[0])


def _with(rows, op, family, **change):
    return [dict(r, **change) if (r["op"], r["family"]) == (op, family) else r for r in rows]


def test_checks_refuse_a_wrong_table():
    """Each check refuses a table that is wrong in one way: a row missing or twice, another
    family's order, an entry left out or out of order, a word that is not one of the four, a
    measurement without a results file, a cited file that does not exist."""
    sec, rows = _rows()
    r = next(x for x in rows if x["op"] == "decode_mla" and x["family"] == "SM90")
    sm86 = next(x for x in rows if x["op"] == "decode_mla" and x["family"] == "SM80/86")
    bad = [
        (_check_coverage, rows[1:]),
        (_check_coverage, rows + rows[:1]),
        (lambda t: _check_orders(t, "SM90"), _with(rows, "decode_mla", "SM90", order=sm86["order"])),
        (_check_entries, _with(rows, "decode_mla", "SM90", why=r["why"].split("<br>", 1)[1])),
        (_check_entries, _with(rows, "decode_mla", "SM90", why="<br>".join(reversed(r["why"].split("<br>"))))),
        (_check_entries, _with(rows, "decode_mla", "SM90", why=r["why"].replace("`flashmla`: measured",
                                                                               "`flashmla`: believed"))),
        (_check_entries, _with(rows, "decode_mla", "SM90", why=re.sub(r"`benchmarks/results/[^`]+`", "a run",
                                                                      r["why"]))),
        (_check_files, sec + "\n`benchmarks/results/no_such_run.md`"),
    ]
    for check, table in bad:
        with pytest.raises(AssertionError):
            check(table)
