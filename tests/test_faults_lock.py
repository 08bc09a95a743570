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
        cd.check_lock(cd.plan(["sim:h200"], ["moe"], log_warnings=False), "")


def test_a_lock_without_devices_is_refused(tmp_path):
    p = tmp_path / "empty.lock"
    p.write_text("schema: 1\ndevices: []\n")
    with pytest.raises(cd.LockError, match=r"empty.lock:2: devices is empty"):
        cd.load_lock(p)


@pytest.mark.parametrize("devices", [["sim:rtx-3080", "sim:rtx-3080"], ["cpu", "cpu"],
                                     ["sim:h200", "sim:h200", "sim:rtx-3080"]])
def test_repeated_devices_round_trip(devices, tmp_path, capsys):
    path = tmp_path / "group.lock"
    assert cli.main(["lock", "--device", ",".join(devices), "--op", "moe", "-o", str(path)]) == 0
    ids = [d.id for d in cd.load_lock(path).devices]
    assert any("@" in i for i in ids)
    capsys.readouterr()
    assert cli.main(["lock", "--check", str(path)]) == 0, capsys.readouterr().err
    assert "match the lock" in capsys.readouterr().out
