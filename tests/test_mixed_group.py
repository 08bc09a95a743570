"""A mixed rig: what mixed_group: uniform's warnings say runs, bucket drift as it
dispatches, and divergence as one summary line under --brief, lock and lock --check
(the full warnings with -v), device ids as ranges at 128 cards."""
import os
import re

import pytest

import capdispatch as cd
from capdispatch.dispatch import cli
from capdispatch.dispatch.notices import collapse, ids_text
from doc_files import ROOT, docs
from rig_divergence import divergent

RIG = "sim:rtx-5090,sim:rtx-3080,sim:rtx-3080"
# On RIG by the default policy: the KV, indexer, decode and MoE ops diverge, sparse prefill
# runs Triton everywhere (any other op: as the plan decides it, tests/rig_divergence.py).
ON_RIG = {"kv_quant": True, "kv_dequant": True, "indexer": True, "sparse_prefill": False,
          "decode_mla": True, "moe": True}
FRAME = 17      # the lines of `explain --brief` around its op rows on RIG at 80 columns
ASSUME = ["sgl-deep-gemm==0.2.3.post2", "tilelang==0.1.12", "triton==3.9.0", "torch==2.13.0"]


@pytest.fixture
def dispatch(capsys, clean_env, monkeypatch):
    """Run `dispatch ARGS` in this process: (rc, stdout, stderr lines)."""
    monkeypatch.delenv("CAPDISPATCH_LOCK", raising=False)

    def run(*args):
        rc = cli.main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err.splitlines()
    return run


def _warnings(err):
    return [ln for ln in err if ln.startswith("WARNING")]


# --- mixed_group: uniform names what runs -----------------------------------------------------

def test_a_uniform_downgrade_names_the_backend_that_runs():
    p = cd.plan(["sim:rtx-5090", "sim:rtx-3080"], ops=["decode_mla"], log_warnings=False,
                selections=["decode_mla=flashmla"], settings={"mixed_group": "uniform"}, libs="default")
    runs = {d: r.backend for d, r in p.ops["decode_mla"].per_device.items()}
    assert set(runs.values()) == {"triton"}
    w5090 = next(w for w in p.warnings if w.startswith("sim:rtx-5090 "))
    assert w5090.endswith("running triton instead (mixed_group: uniform (settings=); alone it would run "
                          "flashinfer_sparse_mla)")
    assert "running flashinfer_sparse_mla instead" not in " ".join(p.warnings)
    # The card that runs what it would alone keeps its warning as it was.
    w3080 = next(w for w in p.warnings if w.startswith("sim:rtx-3080 "))
    assert w3080.endswith("running triton instead")


# --- lock --check compares buckets as they dispatch -------------------------------------------

def _policy(tmp_path, text):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    return [str(f)]


def test_buckets_that_all_run_the_locked_backend_are_no_drift(clean_env, tmp_path):
    plain = _policy(tmp_path, "ops:\n  decode_mla: [triton]\n")
    lk = cd.lock.freeze(cd.plan(["sim:h200"], ops=["decode_mla"], assume_libs=ASSUME, policy=plain,
                         log_warnings=False))
    f = tmp_path / "b.yaml"
    f.write_text('ops:\n  decode_mla:\n    - {tokens: "<=16", prefer: [triton, flashmla]}\n'
                 '    - {prefer: [triton]}\n')
    now = cd.plan(["sim:h200"], ops=["decode_mla"], assume_libs=ASSUME, policy=[str(f)], log_warnings=False)
    r = now.ops["decode_mla"].per_device["sim:h200"]
    assert [(b.upper, b.backend) for b in r.buckets] == [(16, "triton"), (None, "triton")]
    assert cd.lock.compare(now, lk) == ()
    # And the other way round: a lock with such buckets, a plan with none.
    assert cd.lock.compare(cd.plan(["sim:h200"], ops=["decode_mla"], assume_libs=ASSUME, policy=plain,
                                   log_warnings=False), cd.lock.freeze(now)) == ()


def test_adjacent_buckets_of_one_backend_compare_as_one():
    from capdispatch.dispatch.lock import _effective
    assert _effective(((16, "a"), (64, "a"), (None, "b")), "b") == ((64, "a"), (None, "b"))
    assert _effective(((16, "a"), (None, "a")), "a") == ()
    assert _effective(((16, "a"), (None, "b")), "b") == ((16, "a"), (None, "b"))


