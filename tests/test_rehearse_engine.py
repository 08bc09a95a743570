"""`dispatch rehearse --engine sglang` on a CPU: the launch command as SGLang's own parsers
(0.5.23 and 0.5.17) read it, the plugin's on/off switch, and the whole run against a stand-in
server (tests/engine_standin.py) that speaks SGLang's HTTP subset and writes rank reports the
way the plugin does: readiness, a server that dies or hangs, cleanup on SIGTERM, and the
verdict failing closed on differing tokens or logprobs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import sglang_releases  # noqa: E402

from capdispatch.rehearse.engine import launch, runner, verdict  # noqa: E402
from capdispatch.rehearse.errors import RehearseError  # noqa: E402

STANDIN = (os.path.join(HERE, "engine_standin.py"),)
CONFIG = os.path.join(HERE, "rehearse", "v4-tp3", "config.json")


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(CONFIG, d / "config.json")
    return str(d)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAPDISPATCH_", "SGLANG_", "STANDIN_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def _run(ckpt, monkeypatch, *, tp=None, **extra):
    monkeypatch.setenv("CAPDISPATCH_SGLANG_DEVICES", "sim:h200")      # the cards predictions plan for
    kw = {k: extra.pop(k) for k in ("start_timeout", "timeout", "out") if k in extra}
    return runner.rehearse(ckpt, ["cuda:0"], tp=tp, prompt=32, steps=4, requests=2, server_cmd=STANDIN,
                           env=_env(**extra), **{"start_timeout": 30.0, "timeout": 10.0, **kw})


# ------------------------------------------------------------ SGLang's own parsers

PARSE = """
import json, sys
sys.path.insert(0, {here!r})
import sglang_prelude  # noqa
from sglang.srt.server_args import prepare_server_args
sa = prepare_server_args(json.loads(sys.argv[1]))
print("RESULT " + json.dumps({{k: getattr(sa, k) for k in ("model_path", "tp_size", "base_gpu_id", "port",
      "host", "skip_tokenizer_init", "disable_radix_cache", "random_seed", "device", "mem_fraction_static")}}))
