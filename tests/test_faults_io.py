"""Fault injection: special files given as inputs and outputs, alias bombs.

Every case asserts a bounded time, a named error (one of capdispatch's, exit 2 from the
command line) and that nothing was replaced. A FIFO nobody writes hangs a reader that
opens it blocking; a symbolic link to a device stands in for the device itself (renaming
over the link would replace the link, not the device, so the test cannot damage it).
"""
from __future__ import annotations

import os
import stat
import threading

import pytest

import capdispatch as cd
from capdispatch import extend
from capdispatch import safe_io
from capdispatch.dispatch import cli

from faults_util import bounded

SIM = "sim:h200"


@pytest.fixture
def specials(tmp_path):
    """name -> path of a FIFO, a directory, a link to a device, a link to a FIFO."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dir").mkdir()
    (tmp_path / "to-null").symlink_to("/dev/null")
    (tmp_path / "to-zero").symlink_to("/dev/zero")
    (tmp_path / "to-fifo").symlink_to(fifo)
    return {n: tmp_path / n for n in ("fifo", "dir", "to-null", "to-zero", "to-fifo")}


def _kind(path) -> int:
    return os.lstat(path).st_mode


# --------------------------------------------------------------------------- #
# Readers
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", ["fifo", "dir", "to-null", "to-zero", "to-fifo"])
def test_readers_refuse_special_files_at_once(specials, name, monkeypatch):
    path = str(specials[name])
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_LOCK", "CAPDISPATCH_SET"):
        monkeypatch.delenv(k, raising=False)
    cases = {
        "--policy": lambda: cd.resolve("moe", SIM, policy=path),
        "load_lock": lambda: cd.lock.load(path),
        "read_file": lambda: extend.read_bytes(path, limit=1 << 20),
    }
    for what, fn in cases.items():
        r = bounded(fn)
        assert r["seconds"] < 5, what
        err = r.get("error")
        assert isinstance(err, cd.CapdispatchError), (what, err)
        assert path in str(err) and ("not a regular file" in str(err) or "directory" in str(err)), str(err)


def test_policy_env_and_lock_env_fifo_exit_2(specials, capsys, monkeypatch):
    fifo = str(specials["fifo"])
    monkeypatch.setenv("CAPDISPATCH_POLICY", fifo)
    r = bounded(lambda: cli.main(["explain", "--device", SIM, "--op", "moe"]))
    assert r["value"] == 2 and "FIFO" in capsys.readouterr().err
    monkeypatch.delenv("CAPDISPATCH_POLICY")
    monkeypatch.setenv("CAPDISPATCH_LOCK", fifo)
    r = bounded(lambda: cli.main(["explain", "--device", SIM, "--op", "moe"]))
    assert r["value"] == 2 and "FIFO" in capsys.readouterr().err
    monkeypatch.delenv("CAPDISPATCH_LOCK")
    for argv in (["policy", "validate", fifo], ["lock", "--check", fifo, "--device", SIM]):
        r = bounded(lambda: cli.main(argv))
        assert r["value"] == 2, argv
        assert "FIFO (named pipe), not a regular file" in capsys.readouterr().err


def test_reader_size_bound(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (2 << 20))
    with pytest.raises(cd.PolicyError, match="larger than 1024 KiB"):
        cd.resolve("moe", SIM, policy=str(big))
    with pytest.raises(safe_io.FileError, match="larger than 1 KiB"):
        safe_io.read_bytes(big, limit=1024)


def test_knob_map_reader_refuses_a_fifo(specials):
    from capdispatch.adapters.sglang import knobs
    r = bounded(lambda: knobs.load(str(specials["fifo"])))
    assert isinstance(r.get("error"), knobs.KnobsError) and "FIFO" in str(r["error"])


def test_load_marked_alias_bomb_is_bounded():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    r = bounded(lambda: extend.load_marked("\n".join(lines), "bomb.yaml"), 10)
    assert r["seconds"] < 5
    assert isinstance(r.get("error"), cd.PolicyError) and "aliases are expanded" in str(r["error"])
    # ordinary aliases still work
    assert extend.load_marked("a: &x [1, 2]\nb: *x\n", "ok.yaml") == {"a": [1, 2], "b": [1, 2]}


# --------------------------------------------------------------------------- #
# Writers
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("name", ["fifo", "dir", "to-null", "to-fifo"])
def test_lock_output_refuses_special_files_and_replaces_nothing(specials, name, capsys):
    path = specials[name]
    before = _kind(path), os.stat(path).st_mode
    r = bounded(lambda: cli.main(["lock", "--device", SIM, "--op", "moe", "-o", str(path)]))
    assert r["value"] == 2
    err = capsys.readouterr().err
    assert "cannot write" in err and "regular file" in err, err
    assert (_kind(path), os.stat(path).st_mode) == before           # the same kind of file, untouched
    assert not [p for p in os.listdir(path.parent) if p.endswith(".part")]   # no temporary left


def test_lock_output_keeps_mode_and_link(tmp_path, capsys):
    real = tmp_path / "real.lock"
    real.write_text("old\n")
    os.chmod(real, 0o640)
    link = tmp_path / "link.lock"
    link.symlink_to(real)
    assert cli.main(["lock", "--device", SIM, "--op", "moe", "-o", str(link)]) == 0
    assert os.path.islink(link) and stat.S_IMODE(os.stat(real).st_mode) == 0o640
    assert cd.lock.load(link).devices[0].id == SIM
    assert sorted(os.listdir(tmp_path)) == ["link.lock", "real.lock"]
    new = tmp_path / "new.lock"
    assert cli.main(["lock", "--device", SIM, "--op", "moe", "-o", str(new)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o666 & ~umask
    capsys.readouterr()
    assert cli.main(["lock", "--device", SIM, "--op", "moe", "-o", "-"]) == 0
    assert capsys.readouterr().out.startswith("# capdispatch lock file")


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "keep.lock"
    path.write_text("old\n")

    def boom(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(safe_io.FileError, match="No space left"):
        safe_io.write_atomic(path, "new\n")
    assert path.read_text() == "old\n" and os.listdir(tmp_path) == ["keep.lock"]


def test_bench_write_policy_refuses_special_files_before_measuring(specials, capsys):
    calls = []
    for name in ("fifo", "dir", "to-null"):
        path = specials[name]
        before = _kind(path)
        r = bounded(lambda: cli.main(["bench", "--device", "cpu", "--op", "kv_quant", "--sizes", "1",
                                      "--write-policy", str(path)]))
        assert r["value"] == 2, name
        assert "--write-policy" in capsys.readouterr().err
        assert _kind(path) == before
        calls.append(name)
    assert calls == ["fifo", "dir", "to-null"]


def test_bench_write_policy_dash_prints(capsys):
    assert cli.main(["bench", "--device", "cpu", "--op", "kv_quant", "--sizes", "1",
                     "--write-policy", "-"]) == 0
    out = capsys.readouterr().out
    assert "schema: 1" in out and not os.path.exists("-")


def test_bench_rewrite_keeps_the_files_settings(tmp_path, capsys):
    policy = tmp_path / "cpu.yaml"
    policy.write_text('verify: required\nmixed_group: uniform\non_unsupported: error\n'
                      'devices:\n  - match: {id: "cpu"}\n    ops:\n      kv_quant: [torch]\n')
    os.chmod(policy, 0o640)
    assert cli.main(["bench", "--device", "cpu", "--op", "kv_quant", "--sizes", "1",
                     "--write-policy", str(policy)]) == 0
    pf = cd.policies.load_file(policy, extend.registry.builtin(), known_devices=())
    assert (pf.verify.value, pf.mixed_group.value, pf.on_unsupported.value) == ("required", "uniform", "error")
    assert stat.S_IMODE(os.stat(policy).st_mode) == 0o640
    assert sorted(os.listdir(tmp_path)) == ["cpu.yaml"]


@pytest.mark.parametrize("argv,needle", [
    (["--sizes", "100000000"], "is larger than kv_quant is timed at"),
    (["--warmup", "nan"], "--warmup"), (["--rep", "0"], "--rep"), (["--rep", "inf"], "--rep"),
    (["--write-policy", ""], "an empty file name"),
])
def test_bench_refuses_sizes_and_times_that_cannot_be_meant(argv, needle, capsys):
    r = bounded(lambda: cli.main(["bench", "--device", "cpu", "--op", "kv_quant", *argv]), 20)
    assert r["value"] == 2
    assert needle in capsys.readouterr().err


def test_a_reader_racing_the_writer_sees_a_whole_file(tmp_path):
    path = tmp_path / "p.yaml"
    texts = [f"ops:\n  kv_quant: [torch]\n# {'x' * 4000}\n", "ops:\n  kv_quant: [triton_u8, torch]\n"]
    safe_io.write_atomic(path, texts[0])
    stop, bad = threading.Event(), []

    def write():
        i = 0
        while not stop.is_set():
            i += 1
            safe_io.write_atomic(path, texts[i % 2])
    t = threading.Thread(target=write, daemon=True)
    t.start()
    try:
        for _ in range(200):
            pf = cd.policies.load_file(path, extend.registry.builtin())
            if pf.ops["kv_quant"].value[-1] != "torch":
                bad.append(pf)
    finally:
        stop.set()
        t.join(5)
    assert bad == []
