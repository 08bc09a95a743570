"""The SGLang rank report's writing (capdispatch.adapters.sglang.report.write): where it
refuses to write (a report directory that is a symbolic link, under another user's link,
a link at the report's name) and what a failed write leaves (nothing but the old file).
A report that cannot be written is one WARNING line and None, never an exception."""
from __future__ import annotations

import errno
import logging
import os
import types

import pytest

from capdispatch.adapters.sglang import report


@pytest.fixture
def write(monkeypatch, caplog):
    """write(folder) -> (the path written or None, the WARNING lines), for gpu_id 0."""
    monkeypatch.setattr(report, "build", lambda state, **kw: {"schema": report.SCHEMA, "gpu_id": 0})
    monkeypatch.setattr("socket.gethostname", lambda: "node")

    def go(folder):
        caplog.clear()
        state = types.SimpleNamespace(gpu_id=0, env={report.ENV_DIR: str(folder)})
        with caplog.at_level(logging.WARNING, logger="capdispatch.sglang"):
            path = report.write(state)
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert all("\n" not in line for line in lines), lines
        return path, lines
    return go


def test_a_report_is_written_and_replaced(tmp_path, write):
    folder = tmp_path / "reports" / "deep"
    path, lines = write(folder)
    assert path == folder / "sglang-node-gpu0.json" and lines == []
    assert '"gpu_id": 0' in path.read_text()
    assert write(folder) == (path, []) and os.listdir(folder) == ["sglang-node-gpu0.json"]


def test_a_report_directory_that_is_a_symbolic_link_is_refused(tmp_path, write):
    target = tmp_path / "etc"
    target.mkdir()
    link = tmp_path / "reports"
    link.symlink_to(target)
    path, lines = write(link)
    assert path is None and len(lines) == 1, lines
    assert f"the report directory {link} is a symbolic link (to {target})" in lines[0], lines
    assert report.ENV_DIR in lines[0]
    assert os.listdir(target) == []


def test_a_link_above_the_report_directory_is_refused_only_when_another_users(tmp_path, write):
    mine = tmp_path / "mine"
    (tmp_path / "real").mkdir()
    mine.symlink_to(tmp_path / "real")
    path, lines = write(mine / "reports")          # this user's own link (~/.cache on another disk)
    assert path is not None and lines == [] and path.exists()
    if os.geteuid() != 0:
        pytest.skip("giving a link to another user needs root")
    theirs = tmp_path / "theirs"
    theirs.symlink_to(tmp_path / "real")
    os.lchown(theirs, 4321, 4321)
    path, lines = write(theirs / "other")
    assert path is None and len(lines) == 1, lines
    assert f"{theirs}, above the report directory, is a symbolic link owned by uid 4321" in lines[0]
    assert not (tmp_path / "real" / "other").exists()


def test_a_link_at_the_reports_name_is_refused(tmp_path, write):
    folder = tmp_path / "reports"
    folder.mkdir()
    victim = tmp_path / "passwd"
    victim.write_text("root:x:0:0\n")
    (folder / "sglang-node-gpu0.json").symlink_to(victim)
    path, lines = write(folder)
    assert path is None and len(lines) == 1 and "is a symbolic link" in lines[0], lines
    assert victim.read_text() == "root:x:0:0\n"
    assert os.listdir(folder) == ["sglang-node-gpu0.json"]


def test_a_directory_at_the_reports_name_leaves_no_temporary_file(tmp_path, write):
    folder = tmp_path / "reports"
    (folder / "sglang-node-gpu0.json").mkdir(parents=True)
    path, lines = write(folder)
    assert path is None and len(lines) == 1 and "it is a directory" in lines[0], lines
    assert os.listdir(folder) == ["sglang-node-gpu0.json"]


def test_a_full_disk_leaves_the_old_report_and_no_temporary_file(tmp_path, write, monkeypatch):
    folder = tmp_path / "reports"
    path, _ = write(folder)
    old = path.read_text()

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "write", full)
    again, lines = write(folder)
    monkeypatch.undo()
    assert again is None and len(lines) == 1 and "No space left on device" in lines[0], lines
    assert path.read_text() == old and os.listdir(folder) == ["sglang-node-gpu0.json"]
