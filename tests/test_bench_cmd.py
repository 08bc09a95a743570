"""`dispatch bench`: timings -> buckets (merging, the noise band's stability law), and the
whole CPU path: runnable backends checked and timed, a policy written that the loader
takes, that `explain` shows and `bind` follows."""
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import capdispatch as cd
from capdispatch.calibrate import choose as C
from capdispatch.calibrate import ladder
from capdispatch.dispatch import bench_cmd, cli
from capdispatch.policies import load_file
from capdispatch.backends import builtin
from capdispatch.dispatch.resolver import known_device_names


# --------------------------------------------------------------------------- #
# Pure: choose and merge
# --------------------------------------------------------------------------- #
def test_merge_joins_adjacent_sizes_with_one_winner_and_the_last_run_is_the_catch_all():
    times = {1: {"a": 1.0, "b": 2.0}, 2: {"a": 1.0, "b": 3.0}, 4: {"a": 2.0, "b": 1.0},
             8: {"a": 3.0, "b": 1.0}, 16: {"a": 1.0, "b": 5.0}}
    runs = C.merge(C.choose(times, 0.05))
    assert [(r.upper, r.winner, r.order) for r in runs] == [(2, "a", ("a", "b")), (8, "b", ("b", "a")),
                                                           (None, "a", ("a", "b"))]
    assert [c.size for c in runs[1].choices] == [4, 8]


def test_an_incumbent_stays_inside_the_band_and_goes_outside_it():
    times = {1: {"a": 1.00, "b": 1.04}}
    assert C.choose(times, 0.05, lambda s: "b")[0].winner == "b"
    assert C.choose(times, 0.05, lambda s: "b")[0].kept
    assert C.choose(times, 0.03, lambda s: "b")[0].winner == "a"
    assert C.choose(times, 0.05)[0].winner == "a"
    with pytest.raises(ValueError, match="no backend was measured"):
        C.choose({1: {}}, 0.05)


BACKENDS = ("a", "b", "c")
_times = st.dictionaries(
    st.sampled_from((1, 2, 4, 8, 16, 32, 64)),
    st.fixed_dictionaries({b: st.floats(0.01, 100.0) for b in BACKENDS}), min_size=1)


def _buckets(runs):
    return [(r.upper, r.order) for r in runs]


def _lookup(runs):
    def first(size):
        for r in runs:
            if r.upper is None or size <= r.upper:
                return r.winner
    return first


@settings(max_examples=200, deadline=None)
@given(_times, st.floats(0.0, 0.3), st.data())
def test_rerunning_within_the_band_writes_the_same_buckets(times, noise, data):
    first = C.merge(C.choose(times, noise))
    # No adjacent runs share a winner; without an incumbent each size's winner is the fastest.
    assert all(a.winner != b.winner for a, b in zip(first, first[1:]))
    for run in first:
        for c in run.choices:
            assert c.times[c.winner] == min(c.times.values())
    # A re-measurement within a factor sqrt(1 + noise) of the first, per entry.
    f = math.sqrt(1 + noise)
    again = {s: {b: t * data.draw(st.floats(1 / f, f)) for b, t in row.items()} for s, row in times.items()}
    second = C.merge(C.choose(again, noise * (1 + 1e-9), _lookup(first)))
    assert [(r.upper, r.winner) for r in second] == [(r.upper, r.winner) for r in first]
    # Whoever wins a size is within the band of the fastest there.
    for run in second:
        for c in run.choices:
            assert c.times[c.winner] <= min(c.times.values()) * (1 + noise) * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(_times, st.floats(0.0, 0.3))
def test_a_backend_faster_by_more_than_the_band_replaces_the_incumbent(times, noise):
    first = C.merge(C.choose(times, noise))
    size = sorted(times)[0]
    loser = next(b for b in BACKENDS if b != _lookup(first)(size))
    again = {s: dict(row) for s, row in times.items()}
    again[size][loser] = min(again[size].values()) / (1 + noise) / 1.01
    second = C.merge(C.choose(again, noise, _lookup(first)))
    assert _lookup(second)(size) == loser


