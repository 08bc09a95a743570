"""`dispatch rehearse`: ranks in their own processes over gloo on the CPU, each running its
own decisions on a small V4-shaped model against the single-process reference; a fault
planted on one rank is named with its rank and op within a bounded time."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from capdispatch.dispatch.cli import main
from capdispatch.models import ModelError, model_calls
from capdispatch.rehearse import devices, runner
from capdispatch.rehearse.errors import RehearseError
from capdispatch.rehearse.rank import FAULT_ENV, parse_fault

TP3 = str(Path(__file__).parent / "rehearse" / "v4-tp3" / "config.json")   # 48 heads: tp 3 divides
SEED_RIG = "emu:rtx-5090@cpu,emu:rtx-3080@cpu,emu:rtx-3080@cpu"
SMALL = dict(layers=1, prompt=4, steps=2)


def _rehearse(devs, model="deepseek-v4-flash", libs="sglang-0.5.23", **kw):
    return runner.rehearse(devices.parse_list([devs]), model, libs=libs, **kw)


def test_seed_rig_emulated_on_cpu_matches_reference():
    r = _rehearse(SEED_RIG, TP3, layers=2, prompt=4, steps=2, timeout=90)
    assert r.ok, r.cause
    assert r.backend == "gloo" and r.tp == 3 and r.dims["heads"] == 16
    for k in r.ranks:
        assert k.max_rel_err is not None and k.max_rel_err <= runner.LOGITS_REL_TOL
        assert {o.op for o in k.ops} == set(model_calls().ops)
        for o in k.ops:
            assert o.ok and o.calls > 0
            # Nothing claims a GPU kernel ran on the CPU: every other choice is a marked substitution.
            assert (o.substituted is None) == (o.decided == o.ran), o
    by = {(k.rank, o.op): o for k in r.ranks for o in k.ops}
    # The cards decide differently (fp8 on the 5090, u8 on the 3080s), as a real rig would.
    assert by[(0, "kv_quant")].decided != by[(1, "kv_quant")].decided
    assert by[(1, "kv_quant")].decided == by[(2, "kv_quant")].decided
    assert by[(0, "moe")].calls == 2 * 3        # 2 layers x (prefill + 2 decode steps)
    # docs/rehearse.md's example of this rig is what the report says, numbers and elisions aside.
    from capdispatch.dispatch.rehearse_cmd import planned, render
    text = render(r, planned(devices.parse_list([SEED_RIG]), "sglang-0.5.23").whose)
    _assert_reads_as(_doc_example("--model tests/rehearse/v4-tp3/config.json"), text.splitlines())


def _shape(line) -> str:
    """LINE with its numbers, paths and column padding left out."""
    import re
    return " ".join(re.sub(r"\d+(\.\d+)?(e[+-]\d+)?|~?/\S+", "N", line).split())


def _assert_reads_as(doc, got) -> None:
    """DOC's lines are GOT's in order, numbers aside: each run between two `...` lines
    consecutive in GOT, the first run from GOT's first line, the last to its last."""
    runs, run = [], []
    for line in doc + ["..."]:
        if line.strip() == "...":
            runs.append([_shape(x) for x in run])
            run = []
        else:
            run.append(line)
    got = [_shape(x) for x in got]
    at = 0
    for i, run in enumerate(runs):
        starts = [j for j in range(at, len(got) - len(run) + 1) if got[j:j + len(run)] == run]
        assert starts, f"docs/rehearse.md's lines {run} are not the report's:\n" + "\n".join(got)
        assert i or starts[0] == 0, "the report opens otherwise"
        at = starts[0] + len(run)
    assert at == len(got), "the report ends otherwise"


def _doc_example(marker) -> list:
    """The output lines of docs/rehearse.md's example whose command holds MARKER."""
    text = (Path(__file__).parent.parent / "docs" / "rehearse.md").read_text(encoding="utf-8")
    start = text.index(marker)
    lines = text[start:text.index("```", start)].splitlines()
    while lines and not lines[0].startswith("rehearsal of"):
        lines.pop(0)
    assert lines, marker
    return lines