# --- one summary line -------------------------------------------------------------------------

def test_brief_says_the_divergence_in_one_line_and_v_in_full(dispatch):
    ops, planned = divergent(RIG, ON_RIG)
    rc, out, err = dispatch("explain", "--device", RIG, "--brief")
    assert rc == 0
    (line,) = _warnings(err)
    assert f"mixed group: {len(ops)} of {len(planned)} ops run different backends on different cards" in line
    assert f"({', '.join(ops)}; mixed_group: warn" in line and "-v shows each" in line
    assert len(line) <= 200
    assert "; 1 warning(s) on stderr" in out       # the caption counts what stderr shows
    rc, out, err = dispatch("explain", "--device", RIG, "--brief", "-v")
    assert len(_warnings(err)) == len(ops) and f"; {len(ops)} warning(s) on stderr" in out
    assert all("choose different backends" in w for w in _warnings(err))
    # The normal output keeps every warning in full.
    rc, out, err = dispatch("explain", "--device", RIG)
    assert len(_warnings(err)) == len(ops)


def test_the_mixed_rig_brief_is_its_op_rows_and_a_fixed_frame(dispatch, monkeypatch):
    """The matrix has one row per op (the registry's); everything around it (headers,
    legend, captions, the one summary line) is FRAME lines, whatever the number of ops:
    with the six ops DeepSeek-V4 calls, 23 lines of an 80 x 24 terminal and the prompt."""
    from capdispatch.dispatch import render
    monkeypatch.setattr(render, "terminal_width", lambda stream=None: 80)     # an 80-column terminal
    _, planned = divergent(RIG, ON_RIG)
    rc, out, err = dispatch("explain", "--device", RIG, "--brief")
    assert rc == 0
    assert max(len(x) for x in out.splitlines()) <= 80
    # What the terminal shows of stderr's lines, folded at 80 columns.
    shown = out.splitlines() + [w[i:i + 80] for w in err for i in range(0, len(w), 80)]
    rows = [x for x in out.splitlines() if x.split()[:1] and x.split()[0] in planned]
    assert [x.split()[0] for x in rows] == planned
    assert len(shown) - len(rows) <= FRAME, "\n".join(shown)


def test_lock_and_a_matching_check_say_the_divergence_once(dispatch, tmp_path):
    path = str(tmp_path / "rig.lock")
    ops, planned = divergent(RIG, ON_RIG)
    rc, _, err = dispatch("lock", "--device", RIG, "-o", path)
    assert rc == 0
    (line,) = _warnings(err)
    assert line.startswith(f"WARNING capdispatch: mixed group: {len(ops)} of {len(planned)} ops") and "mixed_group: uniform" in line
    rc, out, err = dispatch("lock", "--check", path)
    assert rc == 0 and "match the lock" in out
    assert len(_warnings(err)) == 1
    rc, out, err = dispatch("lock", "--check", path, "-v")
    assert rc == 0 and len(_warnings(err)) == len(ops)


def test_sglang_plan_brief_prints_the_warnings_it_counts_the_divergences_in_one_line(dispatch):
    import json
    rc, out, _ = dispatch("sglang", "plan", "--device", RIG, "--format", "json")
    assert rc == 0
    plan = json.loads(out)
    # The ops the plan decides whose cards choose differently: kv_quant keeps SGLang's store
    # on every card; the others as on RIG (any other op: as the plan's own warnings say).
    ops = [op for op in plan["ops"]
           if any(w.startswith(f"{op}: the group's devices choose different backends") for w in plan["warnings"])]
    assert {op: op in ops for op in ON_RIG} == {**ON_RIG, "kv_quant": False}
    rc, out, _ = dispatch("sglang", "plan", "--device", RIG, "--brief")
    assert rc == 0
    lines = out.splitlines()
    (caption,) = [ln for ln in lines if ln.startswith("libraries:")]
    assert caption.endswith("; 1 warning(s) below")
    below = "\n".join(lines[lines.index("warnings:") + 1:])
    assert below.split() == (f"mixed group: {len(ops)} of {len(plan['ops'])} ops run different backends on "
                             f"different cards ({', '.join(ops)}; mixed_group: warn, default.yaml:7); "
                             "without --brief the plan lists each").split()
    rc, out, _ = dispatch("sglang", "plan", "--device", RIG)
    assert rc == 0 and f"; {len(ops)} warning(s) below" in out
    assert len([ln for ln in out.splitlines() if "choose different backends" in ln]) == len(ops)