def test_sizes_are_checked():
    assert ladder.parse_sizes("1, 16,256") == (1, 16, 256)
    for bad, needle in [("1,x", "'x' is not a size"), ("0", "'0' is not a size"), ("16,4", "must ascend"),
                        ("4,4", "must ascend"), ("", "no sizes"), (" ", "no sizes"), (",", "empty entry"),
                        ("1,,2", "empty entry"), ("1,2,", "empty entry")]:
        with pytest.raises(ladder.SizesError, match=needle):
            ladder.parse_sizes(bad)


# --------------------------------------------------------------------------- #
# The command on the CPU
# --------------------------------------------------------------------------- #
def _args(*argv):
    return cli._parser().parse_args(["bench", *argv])


class FakeTimer:
    """Times from a table: backend -> size -> ms (scaled by FACTOR per backend); records graph flags."""
    describe = "a fake timer"

    def __init__(self, table, factor=None):
        self.table, self.factor, self.seen = table, factor or {}, []

    def __call__(self, fn, graph):
        self.seen.append((fn.op, fn.backend, fn.size, graph))
        return self.table[fn.backend](fn.size) * self.factor.get(fn.backend, 1.0)


# triton_u8 (under the interpreter) "wins" at <= 2 rows, torch above.
TABLE = {"triton_u8": lambda n: 1.0 + n, "torch": lambda n: 3.5}


def _bench(tmp_path, capsys, timer, policy, *extra):
    rc = bench_cmd.run(_args("--device", "cpu", "--op", "kv_dequant", "--sizes", "1,2,4",
                             "--write-policy", str(policy), *extra), timer=timer)
    out = capsys.readouterr().out
    return rc, out


def test_bench_writes_a_bucketed_policy_that_loads_explains_and_binds(clean_env, tmp_path, capsys):
    clean_env.setenv("TRITON_INTERPRET", "1")
    policy = tmp_path / "cpu.yaml"
    timer = FakeTimer(TABLE)
    rc, out = _bench(tmp_path, capsys, timer, policy)
    assert rc == 0, out
    assert {(b, s) for _, b, s, _ in timer.seen} == {(b, s) for b in ("torch", "triton_u8") for s in (1, 2, 4)}
    assert not any(g for *_, g in timer.seen)            # no CUDA graphs on the CPU
    assert "buckets: <=2: triton_u8; rest: torch" in out
    text = policy.read_text()
    assert '- match: {id: "cpu"}' in text
    assert "# rows 1: triton_u8 2 ms, torch 3.5 ms" in text
    # triton_fp8 cannot run on the CPU: unmeasured, so it keeps its default place (first).
    assert '- {rows: "<=2", prefer: [triton_u8, torch], unmeasured: [triton_fp8]}' in text
    assert "- {prefer: [torch, triton_u8], unmeasured: [triton_fp8]}" in text
    assert "measured_with: {" in text and "Served form: eager on the CPU" in text
    # the loader takes it; explain shows the buckets from it, with file:line
    pf = load_file(policy, builtin(), known_devices=known_device_names())
    m = pf.devices[0].ops["kv_dequant"]
    assert [(b.upper, b.backends) for b in m.buckets] == [(2, ("triton_u8", "torch")), (None, ("torch", "triton_u8"))]
    r = cd.resolve("kv_dequant", "cpu", policy=str(policy))
    assert [(b.upper, b.backend) for b in r.buckets] == [(2, "triton_u8"), (None, "torch")]
    assert r.buckets[0].source == f"{policy}:{m.buckets[0].line} (device id cpu)"
    from capdispatch.dispatch.explain import plan, render_text
    shown = render_text(plan(["cpu"], ["kv_dequant"], policy=str(policy)))
    assert f"rows <=2 -> triton_u8  # {policy}:{m.buckets[0].line} (device id cpu)" in shown
    fn = cd.bind("kv_dequant", "cpu", policy=str(policy))
    assert fn.buckets == ((2, "triton_u8"), (None, "torch"))
    # round trip: within the band nothing changes; beyond it the bucket moves
    first = [(b.upper, b.backends) for b in m.buckets]
    rc, _ = _bench(tmp_path, capsys, FakeTimer(TABLE, {"torch": 1.02}), policy)
    pf2 = load_file(policy, builtin(), known_devices=known_device_names())
    assert rc == 0 and [(b.upper, b.backends) for b in pf2.devices[0].ops["kv_dequant"].buckets] == first
    rc, _ = _bench(tmp_path, capsys, FakeTimer(TABLE, {"torch": 0.5}), policy)
    pf3 = load_file(policy, builtin(), known_devices=known_device_names())
    assert pf3.devices[0].ops["kv_dequant"].buckets == () and pf3.devices[0].ops["kv_dequant"].value[0] == "torch"


