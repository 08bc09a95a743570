"""Fault injection: lock files that would mean nothing (empty names, no devices) and
locks of repeated devices, which must read back as they were written."""
from __future__ import annotations

import pytest

import capdispatch as cd
from capdispatch.dispatch import cli


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", "CAPDISPATCH_LOCK"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("argv,needle", [
    (["lock", "--check", ""], "--check: an empty file name"),
    (["lock", "--check", "  "], "--check: an empty file name"),
    (["lock", "-o", ""], "-o/--output: an empty file name"),
    (["explain", "--device", "sim:h200", "--lock", ""], "--lock: an empty file name"),
    (["verify", "--device", "cpu", "--op", "kv_dequant", "--lock", ""], "--lock: an empty file name"),
])
def test_empty_names_are_refused(argv, needle, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert needle in err and out == ""          # nothing written to stdout: no lock, no plan


def test_verify_lock_empty_is_refused():
    with pytest.raises(cd.BadInput, match="--lock: an empty file name"):
        cd.lock.check(cd.plan(["sim:h200"], ["moe"], log_warnings=False), "")


def test_a_lock_without_devices_is_refused(tmp_path):
    p = tmp_path / "empty.lock"
    p.write_text("schema: 1\ndevices: []\n")
    with pytest.raises(cd.LockError, match=r"empty.lock:2: devices is empty"):
        cd.lock.load(p)


@pytest.mark.parametrize("devices", [["sim:rtx-3080", "sim:rtx-3080"], ["cpu", "cpu"],
                                     ["sim:h200", "sim:h200", "sim:rtx-3080"]])
def test_repeated_devices_round_trip(devices, tmp_path, capsys):
    path = tmp_path / "group.lock"
    assert cli.main(["lock", "--device", ",".join(devices), "--op", "moe", "-o", str(path)]) == 0
    ids = [d.id for d in cd.lock.load(path).devices]
    assert any("@" in i for i in ids)
    capsys.readouterr()
    assert cli.main(["lock", "--check", str(path)]) == 0, capsys.readouterr().err
    assert "match the lock" in capsys.readouterr().out


HOSTILE = "\x1b[31mred\u202eevil\x07"       # an escape sequence, a right-to-left override, a bell


def _clean(text: str) -> bool:
    return not any(c in text for c in "\x1b\u202e\x07")


def test_control_and_bidi_characters_in_lock_paths_are_escaped(tmp_path, capsys):
    missing = str(tmp_path / f"{HOSTILE}.lock")
    assert cli.main(["explain", "--device", "sim:h200", "--op", "moe", "--lock", missing]) == 2
    err = capsys.readouterr().err
    assert _clean(err) and "\\x1b[31mred\\u202eevil\\x07.lock: no such lock file" in err, err
    written = str(tmp_path / f"{HOSTILE}w.lock")
    assert cli.main(["lock", "--device", "sim:h200", "--op", "moe", "-o", written]) == 0
    err = capsys.readouterr().err
    assert _clean(err) and "wrote " in err and "\\u202e" in err, err
    assert cli.main(["lock", "--check", written]) == 0
    out = capsys.readouterr().out
    assert _clean(out) and "match the lock" in out, out
    bad = tmp_path / f"{HOSTILE}bad.lock"
    bad.write_text("schema: 1\n")
    with pytest.raises(cd.LockError) as exc:
        cd.lock.load(str(bad))
    assert _clean(str(exc.value)) and "bad.lock:1: missing 'devices'" in str(exc.value)


def test_a_huge_capdispatch_lock_value_is_cut_in_the_message(monkeypatch, capsys):
    monkeypatch.setenv("CAPDISPATCH_LOCK", "/nonexistent/" + "x" * 120_000)
    assert cli.main(["explain", "--device", "sim:h200", "--op", "moe"]) == 2
    err = capsys.readouterr().err
    assert len(err) < 1000 and "(120013 characters)" in err and "no such lock file" in err, err[:500]
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind", ["fifo", "dir", "malformed", "fifo from CAPDISPATCH_LOCK"])
def test_verify_refuses_a_lock_it_cannot_read_before_any_canary(kind, tmp_path, monkeypatch, capsys):
    """A FIFO (never opened blocking), a directory or a malformed lock is exit 2 before
    the first canary runs, not after every canary has."""
    import os
    from capdispatch.dispatch import verify
    from faults_util import bounded
    path = tmp_path / "the.lock"
    if kind.startswith("fifo"):
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    else:
        path.write_text("schema: 1\ndevices: [\n")
    ran = []
    monkeypatch.setattr(verify, "run", lambda *a, **kw: ran.append(a) or [])
    argv = ["verify", "--device", "cpu", "--op", "kv_dequant"]
    if "CAPDISPATCH_LOCK" in kind:
        monkeypatch.setenv("CAPDISPATCH_LOCK", str(path))
    else:
        argv += ["--lock", str(path)]
    r = bounded(lambda: cli.main(argv), 20)
    assert r.get("value") == 2, r
    err = capsys.readouterr().err
    assert err.startswith(f"dispatch: error: {path}") and len(err.strip().splitlines()) == 1, err
    assert {"fifo": "it is a FIFO", "dir": "it is a directory", "malformed": "malformed YAML"}[kind.split()[0]] in err
    assert ran == []