"""


@pytest.mark.parametrize("release", sglang_releases.RELEASES)
def test_the_launch_command_is_accepted_by_sglangs_own_parser(release, tmp_path):
    if release != sglang_releases.INSTALLED and not os.path.isdir(
            os.path.join(sglang_releases.FOLDERS[release], "sglang")):
        pytest.skip(f"needs SGLang {release} in tests/.releases (the README's test command)")
    import sglang_fake_models as fake
    model = fake.write(str(tmp_path / "dsv4"), fake.DSV4)
    lp = launch.Launch(model, (2, 3), 30123, 7, ("--mem-fraction-static", "0.7"))
    env = sglang_releases.env(release, _env(SGLANG_PLUGINS=launch.NO_PLUGIN, HF_HUB_OFFLINE="1"))
    if release != sglang_releases.INSTALLED:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], ROOT])
    p = subprocess.run([sys.executable, "-c", PARSE.format(here=HERE), json.dumps(lp.argv())], env=env,
                       capture_output=True, text=True, timeout=300)
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    got = json.loads(lines[-1][7:])
    assert got == {"model_path": model, "tp_size": 2, "base_gpu_id": 2, "port": 30123, "host": "127.0.0.1",
                   "skip_tokenizer_init": True, "disable_radix_cache": True, "random_seed": 7, "device": "cuda",
                   "mem_fraction_static": 0.7}


# ------------------------------------------------------------ inputs

def test_the_plugin_switch_is_sglangs_allow_list():
    on = launch.environment({}, plugin=True, report_dir="/r", installed=["capdispatch", "other"])
    assert "SGLANG_PLUGINS" not in on and on["CAPDISPATCH_REPORT_DIR"] == "/r"
    off = launch.environment({}, plugin=False, report_dir="/r", installed=["capdispatch", "other"])
    assert off["SGLANG_PLUGINS"] == "other"
    assert launch.environment({}, plugin=False, report_dir="/r", installed=["capdispatch"])["SGLANG_PLUGINS"] \
        == launch.NO_PLUGIN
    user = {"SGLANG_PLUGINS": "mine"}
    assert launch.environment(user, plugin=True, report_dir="/r")["SGLANG_PLUGINS"] == "mine,capdispatch"
    assert launch.environment(user, plugin=False, report_dir="/r")["SGLANG_PLUGINS"] == "mine"


def test_devices_and_requests():
    assert launch.gpu_ids(["cuda:1"], 2) == (1, 2)
    assert launch.gpu_ids(["cuda:0,cuda:1"], None) == (0, 1)
    assert launch.ranks(["emu:rtx-3080@cuda:0"], 2) == ((0, "rtx-3080"), (1, "rtx-3080"))
    assert launch.ranks(["cuda:1,emu:rtx-3080@cuda:2"], None) == ((1, None), (2, "rtx-3080"))
    assert launch.devices_value(((1, None), (2, "rtx-3080"))) == "cuda:0,cuda:1,emu:rtx-3080@cuda:2"
    assert launch.devices_value(((0, None),)) is None
    for bad, words in ((["cuda:0,cuda:2"], "consecutive"), (["emu:rtx-3080@cpu"], "or emu:rtx-3080@cuda:N"),
                       (["cpu"], "CUDA devices"), (["sim:h200"], "no device to run on")):
        with pytest.raises(RehearseError, match=words):
            launch.gpu_ids(bad, None)
    a, b = launch.requests(0, 3, 40, 1000), launch.requests(0, 3, 40, 1000)
    assert a == b and len(a) == 3 and all(len(x) == 40 and all(3 <= t < 1000 for t in x) for x in a)
    assert launch.requests(1, 3, 40, 1000) != a


@pytest.mark.parametrize("argv, words", [
    (["--device", "cuda:0", "--layers", "3"], "--layers sizes the small model"),
    (["--device", "cuda:0", "--ep", "2"], "--ep sizes the small model"),
    (["--device", "cuda:0", "--no-graphs"], "--no-graphs is the small model's"),
    (["--device", "emu:rtx-3080@cpu"], "serves on CUDA devices; give cuda:N or emu:rtx-3080@cuda:N"),
    (["--device", "cuda:0", "--steps", "1"], "--steps 1: expected an integer from 2"),
    (["--device", "cuda:0", "--timeout", "0"], "--timeout 0: expected seconds above 0"),
    (["--device", "cuda:0", "--", "--port", "1"], "-- --port: dispatch rehearse sets --port itself"),
    (["--device", "cuda:0", "--", "--tp-size=2"], "use --tp"),
    (["--device", "cuda:0", "--off-from", "nowhere.json"], "--off-from nowhere.json: no such file"),
])
def test_bad_engine_flags_are_one_line(ckpt, argv, words):
    p = subprocess.run([sys.executable, "-m", "capdispatch", "rehearse", "--engine", "sglang", "--model", ckpt,
                        *argv], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], p.stderr


@pytest.mark.parametrize("argv, words", [
    (["--model", "deepseek-v4-flash", "--device", "cpu", "--port", "3000"], "--port is for --engine sglang"),
    (["--model", "deepseek-v4-flash", "--device", "cpu", "--off-from", "x.json"], "--off-from is for --engine sglang"),
    (["--model", "deepseek-v4-flash", "--device", "cpu", "--", "--x"], "arguments after -- go to SGLang"),
    (["--engine", "sglang", "--model", "deepseek-v4-flash", "--device", "cuda:0"], "serves a checkpoint folder"),
])
def test_flags_of_the_other_engine_are_one_line(argv, words):
    p = subprocess.run([sys.executable, "-m", "capdispatch", "rehearse", *argv], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and words in p.stderr, p.stderr


# ------------------------------------------------------------ comparison (fail closed)

def _reply(tokens, lps, top=None):
    return verdict.Reply(tuple(tokens), tuple(lps), tuple(top or ()), 0.1, 0.2)


def test_compare_fails_closed():
    a = _reply([5, 6, 7], [-0.1, -0.2, -0.3])
    assert verdict.compare(0, a, a, exact=True).ok
    b = _reply([5, 9, 7], [-0.1, -0.2, -0.3], [[(5, -0.1)], [(6, -0.2), (9, -0.21)], [(7, -0.3)]])
    assert not verdict.compare(0, b, a, exact=True).ok                       # kept kernels: any difference fails
    assert not verdict.compare(0, a, _reply([5, 6], [-0.1, -0.2]), exact=False).ok   # lengths differ
    assert not verdict.compare(0, a, _reply([5, 6, 7], []), exact=False).ok        # no logprobs: fails
    assert not verdict.compare(0, a, _reply([5, 6, 7], [-0.1, float("nan"), -0.3]), exact=False).ok
    assert not verdict.compare(0, a, _reply([5, 6, 7], [-0.1, -0.2 - 2 * verdict.LOGPROB_TOL, -0.3]),
                               exact=False).ok
    assert verdict.compare(0, _reply([5, 9, 1], [-0.1, -0.21, -9]), b, exact=False).ok is False   # 9 is off's pick
    near = verdict.compare(0, _reply([5, 6, 1], [-0.1, -0.2, -5]), b, exact=False)
    assert near.ok and near.first_diff == 1 and near.compared == 1
    far = verdict.compare(0, _reply([5, 8, 1], [-0.1, -0.2, -5]), b, exact=False)
    assert not far.ok and "no near tie" in far.detail


# ------------------------------------------------------------ the run against a stand-in server

def test_a_passing_run_reads_reports_compares_and_predicts(ckpt, monkeypatch, tmp_path):
    r = _run(ckpt, monkeypatch, tp=2, out=str(tmp_path / "out"))
    assert r.ok, r.cause
    assert r.tp == 2 and [k.gpu_id for k in r.on.reports] == [0, 1] and r.routed == ()
    assert len(r.comparisons) == 2 and all(c.exact and c.ok for c in r.comparisons)
    assert r.off.reports == () and r.off.ok and r.on.version == "0.0.0-standin" and r.settings_differ == ()
    assert dict(r.on.settings) == {"kv_cache_dtype": "fp8_e4m3", "moe_runner_backend": "auto"}
    m = {x.name: x for x in r.measures}
    assert m["weights after load"].measured == 5.0 and m["weights after load"].predicted > 0
    assert m["KV pool"].predicted is not None and m["decode TPOT (batch 1)"].measured > 0
    out = tmp_path / "out"
    d = json.loads((out / "engine-rehearsal.json").read_text())
    assert d["schema"] == verdict.SCHEMA and d["ok"] is True
    assert (out / "engine-rehearsal.txt").read_text().rstrip().splitlines()[-1].startswith("PASSED")
    assert {p.name for p in (out / "reports").iterdir()} == {os.path.basename(k.path) for k in r.on.reports}
    assert (out / "sglang-plugin-on.log").exists() and (out / "sglang-plugin-off.log").exists()
    assert r.on.command[:3] == ("python", STANDIN[0], "--model-path")


def test_a_decided_op_the_model_does_not_call_is_named(ckpt, monkeypatch, tmp_path):
    from capdispatch.rehearse.engine.render import render
    r = _run(ckpt, monkeypatch, STANDIN_EXTRA_OP="row_scale")
    assert r.ok, r.cause
    assert list(r.not_called) == ["row_scale"]
    assert "DeepseekV4ForCausalLM does not call op 'row_scale' (" in r.not_called["row_scale"]
    assert "not rehearsed: row_scale: DeepseekV4ForCausalLM does not call op 'row_scale'" in render(r)
    assert r.to_dict()["not_called"] == r.not_called
    assert _run(ckpt, monkeypatch).not_called == {}          # the declared ops alone: none named


def test_differing_tokens_fail_where_every_kernel_is_sglangs(ckpt, monkeypatch):
    r = _run(ckpt, monkeypatch, STANDIN_FLIP="2")
    assert not r.ok and "tokens differ at position 2" in r.cause


def test_routed_ops_compare_logprobs_within_tolerance(ckpt, monkeypatch):
    r = _run(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_FLIP="2")
    assert r.ok, r.cause
    assert r.routed == ("kv_dequant on rank 0 (triton_u8)",) and all(c.first_diff == 2 for c in r.comparisons)
    r = _run(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_SHIFT=str(2 * verdict.LOGPROB_TOL))
    assert not r.ok and "logprob differs" in r.cause
    r = _run(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_FAR="1")
    assert not r.ok and "no near tie" in r.cause


def _run_emulated(ckpt, monkeypatch, device="emu:rtx-3080@cuda:0", **extra):
    kw = {k: extra.pop(k) for k in ("out",) if k in extra}
    return runner.rehearse(ckpt, [device], prompt=32, steps=4, requests=2, server_cmd=STANDIN,
                           env=_env(**extra), start_timeout=30.0, timeout=10.0, **kw)


def test_an_emulated_rank_decides_as_its_card_and_is_compared_within_tolerance(ckpt, monkeypatch, tmp_path):
    """emu:rtx-3080@cuda:0: the plugin is given the emulation (CAPDISPATCH_SGLANG_DEVICES, read
    by the launch and every rank), its report must say it, the routed ops make the comparison
    one of logprob tolerance, and the time prediction (the card's) carries no bar."""
    from capdispatch.rehearse.engine.render import render
    monkeypatch.delenv("CAPDISPATCH_SGLANG_DEVICES", raising=False)
    r = _run_emulated(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_FLIP="2", out=str(tmp_path / "out"))
    assert r.ok, r.cause
    (k,) = r.on.reports
    assert (k.emulated["card"], k.emulated["on"]) == ("rtx-3080", "cuda:0")
    assert r.routed == ("kv_dequant on rank 0 (triton_u8)",) and not any(c.exact for c in r.comparisons)
    m = {x.name: x for x in r.measures}
    assert m["decode TPOT (batch 1)"].bound is None and "cuda:0 as rtx-3080" in m["decode TPOT (batch 1)"].note
    assert "emulated: decided as the stand-in rtx-3080 (cc 8.6) on cuda:0" in render(r)
    d = json.loads((tmp_path / "out" / "engine-rehearsal.json").read_text())
    assert d["on"]["reports"][0]["emulated"]["card"] == "rtx-3080"
    # the comparison stays one of tolerance: a logprob past it fails
    r = _run_emulated(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_SHIFT=str(2 * verdict.LOGPROB_TOL))
    assert not r.ok and "logprob differs" in r.cause


def test_an_emulation_the_report_does_not_carry_fails_naming_the_rank(ckpt, monkeypatch):
    monkeypatch.delenv("CAPDISPATCH_SGLANG_DEVICES", raising=False)
    r = _run_emulated(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_EMU="wrong")
    assert not r.ok and r.on.step == "rank reports"
    assert "rank 0 (cuda:0): asked to decide as emu:rtx-3080@cuda:0" in r.cause and "emu:rtx-5090@cuda:0" in r.cause
    r = _run_emulated(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_EMU="none")
    assert not r.ok and "says it decided as its own card" in r.cause
    r = _run_emulated(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_EMU="nofacts")
    assert not r.ok and "shows no launch facts of rtx-3080 installed on cuda:0" in r.cause
    # a real rank whose report says it emulated: the device list was not the rehearsal's
    r = _run_emulated(ckpt, monkeypatch, device="cuda:0", CAPDISPATCH_SGLANG_DEVICES="emu:rtx-3080@cuda:0")
    assert not r.ok and "asked to decide as cuda:0 itself" in r.cause


def test_an_emulation_the_plugin_refuses_at_launch_names_the_rank_and_the_step(ckpt, monkeypatch):
    monkeypatch.delenv("CAPDISPATCH_SGLANG_DEVICES", raising=False)
    r = _run_emulated(ckpt, monkeypatch, device="emu:rtx-5090@cuda:0", STANDIN_MODE="refuse")
    assert not r.ok and (r.on.step, r.on.rank) == ("start", 0) and r.off is None
    assert r.cause.startswith("plugin on, rank 0, start: rank 0 of SGLang exited (code 1) during start: "
                              "capdispatch.errors.Unsatisfiable: capdispatch: rank 0 (emu:rtx-5090@cuda:0): ")
    assert r.cause.endswith("emulate a card whose SGLang call sites are the device's")


def test_an_emulation_beside_a_device_list_of_the_users_is_refused(ckpt, monkeypatch):
    with pytest.raises(RehearseError, match="CAPDISPATCH_SGLANG_DEVICES=sim:h200 is set, but --device emulates"):
        _run_emulated(ckpt, monkeypatch, CAPDISPATCH_SGLANG_DEVICES="sim:h200")


def test_settings_the_plugin_set_make_the_comparison_one_of_tolerance(ckpt, monkeypatch):
    r = _run(ckpt, monkeypatch, STANDIN_KV_DTYPE="bfloat16")
    assert r.ok, r.cause
    assert r.settings_differ == ("kv_cache_dtype: 'bfloat16' with the plugin, 'fp8_e4m3' without",)
    assert r.routed == () and not any(c.exact for c in r.comparisons)
    r = _run(ckpt, monkeypatch, STANDIN_KV_DTYPE="bfloat16", STANDIN_SHIFT=str(2 * verdict.LOGPROB_TOL))
    assert not r.ok and "logprob differs" in r.cause


def test_missing_or_leaked_reports_fail(ckpt, monkeypatch):
    r = _run(ckpt, monkeypatch, STANDIN_NO_REPORT="1")
    assert not r.ok and "rank 0 (cuda:0) wrote no report" in r.cause and r.off is None
    r = _run(ckpt, monkeypatch, STANDIN_ALWAYS_REPORT="1")
    assert not r.ok and "plugin-off run wrote rank reports" in r.cause


def test_a_server_that_dies_at_start_is_named_at_once(ckpt, monkeypatch):
    t = time.monotonic()
    r = _run(ckpt, monkeypatch, STANDIN_MODE="die")
    assert time.monotonic() - t < 20
    assert not r.ok and r.on.step == "start" and r.on.rank == 0
    assert "rank 0, start: rank 0 of SGLang exited (code 1)" in r.cause and "stand-in fails at start" in r.on.error
    # the release that failed to start is still named: the one this interpreter has
    import importlib.metadata
    assert r.on.version == importlib.metadata.version("sglang")


def test_a_server_that_dies_in_a_request_is_named(ckpt, monkeypatch):
    r = _run(ckpt, monkeypatch, STANDIN_MODE="crash")
    assert not r.ok and r.on.step == "warm-up request" and "crashes in a forward" in r.on.error
    # what the rank decided and installed before the failure is still read and reported
    assert len(r.on.reports) == 1


def test_a_server_that_never_gets_ready_is_bounded_and_stopped(ckpt, monkeypatch, tmp_path):
    pids = tmp_path / "pids"
    t = time.monotonic()
    r = _run(ckpt, monkeypatch, STANDIN_MODE="hang", STANDIN_PIDS=str(pids), start_timeout=2.0)
    assert time.monotonic() - t < 30
    assert not r.ok and "not ready within --start-timeout 2" in r.cause
    _assert_gone(pids)


def _assert_gone(pids):
    for pid in map(int, pids.read_text().split()):
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"process {pid} of the server outlived the run")