def test_bench_on_the_cpu_with_its_own_timer_and_json(clean_env, tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    rc = cli.main(["bench", "--device", "cpu", "--op", "kv_quant", "--sizes", "1,8",
                   "--write-policy", str(policy), "--format", "json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    obj = json.loads(out)
    rows = obj["ops"]["kv_quant"]["rows"]
    assert {(r["size"], r["backend"], r["ok"]) for r in rows} == {(1, "torch", True), (8, "torch", True)}
    assert all(r["ms"] > 0 for r in rows) and obj["timer"].startswith("CPU wall clock")
    assert "triton_u8" in obj["ops"]["kv_quant"]["skipped"]
    assert obj["ops"]["kv_quant"]["buckets"] == [{"rows": "any", "upper": None, "prefer": ["torch"]}]
    assert "\x1b[" not in err                             # no progress bar off a terminal
    rc = cli.main(["explain", "--device", "cpu", "--op", "kv_quant", "--policy", str(policy)])
    out, err = capsys.readouterr()
    assert rc == 0 and f"{policy}:" in out and "(device id cpu)" in out


@pytest.mark.parametrize("argv,needle", [
    (["--op", "kv_qaunt"], "did you mean 'kv_quant'"),
    (["--sizes", "4,2"], "must ascend"),
    (["--noise", "-1"], "--noise -1: expected a percentage from 0 to below 100"),
    (["--noise", "100"], "--noise 100: expected a percentage"),
    (["--device", "sim:h200"], "a simulated device cannot be timed"),
])
def test_bench_bad_input_is_exit_2(clean_env, capsys, argv, needle):
    args = ["bench", "--device", "cpu", *argv] if "--device" not in argv else ["bench", *argv]
    rc = cli.main(args)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err


def test_bench_refuses_to_overwrite_another_cards_calibration(clean_env, tmp_path, capsys):
    other = tmp_path / "h200.yaml"
    other.write_text('devices:\n  - match: {name: "h200", cc: "9.0"}\n    ops:\n      kv_quant: [torch]\n')
    with pytest.raises(cd.BadInput, match=r"another card \(name h200, cc 9.0, line 2\).*write to another file"):
        bench_cmd.run(_args("--device", "cpu", "--op", "kv_quant", "--sizes", "1",
                            "--write-policy", str(other)), timer=FakeTimer({"torch": lambda n: 1.0}))


def test_every_op_runs_the_cpu_path_at_a_small_size(clean_env, capsys):
    """Each op's inputs build on the CPU ("small" profile), its torch backend passes the
    check against the reference, and is timed; a backend whose output is wrong is not."""
    timer = FakeTimer({"torch": lambda n: 1.0})
    rc = bench_cmd.run(_args("--device", "cpu", "--sizes", "1", "--format", "json"), timer=timer)
    obj = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert set(obj["ops"]) == set(builtin().ops)
    for op, o in obj["ops"].items():
        assert [(r["backend"], r["ok"]) for r in o["rows"]] == [("torch", True)], (op, o["rows"])
    assert {op for op, *_ in timer.seen} == set(builtin().ops)


def test_a_wrong_backend_fails_its_check_and_is_left_out(clean_env):
    import torch
    from capdispatch.calibrate import measure
    from capdispatch.backends.kv_cache import reference as R
    prof = ladder.PROFILES["small"]
    gen = torch.Generator().manual_seed(1)

    def off_by_one(pool, ids, page_size, out=None):
        return R.kv_dequant(pool, (ids + 1) % (pool.shape[0] * page_size), page_size)

    def skips_a_row(k, pool, loc, page_size):
        R.kv_quant(k[1:], pool, loc[1:], page_size)
    rows = measure.measure("kv_dequant", (4,), {"torch": R.kv_dequant, "bad": off_by_one}, device="cpu",
                           platform="cpu", profile=prof, gen=gen, timer=lambda fn, g: 1.0)
    assert [(r.backend, r.ok, r.ms) for r in rows] == [("torch", True, 1.0), ("bad", False, None)]
    rows = measure.measure("kv_quant", (4,), {"torch": R.kv_quant, "bad": skips_a_row}, device="cpu",
                           platform="cpu", profile=prof, gen=gen, timer=lambda fn, g: 1.0)
    assert [(r.backend, r.ok) for r in rows] == [("torch", True), ("bad", False)]
    assert "pool bytes differ" in rows[1].detail
    assert measure.times_by_size(rows) == {4: {"torch": 1.0}}


def test_a_run_for_some_ops_keeps_the_others_with_their_times(clean_env, tmp_path, capsys):
    policy = tmp_path / "cpu.yaml"
    timer = FakeTimer({"torch": lambda n: 2.0})
    assert bench_cmd.run(_args("--device", "cpu", "--op", "kv_quant", "--sizes", "1",
                               "--write-policy", str(policy)), timer=timer) == 0
    assert bench_cmd.run(_args("--device", "cpu", "--op", "kv_dequant", "--sizes", "1",
                               "--write-policy", str(policy)), timer=timer) == 0
    text = policy.read_text()
    assert text.count("# rows 1: torch 2 ms") == 2
    assert text.index("      kv_dequant:") < text.index("      kv_quant:")
    pf = load_file(policy, builtin(), known_devices=known_device_names())
    assert set(pf.devices[0].ops) == {"kv_quant", "kv_dequant"}


def test_a_backend_that_cannot_be_timed_is_left_out_with_the_reason(clean_env):
    import torch
    from capdispatch.calibrate import measure
    from capdispatch.backends.kv_cache import reference as R

    def timer(fn, graph):
        if fn.backend == "uncapturable":
            raise RuntimeError("operation not permitted when stream is capturing")
        return 1.0
    rows = measure.measure("kv_dequant", (4,), {"torch": R.kv_dequant, "uncapturable": R.kv_dequant},
                           device="cpu", platform="cpu", profile=ladder.PROFILES["small"],
                           gen=torch.Generator().manual_seed(2), timer=timer)
    assert [(r.backend, r.ok) for r in rows] == [("torch", True), ("uncapturable", False)]
    assert rows[1].detail.startswith("failed while timing: RuntimeError: operation not permitted")


def test_rewriting_a_calibration_edited_to_hold_aliases_keeps_the_aliased_ops(clean_env, tmp_path, capsys):
    """A calibrated file edited by hand to share buckets through an anchor: a run for the op
    holding the anchor must not copy the other op's `*alias` line without it."""
    from capdispatch.calibrate import writer
    policy = tmp_path / "cpu.yaml"
    policy.write_text(f"{writer.MARK} on the CPU\nschema: 1\ndevices:\n  - match: {{id: \"cpu\"}}\n"
                      "    ops:\n      kv_quant: &pref\n        - {prefer: [torch]}\n      kv_dequant: *pref\n")
    assert bench_cmd.run(_args("--device", "cpu", "--op", "kv_quant", "--sizes", "1",
                               "--write-policy", str(policy)), timer=FakeTimer({"torch": lambda n: 2.0})) == 0
    text = policy.read_text()
    assert "*pref" not in text and "&pref" not in text, text
    pf = load_file(policy, builtin(), known_devices=known_device_names())
    assert set(pf.devices[0].ops) == {"kv_quant", "kv_dequant"}
    assert pf.devices[0].ops["kv_dequant"].value[0] == "torch"
