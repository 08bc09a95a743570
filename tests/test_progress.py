"""Progress on stderr: rich's bar on a terminal; plain lines otherwise, one per backend
`dispatch verify` finishes and one per change of the ranks' phases in `dispatch rehearse`;
never on stdout."""
import io
import types

from capdispatch.dispatch import progress, verify_cmd
from capdispatch.dispatch.progress import Progress, RanksWatch, rank_phase, ranks_line


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_without_a_terminal_one_line_per_item_and_per_changed_state():
    err = io.StringIO()
    with Progress("verifying", 2, stream=err) as p:
        p.update("cuda:0 kv_quant/triton_u8")           # a state alone is not a line
        p.advance("cuda:0 kv_quant/triton_u8: pass")
        p.advance("cuda:0 kv_quant/torch: pass (cached)")
    assert err.getvalue().splitlines() == ["verifying: [1/2] cuda:0 kv_quant/triton_u8: pass",
                                           "verifying: [2/2] cuda:0 kv_quant/torch: pass (cached)"]
    err = io.StringIO()
    p = Progress("rehearsing", stream=err)
    for text in ("a", "a", "b"):
        p.update(text, log=True)
    assert err.getvalue().splitlines() == ["rehearsing: a", "rehearsing: b"]


def test_on_a_terminal_rich_draws_a_transient_bar():
    err = _Tty()
    with Progress("verifying", 1, stream=err) as p:
        assert p.bar is not None
        p.advance("x: pass")
    assert "verifying: [1/1]" not in err.getvalue()


def test_ranks_phases_in_one_line():
    assert rank_phase("") == "starting"
    assert rank_phase("moe (layer 1, decode step 2)") == "decode step 2"
    assert rank_phase("indexer (layer 0, prefill)") == "prefill"
    assert rank_phase("joining the group") == "joining the group"
    states = ["moe (layer 1, decode step 2)", "kv_quant (layer 0, decode step 2)", "joining the group"]
    assert ranks_line(states, 3) == "3 rank(s): 2 decode step 2/3, 1 joining the group"


def test_rehearse_watch_prints_changes_and_closes():
    err = io.StringIO()
    w = RanksWatch(3, stream=err)
    w(["", ""])
    w(["starting", ""])                       # the same phases: no new line
    w(["building", "moe (layer 0, prefill)"])
    w(["", "moe (layer 0, prefill)"])         # a file read while rewritten: its rank as before
    w(["finished", "finished"])
    w(None)
    assert err.getvalue().splitlines() == [
        "rehearsing: 2 rank(s): 2 starting", "rehearsing: 2 rank(s): 1 building, 1 prefill",
        "rehearsing: 2 rank(s): 2 finished"]
    assert w.progress is None


def test_rehearse_passes_its_watch_to_the_runner(monkeypatch, capsys, clean_env):
    from capdispatch.dispatch import rehearse_cmd
    from capdispatch.rehearse import runner
    seen = {}

    def fake(devs, model, **kw):
        seen["cb"] = kw["on_progress"]
        kw["on_progress"](["joining the group", "moe (layer 0, decode step 1)"])
        kw["on_progress"](None)
        raise runner.RehearseError("stop here")
    monkeypatch.setattr(runner, "rehearse", fake)
    monkeypatch.setattr(rehearse_cmd, "planned", lambda *a, **k: types.SimpleNamespace(whose={}))
    monkeypatch.setattr("capdispatch.dispatch.inputs.needs_torch", lambda why: None)
    from capdispatch.dispatch import cli
    rc = cli.main(["rehearse", "--device", "cpu,cpu", "--model", "deepseek-v4-flash", "--format", "json"])
    out, err = capsys.readouterr()
    assert isinstance(seen["cb"], RanksWatch) and rc != 0
    assert "rehearsing: 2 rank(s): 1 joining the group, 1 decode step 1/3" in err
    assert "rehearsing" not in out


def test_verify_without_a_terminal_says_each_backend(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", err)
    job = types.SimpleNamespace(device=types.SimpleNamespace(id="cuda:0"), op="kv_quant", backend="triton_u8")
    verdict = types.SimpleNamespace(describe=lambda: "pass")
    with verify_cmd._Progress(2) as p:
        p.start(job)
        p.done(types.SimpleNamespace(job=job, verdict=verdict, cached=False))
        p.done(types.SimpleNamespace(job=job, verdict=None, cached=False))
    assert err.getvalue().splitlines() == [
        "verifying: [1/2] cuda:0 kv_quant/triton_u8: pass",
        "verifying: [2/2] cuda:0 kv_quant/triton_u8: not run (the time budget ran out)"]