def test_wrong_output_is_named_with_rank_and_op(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:moe:wrong")
    r = _rehearse("cpu,cpu", timeout=60, **SMALL)
    assert not r.ok
    bad = r.ranks[1]
    assert bad.failed_op == "moe" and "differs from the reference" in bad.error
    assert r.cause.startswith("rank 1:") and "moe" in r.cause
    # A planted fault tests the rehearsal, not the cards: never recorded as their verdict.
    assert r.recorded is None


def test_wrong_kv_quant_fails_the_rank_and_the_run(monkeypatch):
    """The store's output is the pool: a wrong pool byte fails the rank, named with its op."""
    monkeypatch.setenv(FAULT_ENV, "1:kv_quant:wrong")
    r = _rehearse("cpu,cpu", timeout=60, **SMALL)
    assert not r.ok and r.recorded is None
    assert not r.ranks[1].ok     # rank 0 then fails in its all-reduce: the cause is rank 1's
    assert r.ranks[1].failed_op == "kv_quant" and "pool bytes differ" in r.ranks[1].error
    assert r.cause.startswith("rank 1:") and "kv_quant" in r.cause


def test_unverified_fails_closed():
    from capdispatch.rehearse.rank import unverified
    assert unverified({"moe": {"calls": 3, "ok": True}}) == ""
    assert "never called" in unverified({"moe": {"calls": 3, "ok": True}, "indexer": {"calls": 0, "ok": True}})
    assert "differs" in unverified({"moe": {"calls": 3, "ok": False, "worst": "x"}})
    assert "differs" in unverified({"moe": {"calls": 3, "ok": None}})     # unchecked is not a pass


def test_fault_on_a_rank_that_does_not_exist_is_refused(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "2:moe:wrong")
    with pytest.raises(RehearseError, match="rank 2 does not exist"):
        _rehearse("cpu,cpu", **SMALL)


def test_no_decode_step_is_refused():
    # decode_mla and the indexer run only in decode steps: a run without one checks neither.
    with pytest.raises(RehearseError, match="--steps 0: must be at least 1"):
        _rehearse("cpu", layers=1, prompt=4, steps=0)


def test_hang_is_bounded_and_named(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:decode_mla:hang")
    t0 = time.monotonic()
    r = _rehearse("cpu,cpu", timeout=4, **SMALL)
    # Start (imports: under 20 s on a loaded CI machine), the run up to the hang, the timeout.
    assert time.monotonic() - t0 < 20 + 10 + 4
    assert not r.ok
    assert r.ranks[1].failed_op == "decode_mla" and "made no progress for 4 s" in r.ranks[1].error
    assert r.cause.startswith("rank 1:")
    assert not r.ranks[0].ok and "all_reduce" in r.ranks[0].error   # it waited, bounded, in its all-reduce


@pytest.mark.parametrize("kind, says", [("raise", "planted fault"), ("exit", "died (exit 17)")])
def test_exception_or_death_is_named(monkeypatch, kind, says):
    monkeypatch.setenv(FAULT_ENV, f"0:kv_quant:{kind}")
    r = _rehearse("cpu,cpu", timeout=60, **SMALL)
    assert not r.ok and r.ranks[0].failed_op == "kv_quant"
    assert says in r.cause and r.cause.startswith("rank 0:")


def test_a_port_taken_in_the_race_is_named_at_once(monkeypatch):
    """Another process takes the chosen port before rank 0 binds it: rank 0 fails naming
    the port, and the run ends then, not when the others' start timeout runs out."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(runner, "_port", lambda: port)
        t0 = time.monotonic()
        r = _rehearse("cpu,cpu", timeout=60, start_timeout=60, record=False, **SMALL)
        took = time.monotonic() - t0
    assert took < 20, took                        # the start timeout is 60 s
    assert not r.ok and r.cause.startswith("rank 0: PortTaken: the rendezvous port "
                                           f"127.0.0.1:{port} was taken by another process"), r.cause
    assert "run again" in r.cause
    assert "still running when rank 0 failed" in r.ranks[1].error, r.ranks[1].error


# --- bad input: refused before any process starts ---------------------------------------------

def test_layout_the_model_cannot_take_is_refused():
    with pytest.raises(ModelError, match="heads 64 do not divide over tp 3"):
        _rehearse(SEED_RIG)


@pytest.mark.parametrize("text, msg", [
    ("sim:rtx-3080", "has no device to run on: use emu:rtx-3080@cpu"),
    ("emu:rtx-3080", "expected emu:NAME@DEV"),
    ("emu:rtx-3081@cpu", "did you mean 'rtx-3080'"),
    ("emu:rtx-3080@gpu0", "a rank runs on cpu or cuda:N"),
])
def test_bad_devices(text, msg):
    with pytest.raises(RehearseError, match=msg):
        devices.parse(text)


def test_emulated_device_decides_as_the_card_and_runs_on_dev():
    d = devices.parse("emu:rtx-3080@cpu")
    assert (d.decide, d.run, d.emulated) == ("sim:rtx-3080", "cpu", True)
    assert not devices.parse("cpu").emulated


@pytest.mark.parametrize("value", ["1:moe", "x:moe:wrong", "1:mo:wrong", "1:moe:slow"])
def test_bad_fault_values(value):
    with pytest.raises(RehearseError, match=FAULT_ENV):
        parse_fault(value)


def test_cli_bad_input_exits_2(monkeypatch, capsys):
    monkeypatch.setenv(FAULT_ENV, "nonsense")
    assert main(["rehearse", "--device", "cpu", "--model", "deepseek-v4-flash"]) == 2
    assert FAULT_ENV in capsys.readouterr().err
    monkeypatch.delenv(FAULT_ENV)
    assert main(["rehearse", "--device", "cpu,cpu", "--tp", "3", "--model", "deepseek-v4-flash"]) == 2
    assert main(["rehearse", "--device", "cpu", "--model", "deepseek-v4-flash", "--hidden", "100"]) == 2


# --- on a CUDA card (skipped without one) -----------------------------------------------------

@pytest.mark.gpu
def test_seed_rig_emulated_on_one_card():
    """The seed rig's cards as three processes on cuda:0 (gloo: the ranks share the card): the
    decisions are the cards', what cannot run on this card is a marked substitution."""
    r = _rehearse("emu:rtx-5090@cuda:0,emu:rtx-3080@cuda:0,emu:rtx-3080@cuda:0", TP3,
                  layers=2, prompt=8, steps=3, timeout=120)
    assert r.ok, r.cause
    assert r.backend == "gloo"
    for k in r.ranks:
        assert k.max_rel_err <= runner.LOGITS_REL_TOL
        for o in k.ops:
            assert o.ok and (o.substituted is None) == (o.decided == o.ran), o


@pytest.mark.gpu
def test_one_card_at_the_model_heads():
    # This machine's libraries decide: every chosen kernel is one that can run here.
    r = _rehearse("cuda:0", libs=None, layers=2, prompt=8, steps=3, timeout=120)
    assert r.ok, r.cause
    assert r.dims["heads"] == 64 and all(o.substituted is None for o in r.ranks[0].ops)


# --- emulated cards on a CUDA device: decisions, substitutions and the report (no GPU) -----------

@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_card_kernel_the_device_lacks_runs_the_cards_next_preference(one_rank_group):
    """An RTX 5090 emulated on an H200 (its facts simulated here): its SM120 kernels cannot run
    there, so the rank runs the card's next runnable preference, marked; every kernel that ran
    says what of the card's limits it does not take."""
    import capdispatch as cd
    from capdispatch.rehearse.rank import _bind_ops
    spec = cd.probe("sim:rtx-5090").with_id("emu:rtx-5090@cuda:0")
    plan = cd.agree(spec, group=None, libs="sglang-0.5.23",
                    shapes=cd.load_model("deepseek-v4-flash").for_rank(1, 1, False))
    bound = _bind_ops(0, plan, cd.probe("sim:h200"), True)
    dm = bound["decode_mla"]
    assert dm["decided"] == "flashinfer_sparse_mla" and dm["ran"] != dm["decided"]
    assert "lacks sm120_block_scaled_mma" in dm["substituted"]
    assert f"the card's next runnable preference {dm['ran']}" in dm["substituted"]
    card = list(plan.ops["decode_mla"].per_device.values())[0]
    names = [c.backend for c in card.candidates]
    assert names.index(dm["ran"]) > names.index(dm["decided"])     # a later preference of the card's own
    for e in bound.values():
        assert (e["substituted"] is None) == (e["decided"] == e["ran"]) and e["not_emulated"]
    assert _bind_ops(0, plan, cd.probe("sim:h200"), False)["moe"]["not_emulated"] is None


def test_report_shows_the_emulated_facts_and_what_is_not_emulated():
    from capdispatch.dispatch.rehearse_cmd import render
    from capdispatch.rehearse.runner import OpRun, RankRun, Rehearsal
    facts = dict(device="cuda:0", label="emu:rtx-3080@cuda:0", cc="8.6", sm_count=68,
                 smem_optin_per_block=101376, memory=10 * 2 ** 30, fp8=False, card="rtx-3080",
                 emulated=True, memory_cap=10 * 2 ** 30, note=None,
                 launches=[dict(kernel="k", config={}, shared=73728, fits=True),
                           dict(kernel="k", config={}, shared=120000, fits=False)])
    ops = (OpRun("moe", "flashinfer_cutlass_w4a8", "triton_w4a16", "flashinfer_cutlass_w4a8 cannot run on "
                 "cuda:0 (...): ran the card's next runnable preference triton_w4a16", 2, 0.01, True, "ok",
                 "compiled for the real card"),)
    r = Rehearsal("m", 1, 1, "gloo", dict(layers=1, hidden=256, vocab=512, heads=64, experts=8, experts_total=8,
                                          topk=6, intermediate=64), 1,
                  (RankRun(0, "emu:rtx-3080@cuda:0", "sim:rtx-3080", "cuda:0", True, None, ops, 0.0, facts=facts),),
                  True, 3e-2, None, 1.0)
    text = render(r)
    assert ("as rtx-3080 on cuda:0: launch tables of cc 8.6, 99 KB smem, 68 SMs, no fp8 (uint8 decode), "
            "memory capped at 10 GiB; 2 Triton kernel configurations checked against its shared memory "
            "(largest admitted 72 KB), 1 over it moved to a smaller tile") in text
    assert "moe (rank 0): flashinfer_cutlass_w4a8 cannot run on cuda:0" in text
    assert "not emulated" in text and "triton_w4a16 (rank 0): compiled for the real card" in text
    assert r.to_dict()["ranks"][0]["facts"]["sm_count"] == 68


# --- CUDA graphs: the plan on CPU; capture and replay on a card (gpu) ----------------------------

def test_graph_plan_follows_the_served_form():
    from capdispatch.backends import builtin
    from capdispatch.rehearse.graphs import graph_plan
    ops = builtin().ops
    cpu = graph_plan("cpu", True, None, 1, 1)
    assert not cpu.on and "runs on the CPU" in cpu.why and not cpu.in_graph(ops["decode_mla"], 1, True)
    assert "--no-graphs" in graph_plan("cuda:0", False, 10 * 2 ** 30, 3, 1).why
    gib10 = graph_plan("cuda:0", True, 10 * 2 ** 30, 3, 2)        # an RTX 3080 at tp 3: bound 8 x next_n 2
    assert gib10.on and gib10.capture_tokens == 16 and "capture bound 8" in gib10.why
    assert gib10.in_graph(ops["decode_mla"], 16, True) and not gib10.in_graph(ops["decode_mla"], 17, True)
    assert not gib10.in_graph(ops["decode_mla"], 1, False)          # prefill: eager
    assert not gib10.in_graph(ops["sparse_prefill"], 1, True)       # a prefill-served op: eager
    assert graph_plan("cuda:0", True, 141 * 2 ** 30, 1, 1).capture_tokens == 256


def test_cpu_ranks_say_they_ran_eagerly():
    from capdispatch.dispatch.rehearse_cmd import render
    from capdispatch.rehearse.runner import OpRun, RankRun, Rehearsal
    ops = (OpRun("moe", "torch", "torch", None, 2, 0.01, True, "ok"),)
    r = Rehearsal("m", 2, 1, "gloo", dict(layers=1, hidden=256, vocab=512, heads=32, experts=8, experts_total=8,
                                          topk=6, intermediate=64), 1,
                  tuple(RankRun(i, "cpu", "cpu", "cpu", True, None, ops, 0.0,
                                graphs="off: the rank runs on the CPU (no CUDA graphs), every call eager")
                        for i in range(2)), True, 3e-2, None, 1.0)
    assert "CUDA graphs: none on the CPU (ranks 0, 1): every call eager" in render(r)
    assert "graphed" not in render(r)


@pytest.mark.gpu
def test_decode_steps_replay_from_cuda_graphs_on_a_card():
    """cuda:0 alone and an emulated RTX 3080 on it: the decode steps' decode-served calls are
    captured once per layer and shape and replayed (each replay checked against the reference),
    prefill calls eager; --no-graphs runs them all eagerly."""
    for devs in ("cuda:0", "emu:rtx-3080@cuda:0"):
        r = _rehearse(devs, libs=None if devs == "cuda:0" else "sglang-0.5.23", layers=2, prompt=8, steps=3,
                      timeout=120)
        assert r.ok, r.cause
        k = r.ranks[0]
        assert "replayed from CUDA graphs" in k.graphs
        by = {o.op: o for o in k.ops}
        for op in ("decode_mla", "indexer", "moe", "kv_quant"):
            assert by[op].ok and by[op].graphed == 2 * 3, by[op]          # 2 layers x 3 decode steps
            assert 1 <= by[op].captures <= by[op].graphed
        assert by["decode_mla"].captures == 2            # one shape per layer: replayed with new inputs
        assert by["sparse_prefill"].graphed == 0 and by["kv_dequant"].graphed == 0
    eager = _rehearse("cuda:0", libs=None, graphs=False, **SMALL)
    assert eager.ok and all(o.graphed == 0 for o in eager.ranks[0].ops) and "--no-graphs" in eager.ranks[0].graphs


@pytest.mark.gpu
def test_an_emulated_card_launches_under_its_limits_on_a_card():
    """An RTX 3080 emulated on cuda:0: the rank's facts are the card's, its Triton launches are
    admitted under 99 KB, the indexer runs the uint8 codec (no fp8 on the card), and each kernel
    that ran says what is not emulated."""
    r = _rehearse("emu:rtx-3080@cuda:0", layers=1, prompt=8, steps=2, timeout=120)
    assert r.ok, r.cause
    k = r.ranks[0]
    f = k.facts
    assert (f["card"], f["sm_count"], f["smem_optin_per_block"], f["fp8"]) == ("rtx-3080", 68, 101376, False)
    assert f["memory_cap"] == 10 * 2 ** 30
    admitted = [x for x in f["launches"] if x["fits"]]
    assert admitted and all(x["shared"] is None or x["shared"] <= 101376 for x in admitted)
    by = {o.op: o for o in k.ops}
    assert by["indexer"].ran == "triton" and by["indexer"].ok      # the 3080's choice: uint8 decode
    assert all(o.not_emulated for o in k.ops)


def test_dp_attention_layout_matches_reference():
    """SGLang's DP attention at tp 2, ep 2: each rank its own sequence with the whole attention
    (64 heads), the MoE over both ranks' rows gathered, each rank against its own sequence."""
    r = _rehearse("cpu,cpu", dp_attention=True, ep=2, timeout=90, **SMALL)
    assert r.ok, r.cause
    assert r.dp_attention and r.dims["heads"] == 64 and r.dims["dp"] == 2 and r.dims["experts"] == 4
    for k in r.ranks:
        assert k.max_rel_err is not None and k.max_rel_err <= runner.LOGITS_REL_TOL
        assert all(o.ok and o.calls > 0 for o in k.ops)
    assert main(["rehearse", "--device", "cpu,cpu", "--model", "deepseek-v4-flash", "--dp-attention",
                 "--ep", "3"]) == 2


class _FakeCuda:
    """CudaGraphs' stand-in on the CPU: 'capture' runs FN once to allocate its outputs and
    keeps FN and the static inputs; 'replay' runs FN on them and writes into those outputs,
    as a replayed graph writes into the memory it captured."""

    def __init__(self):
        self.captured = 0

    def capture(self, fn, static):
        self.captured += 1
        out = fn(*[a.clone() if hasattr(a, "clone") else a for a in static])   # not into STATIC
        return (fn, static, out), out

    def replay(self, graph):
        fn, static, out = graph
        got = fn(*static)
        for o, g in zip(out if isinstance(out, tuple) else (out,), got if isinstance(got, tuple) else (got,)):
            if o is not None:
                o.copy_(g)

    def synchronize(self):
        pass


def test_graphs_capture_once_per_shape_and_replay_each_steps_inputs():
    import torch

    from capdispatch.rehearse.graphs import GraphCaptureError, Graphs

    def quant(k, pool, loc, page):        # writes into its input, as kv_quant does
        pool[loc] = k.sum(-1)

    def attn(q, lengths):
        return q * 2, lengths + 1

    fake = _FakeCuda()
    g = Graphs("cuda:0", cuda=fake)
    pool = torch.zeros(8)
    for step in range(3):
        k, loc = torch.full((1, 4), float(step + 1)), torch.tensor([step])
        e = g.call("kv_quant", 0, quant, (k, pool, loc, 64))
        spent = []
        assert g.replay(e, (k, pool, loc, 64), spent) is None and len(spent) == 1
        q = torch.randn(1, 3)
        e = g.call("decode_mla", 0, attn, (q, torch.tensor([step])))
        out, lens = g.replay(e, (q, torch.tensor([step])), [])
        assert torch.equal(out, q * 2) and int(lens) == step + 1          # this step's inputs
        kept = out.clone()
        g.replay(e, (q + 1, torch.tensor([0])), [])
        assert torch.equal(out, kept)                                      # outputs are copies
    assert pool[:3].tolist() == [4.0, 8.0, 12.0]                           # written back each step
    assert g.captures == {"kv_quant": 1, "decode_mla": 1} and g.replays == {"kv_quant": 3, "decode_mla": 3}
    g.call("decode_mla", 1, attn, (torch.randn(2, 3), torch.tensor([0, 1])))   # another layer, shape
    assert g.captures["decode_mla"] == 2 and fake.captured == 3

    def sync_in_kernel(x):
        raise RuntimeError("operation not permitted when stream is capturing")
    with pytest.raises(GraphCaptureError, match=r"indexer \(layer 0\) failed under CUDA-graph capture: "
                                                r"RuntimeError: operation not permitted"):
        g.call("indexer", 0, sync_in_kernel, (torch.zeros(1),))


# --- no process or folder outlives the rehearsal ----------------------------------------------

def _ranks_of(parent_pid: int) -> list:
    """Rank processes whose config names PARENT_PID (their command line names the config)."""
    import glob
    out = []
    for cmd in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            argv = Path(cmd).read_bytes().split(b"\0")
        except OSError:
            continue
        if b"capdispatch.rehearse.rank" in argv:
            try:
                cfg = json.loads(Path(argv[argv.index(b"capdispatch.rehearse.rank") + 1].decode()).read_text())
            except (OSError, ValueError, IndexError):
                continue
            if cfg.get("parent") == parent_pid:
                out.append(cmd)
    return out


def _sigint_default():
    # A test run started in the background (`cmd &`) inherits SIGINT ignored, and Python
    # keeps an inherited SIG_IGN; the rehearsal under test must get Ctrl-C as a terminal gives it.
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_hanging(tmp_path):
    import subprocess
    import sys
    env = dict(os.environ, **{FAULT_ENV: "0:kv_quant:hang", "TMPDIR": str(tmp_path)})
    p = subprocess.Popen([sys.executable, "-m", "capdispatch", "rehearse", "--device", "cpu,cpu",
                          "--model", "deepseek-v4-flash", "--layers", "1", "--prompt", "4", "--steps", "1",
                          "--timeout", "120", "--libs", "sglang-0.5.23"], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_sigint_default)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:        # until rank 0 is inside its hanging kernel
        if any("kv_quant" in f.read_text(errors="replace") for f in tmp_path.glob("*/rank0.progress")):
            return p
        time.sleep(0.2)
    p.kill()
    pytest.fail("the ranks never reached kv_quant")


def _gone(pid, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and _ranks_of(pid):
        time.sleep(0.1)
    return not _ranks_of(pid)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_signal_leaves_no_rank_and_no_folder(tmp_path, sig):
    import signal
    p = _start_hanging(tmp_path)
    assert _ranks_of(p.pid)
    p.send_signal(getattr(signal, sig))
    p.wait(timeout=30)
    assert _gone(p.pid)
    assert not list(tmp_path.glob("capdispatch-rehearse-*"))


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_sigkill_ranks_follow_and_the_next_run_cleans_the_folder(tmp_path, monkeypatch):
    import signal
    p = _start_hanging(tmp_path)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert _gone(p.pid)                          # each rank watches its parent
    left = list(tmp_path.glob("capdispatch-rehearse-*"))
    assert len(left) == 1
    keep = tmp_path / "capdispatch-rehearse-alive"   # a live owner's folder stays
    keep.mkdir()
    (keep / runner.OWNER_FILE).write_text(str(os.getpid()))
    monkeypatch.setattr(runner.tempfile, "gettempdir", lambda: str(tmp_path))
    runner._clean_stale_folders()
    assert not left[0].exists() and keep.exists()


@pytest.mark.parametrize("args, says", [
    (["--timeout", "inf"], "at most 86400"), (["--start-timeout", "nan"], "above 0"),
    (["--libs", "bogus"], "unknown library profile 'bogus'"), (["--hidden", "1000000"], "at most 2048"),
    (["--layers", "100000"], "at most 16"), (["--prompt", "10000000"], "at most 4096"),
    (["--steps", "0"], "at least 1"),
])
def test_bad_input_refused_before_any_rank_starts(capsys, args, says):
    t0 = time.monotonic()
    assert main(["rehearse", "--device", "cpu", "--model", "deepseek-v4-flash", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 10            # no rank was started


def test_cuda_device_without_cuda_is_bad_input(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["rehearse", "--device", "cuda:0", "--model", "deepseek-v4-flash"]) == 2
    assert "cuda:0 cannot run a rank here" in capsys.readouterr().err