# --- the docs say the line as the commands print it -------------------------------------------

# What the docs write in the summary line's place for what the registry and the policy decide.
SLOTS = {"K of N": r"\d+ of \d+", "OP, ...": r"\w+(?:, \w+)*", "FILE:LINE": r"[\w./-]+:\d+"}


def _quoted_summaries():
    """(doc, the summary line it quotes, whitespace folded) for every quote in the docs."""
    for doc in docs():
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for m in re.finditer(r"`(mixed group: [^`]*)`", text):
            yield doc, " ".join(m[1].split())


def test_the_docs_quote_the_summary_line_as_the_commands_print_it(dispatch):
    """docs/cli.md (explain) and docs/sglang.md (sglang plan) quote the summary line with
    placeholders where the registry and the policy decide (how many ops of how many, which,
    the policy line): every other word is the commands' today, and no doc writes a count
    of ops that a new op would make stale."""
    rc, _, err = dispatch("explain", "--device", RIG, "--brief")
    (line,) = _warnings(err)
    said = [line.removeprefix("WARNING capdispatch: ")]
    rc, out, _ = dispatch("sglang", "plan", "--device", RIG, "--brief")
    out = out.splitlines()
    said.append(" ".join(" ".join(out[out.index("warnings:") + 1:]).split()))
    quoted = list(_quoted_summaries())
    assert {doc for doc, _ in quoted} >= {"docs/cli.md", "docs/sglang.md"}, quoted
    for doc, q in quoted:
        assert not re.search(r"\d+ of \d+ ops", q), f"{doc} counts the ops: {q}"
        pattern = re.escape(q)
        for slot, rx in SLOTS.items():
            pattern = pattern.replace(re.escape(slot), rx)
        assert any(re.fullmatch(pattern, s) for s in said), (doc, q, said)


# --- ranges -----------------------------------------------------------------------------------

def test_ids_as_ranges():
    assert ids_text([f"cuda:{i}" for i in range(64)]) == "cuda:0-63"
    assert ids_text(["cuda:0", "cuda:1", "cuda:3", "sim:h200", "gpu07"]) == "cuda:0-1, cuda:3, sim:h200, gpu07"
    assert ids_text([f"sim:rtx-3080@{i}" for i in (64, 65, 66, 70)]) == "sim:rtx-3080@64-66, sim:rtx-3080@70"


def test_per_card_warnings_that_differ_only_in_the_card_are_said_once():
    ids = [f"cuda:{i}" for i in range(16)]
    ws = [f"{d} (X): op=a cannot run: {d} lacks f; running b instead" for d in ids]
    assert collapse(ws + ["another"], ids) == [
        "cuda:0-15 (X): op=a cannot run: cuda:0-15 lacks f; running b instead", "another"]
    # cuda:1 is not read inside cuda:12.
    assert collapse(["cuda:12 x", "cuda:1 x"], ["cuda:1", "cuda:12"]) == ["cuda:1, cuda:12 x"]


def test_128_cards_name_their_ids_as_ranges(dispatch):
    big = ",".join(["sim:rtx-5090"] * 64 + ["sim:rtx-3080"] * 64)
    ops, _ = divergent(big, ON_RIG, selections=["decode_mla=flashmla"])
    rc, _, err = dispatch("explain", "--device", big, "--brief", "-v", "--set", "decode_mla=flashmla")
    assert rc == 0
    ws = _warnings(err)
    assert len(ws) == 2 + len(ops), ws    # one downgrade warning per card kind, one per divergence
    assert any(w.startswith("WARNING capdispatch: sim:rtx-3080@64-127 (NVIDIA GeForce RTX 3080): "
                            "decode_mla=flashmla") for w in ws)
    div = next(w for w in ws if "kv_quant: the group's" in w)
    assert "sim:rtx-5090@0-63 (64 x NVIDIA GeForce RTX 5090, cc 12.0) -> triton_fp8" in div
    assert max(len(w) for w in ws) < 400
