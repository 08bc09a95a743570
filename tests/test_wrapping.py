"""Text wraps to the terminal's width, read when a command prints (100 columns when the
output is not a terminal), through one helper (render.wrap): explain, sglang plan, model."""
import io
import os

import pytest

from capdispatch.dispatch import cli, render


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_the_width_is_the_terminals_read_when_called(monkeypatch):
    assert render.terminal_width(io.StringIO()) == render.WIDTH           # piped: 100
    monkeypatch.setattr(render.shutil, "get_terminal_size", lambda fallback: os.terminal_size((72, 30)))
    assert render.terminal_width(_Tty()) == 72
    monkeypatch.setattr(render.shutil, "get_terminal_size", lambda fallback: os.terminal_size((10, 30)))
    assert render.terminal_width(_Tty()) == render.NARROWEST


def test_wrap_follows_the_terminal_and_keeps_a_url_whole(monkeypatch):
    monkeypatch.setattr(render, "terminal_width", lambda stream=None: 40)
    text = "word " * 30
    assert max(len(x) for x in render.wrap(text, "  ")) <= 40
    url = "https://example.com/" + "x" * 60
    assert render.wrap(f"see {url}", break_long=False)[1].strip() == url
    assert render.wrap_lines(["    " + text])[1].startswith("      word")


@pytest.fixture
def dispatch(capsys, clean_env):
    def run(*args):
        rc = cli.main(list(args))
        out, err = capsys.readouterr()
        return rc, out, err
    return run


def test_sglang_plan_rank_lines_wrap_under_their_reason(dispatch):
    rc, out, err = dispatch("sglang", "plan", "--device", "sim:rtx-5090,sim:rtx-3080")
    assert rc == 0, err
    lines = out.splitlines()
    assert max(len(x) for x in lines) <= 100
    rank = lines.index(next(x for x in lines if x.startswith("rank 0:")))
    moe = next(i for i in range(rank, len(lines)) if lines[i].lstrip().startswith("moe "))
    # The reason continues on the next line, indented under the op.
    assert lines[moe + 1].startswith("      ") and lines[moe + 1][6] != " "


def test_sglang_plan_wraps_to_a_narrow_terminal(dispatch, monkeypatch):
    monkeypatch.setattr(render, "terminal_width", lambda stream=None: 80)
    rc, out, _ = dispatch("sglang", "plan", "--device", "sim:rtx-5090,sim:rtx-3080")
    assert rc == 0 and max(len(x) for x in out.splitlines()) <= 80


def test_dispatch_model_wraps(dispatch, monkeypatch):
    for args in (["model"], ["model", "deepseek-v4-flash", "--tp", "8"]):
        rc, out, _ = dispatch(*args)
        assert rc == 0
        assert all(len(x) <= 100 or x.strip().startswith("https://") for x in out.splitlines()), out
    monkeypatch.setattr(render, "terminal_width", lambda stream=None: 60)
    rc, out, _ = dispatch("model", "deepseek-v4-flash", "--tp", "8")
    assert all(len(x) <= 60 or "https://" in x for x in out.splitlines()), out


def test_explain_traces_wrap_to_the_terminal(dispatch, monkeypatch):
    monkeypatch.setattr(render, "terminal_width", lambda stream=None: 70)
    rc, out, _ = dispatch("explain", "--device", "sim:rtx-3080", "--op", "kv_dequant")
    assert rc == 0 and max(len(x) for x in out.splitlines() if "source:" not in x) <= 70
