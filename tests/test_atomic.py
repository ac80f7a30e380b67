"""Atomic publication of files and folders, with ordinary permissions."""
from __future__ import annotations

import json
import os
import stat

import pytest

from cflib.atomic import (
    atomic_directory,
    atomic_file,
    clean_leftovers,
    copy_beside,
    open_append,
    save_figure,
    set_aside,
    scratch_folder,
    write_json_atomic,
    write_text_atomic,
)


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


@pytest.fixture
def outside(tmp_path):
    """A file outside the folder the tests write in, and that folder."""
    victim = tmp_path / "outside" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("keep me")
    (tmp_path / "job").mkdir()
    return victim, tmp_path / "job"


def test_a_link_where_a_file_is_published_is_replaced_never_written_through(outside):
    victim, folder = outside
    for name in ("record.json", "notes.txt", "plot.png"):
        (folder / name).symlink_to(victim)
    write_json_atomic(folder / "record.json", {"a": 1})
    write_text_atomic(folder / "notes.txt", "new")
    import matplotlib.pyplot as plt
    figure = plt.figure()
    save_figure(figure, folder / "plot.png")
    plt.close(figure)
    assert victim.read_text() == "keep me"
    assert not any(p.is_symlink() for p in folder.iterdir())
    assert (folder / "notes.txt").read_text() == "new" and (folder / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_publishing_only_where_nothing_is_refuses_a_file_or_any_link_and_leaves_them(outside):
    victim, folder = outside
    (folder / "dangling.jsonl").symlink_to(folder / "nowhere")
    (folder / "kept.jsonl").write_text("first\n")
    for name in ("dangling.jsonl", "kept.jsonl"):
        with pytest.raises(FileExistsError, match=f"{name} already exists; it was left as it was"):
            write_text_atomic(folder / name, "second\n", replace=False)
    assert (folder / "kept.jsonl").read_text() == "first\n" and not (folder / "nowhere").exists()
    assert sorted(os.listdir(folder)) == ["dangling.jsonl", "kept.jsonl"]  # no staging file left
    write_text_atomic(folder / "new.jsonl", "x\n", replace=False)
    assert (folder / "new.jsonl").read_text() == "x\n"


def test_a_failing_block_leaves_the_old_file_and_no_staging(tmp_path):
    write_text_atomic(tmp_path / "table.csv", "old\n")
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "table.csv") as staging:
            staging.write_text("half")
            raise RuntimeError("interrupted")
    assert (tmp_path / "table.csv").read_text() == "old\n" and os.listdir(tmp_path) == ["table.csv"]


def test_appending_never_follows_a_link(outside):
    victim, folder = outside
    (folder / "papermill.log").symlink_to(victim)
    with pytest.raises(OSError, match="papermill.log is a symbolic link; nothing is written through it"):
        open_append(folder / "papermill.log")
    with open_append(folder / "run.log") as log:
        log.write("one\n")
    with open_append(folder / "run.log") as log:
        log.write("two\n")
    assert victim.read_text() == "keep me" and (folder / "run.log").read_text() == "one\ntwo\n"


def test_scratch_files_stay_beside_their_target_and_go_with_the_block_or_as_a_leftover(tmp_path):
    with pytest.raises(RuntimeError):
        with scratch_folder(tmp_path / "out" / "work") as scratch:
            (scratch / "seen.sqlite").write_bytes(b"x")
            assert scratch.parent == tmp_path / "out" and copy_beside(scratch.name) == "work"
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path / "out") == []
    killed = tmp_path / "out" / ".work.staging-abcd1234"  # what a kill inside the block leaves
    killed.mkdir()
    assert clean_leftovers(tmp_path / "out") == [killed.name] and os.listdir(tmp_path / "out") == []


def test_set_aside_takes_the_first_free_number_even_past_a_dangling_link(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run.set-aside-1").symlink_to(tmp_path / "gone")  # dangling: a rename onto it would replace it
    assert set_aside(tmp_path / "run") == tmp_path / "run.set-aside-2"
    assert (tmp_path / "run.set-aside-1").is_symlink() and (tmp_path / "run.set-aside-2").is_dir()