DRIVER = """
import sys
from capdispatch.rehearse.engine import runner
try:
    runner.rehearse(sys.argv[1], ["cuda:0"], prompt=32, steps=4, requests=2, server_cmd=(sys.argv[2],),
                    start_timeout=300.0)
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_sigterm_stops_the_server_and_removes_the_folder(ckpt, tmp_path):
    pids = tmp_path / "pids"
    p = subprocess.Popen([sys.executable, "-c", DRIVER, ckpt, STANDIN[0]],
                         env=_env(STANDIN_MODE="hang", STANDIN_PIDS=str(pids)))
    for _ in range(200):
        if pids.exists() and pids.read_text().strip():
            break
        time.sleep(0.1)
    folders = [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(runner_prefix())]
    mine = [n for n in folders if _owner(n) == p.pid]
    assert mine, "the run's folder was not found"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 130
    _assert_gone(pids)
    assert not any(os.path.exists(os.path.join(tempfile.gettempdir(), n)) for n in mine)


def runner_prefix():
    from capdispatch.rehearse import runner as small
    return small.FOLDER_PREFIX


def _owner(name):
    from capdispatch.rehearse import runner as small
    try:
        return int(open(os.path.join(tempfile.gettempdir(), name, small.OWNER_FILE)).read())
    except (OSError, ValueError):
        return None


def test_the_weights_predicted_are_those_sglang_loads_without_speculative_decoding(ckpt, monkeypatch):
    """SGLang loads the MTP (next-n) layers only for speculative decoding: without a
    --speculative-* argument the prediction plans one token a step and no MTP weights (an
    H100 run of 0.5.17 loaded 16.40 GiB of a checkpoint whose MTP layer is 3.35 GiB)."""
    from capdispatch.models import load_model
    assert runner.next_n_of(("--mem-fraction-static", "0.8")) == 1
    assert runner.next_n_of(("--speculative-algorithm", "EAGLE")) is None
    monkeypatch.setenv("CAPDISPATCH_SGLANG_DEVICES", "sim:h200")
    shape = load_model(ckpt)
    assert shape.mtp >= 1
    plain = runner._plan(shape, [0], None)[1].ranks[0].memory.weight_bytes
    spec = runner._plan(shape, [0], None, next_n=runner.next_n_of(("--speculative-algorithm", "EAGLE")))[1]
    assert spec.ranks[0].memory.weight_bytes > plain


# ------------------------------------------------------------ the reference run: whose kernel is off

def _shifted(r, x):
    return _reply(r.tokens, [v + x for v in r.logprobs], r.top)


def test_a_logprob_miss_is_judged_by_the_distance_from_the_torch_references():
    on = _reply([5, 6, 7], [-0.1, -0.2, -0.3])
    off = _shifted(on, 0.2)
    assert not verdict.compare(0, on, off, exact=False).ok                  # no reference: the bar alone
    same_as_on = verdict.compare(0, on, off, exact=False, ref=on)
    assert same_as_on.ok and same_as_on.from_ref_on == 0 and abs(same_as_on.from_ref_off - 0.2) < 1e-9
    same_as_off = verdict.compare(0, on, off, exact=False, ref=off)
    assert not same_as_off.ok and "from the ops' torch references where SGLang's own are 0" in same_as_off.detail
    halfway = verdict.compare(0, on, off, exact=False, ref=_shifted(on, 0.1))
    assert halfway.ok, halfway.detail                          # 0.1 from it, as SGLang's own: within 1.5 x
    nearer_off = verdict.compare(0, on, off, exact=False, ref=_shifted(on, 0.16))
    assert not nearer_off.ok                                   # 0.16 where SGLang's are 0.04: past 1.5 x and tol
    # The reference's first token is another: nothing to judge by.
    other = verdict.compare(0, on, off, exact=False, ref=_reply([9, 6, 7], [-0.1, -0.2, -0.3]))
    assert not other.ok and "gives no finite logprob of the same token" in other.detail
    # Past the positions the reference agrees on, the bar holds again.
    part = verdict.compare(0, on, off, exact=False, ref=_reply([5, 9, 7], [-0.1, -0.2, -0.3]))
    assert not part.ok and "past the 1 position(s) the reference run agrees on" in part.detail
    # A miss with kept kernels is never excused by a reference.
    assert not verdict.compare(0, on, off, exact=True, ref=on).ok


def test_the_reference_selection_keeps_the_users_other_choices():
    assert verdict.reference_set(None, ("moe", "indexer")) == "moe=torch,indexer=torch"
    assert verdict.reference_set("moe=triton_w4a16, kv_dequant=triton_u8", ("kv_dequant",)) == \
        "moe=triton_w4a16,kv_dequant=torch"


def _starts(path):
    return [json.loads(x) for x in open(path).read().splitlines()]


def test_routed_kernels_as_close_to_the_references_as_sglangs_pass(ckpt, monkeypatch, tmp_path):
    starts = tmp_path / "starts"
    out = tmp_path / "out"
    shift = str(2 * verdict.LOGPROB_TOL)
    r = _run(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_SHIFT=shift, STANDIN_REF_SHIFT=shift,
             STANDIN_ARGS=str(starts), out=str(out))
    assert r.ok, r.cause
    assert r.reference is not None and r.reference.ok and r.reference_ops == ("kv_dequant",)
    assert all(c.from_ref_on == 0 and c.from_ref_off > verdict.LOGPROB_TOL for c in r.comparisons)
    s = _starts(starts)
    assert len(s) == 3 and s[2]["set"] == "kv_dequant=torch" and "--disable-cuda-graph" in s[2]["argv"]
    assert "--disable-cuda-graph" not in s[0]["argv"] and s[0]["set"] is None
    assert (out / "sglang-reference.log").exists() and any((out / "reports-reference").iterdir())
    from capdispatch.rehearse.engine.render import render
    text = render(r)
    assert "reference (kv_dequant on their torch references): ok" in text
    assert "as far from the ops' torch references" in text and text.splitlines()[-1].startswith("PASSED")
    assert json.loads((out / "engine-rehearsal.json").read_text())["reference"]["reference"] is True


def test_routed_kernels_further_from_the_references_than_sglangs_fail(ckpt, monkeypatch, tmp_path):
    r = _run(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_SHIFT=str(2 * verdict.LOGPROB_TOL))
    assert not r.ok and r.reference is not None and "from the ops' torch references" in r.cause


def test_a_reference_run_that_keeps_the_routed_kernel_fails_closed(ckpt, monkeypatch):
    shift = str(2 * verdict.LOGPROB_TOL)
    r = _run(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_SHIFT=shift, STANDIN_REF_SHIFT=shift,
             STANDIN_REF_IGNORED="1")
    assert not r.ok and "did not route kv_dequant to its torch reference (its report: triton_u8, routed)" in r.cause


def test_no_reference_run_where_the_logprobs_agree_or_every_kernel_is_sglangs(ckpt, monkeypatch, tmp_path):
    starts = tmp_path / "starts"
    r = _run(ckpt, monkeypatch, STANDIN_ROUTED="1", STANDIN_FLIP="2", STANDIN_ARGS=str(starts))
    assert r.ok and r.reference is None and len(_starts(starts)) == 2
    starts.unlink()
    r = _run(ckpt, monkeypatch, STANDIN_SHIFT=str(2 * verdict.LOGPROB_TOL), STANDIN_ARGS=str(starts))
    assert not r.ok and r.reference is None and len(_starts(starts)) == 2


# ------------------------------------------------------------ a plugin-off run kept for the same launch

def test_a_plugin_off_run_is_kept_for_the_same_launch_only(ckpt, monkeypatch, tmp_path):
    """--off-from: an emulated rehearsal compares against the earlier rehearsal's plugin-off
    run (SGLang alone: the emulation is the plugin's) without starting one; a launch that
    differs in anything SGLang sees is refused before any start, naming what differs."""
    from capdispatch.rehearse.engine.render import render
    starts, out = tmp_path / "starts", tmp_path / "first"
    first = _run(ckpt, monkeypatch, STANDIN_ARGS=str(starts), out=str(out))
    assert first.ok, first.cause
    kept = str(out / "engine-rehearsal.json")
    assert json.loads(open(kept).read())["off_key"]["checkpoint"][0][0] == "config.json"
    monkeypatch.delenv("CAPDISPATCH_SGLANG_DEVICES", raising=False)

    def again(device="emu:rtx-3080@cuda:0", steps=4, **extra):
        return runner.rehearse(ckpt, [device], prompt=32, steps=steps, requests=2, server_cmd=STANDIN,
                               env=_env(STANDIN_ARGS=str(starts), **extra), start_timeout=30.0, timeout=10.0,
                               off_from=kept)
    r = again(CAPDISPATCH_SET="moe=torch")       # the plugin's own variables do not reach SGLang alone
    assert r.ok, r.cause
    assert len(_starts(starts)) == 3 and _starts(starts)[2]["set"] == "moe=torch"   # the plugin-on run alone
    assert r.off.kept_from == kept and r.off.replies == first.off.replies and r.on.reports[0].emulated
    assert f"plugin off: ok, ready in" in render(r) and f"kept from {kept}" in render(r)
    assert r.to_dict()["off"]["kept_from"] == kept and r.to_dict()["off_key"] == first.to_dict()["off_key"]
    for kw, words in ((dict(STANDIN_KV_DTYPE="bf16"), "the environment (STANDIN_KV_DTYPE)"),
                      (dict(steps=5), "the requests (--seed, --prompt, --steps, --requests)")):
        with pytest.raises(RehearseError, match=r"its plugin-off run was another launch: ") as e:
            again(**kw)
        assert words in str(e.value) and len(str(e.value).splitlines()) == 1
    with open(os.path.join(ckpt, ".lock"), "w") as fh:          # what a run may leave there changes no answer
        fh.write("x")
    assert again().ok
    with open(os.path.join(ckpt, "config.json"), "a") as fh:
        fh.write("\n")
    with pytest.raises(RehearseError, match=r"the checkpoint's files \(config.json\)"):
        again()
    assert len(_starts(starts)) == 4             # nothing started for a refused launch


def test_an_off_from_file_that_cannot_serve_is_one_line(ckpt, monkeypatch, tmp_path):
    def with_file(text):
        f = tmp_path / "kept.json"
        f.write_text(text)
        with pytest.raises(RehearseError) as e:
            runner.rehearse(ckpt, ["cuda:0"], prompt=32, steps=4, requests=2, server_cmd=STANDIN, env=_env(),
                            start_timeout=30.0, timeout=10.0, off_from=str(f))
        assert len(str(e.value).splitlines()) == 1 and str(e.value).startswith(f"--off-from {f}: ")
        return str(e.value)
    assert "cannot be read as JSON" in with_file("{")
    assert "expected capdispatch.rehearse-engine/1" in with_file('{"schema": "other"}')
    assert "has no plugin-off run" in with_file(json.dumps({"schema": verdict.SCHEMA, "off": None}))
    assert "its plugin-off run failed (start: died)" in with_file(
        json.dumps({"schema": verdict.SCHEMA, "off": {"ok": False, "error": "start: died"}}))
    assert "records no launch key" in with_file(json.dumps({"schema": verdict.SCHEMA, "off": {"ok": True}}))
