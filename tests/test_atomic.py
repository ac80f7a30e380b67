"""Atomic publication of files and folders, with ordinary permissions."""
from __future__ import annotations

import json
import os
import stat

import pytest

from cflib.atomic import atomic_directory, write_json_atomic


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_published_entries_follow_the_umask_not_tempfile_privacy(tmp_path, umask_022):
    path = write_json_atomic(tmp_path / "record.json", {"a": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    with atomic_directory(tmp_path / "ckpt") as staging:
        (staging / "x").write_text("x")
    assert stat.S_IMODE((tmp_path / "ckpt").stat().st_mode) == 0o755


def test_json_replaces_whole_and_a_failed_write_keeps_the_old(tmp_path):
    path = write_json_atomic(tmp_path / "record.json", {"run": 1})
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="Circular"):
        write_json_atomic(path, {"bad": cyclic})
    assert json.loads(path.read_text()) == {"run": 1}
    assert os.listdir(tmp_path) == ["record.json"]


def test_a_failing_block_leaves_the_previous_folder(tmp_path):
    with atomic_directory(tmp_path / "out") as staging:
        (staging / "v").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "out") as staging:
            (staging / "v").write_text("2")
            raise RuntimeError("interrupted")
    assert (tmp_path / "out" / "v").read_text() == "1"
    assert os.listdir(tmp_path) == ["out"]
