"""`python -m cflib.export hub|merge` pointed at targets users get wrong: the base it merges onto, the adapters,
a run folder, a folder inside a checkpoint, a path under a file. Each ends in `export: ...` naming the
folder, with no traceback, and every file that existed before is unchanged."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from cflib.export.__main__ import main
from cflib.export.peft import MERGE_MANIFEST, describe_base, merge
from cflib.model.checkpoint import load_checkpoint, save_checkpoint
from cflib.model.config import preset
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import LoraSettings, adapter_state_dict, attach_lora
from cflib.train.adapters import LoraRun

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A base checkpoint, its LoRA adapters, and a run folder holding a checkpoint, all under one root."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    base = save_checkpoint(TRMoEModel(preset("smoke")), root / "base")
    settings = LoraSettings(rank=2, alpha=4)
    model = attach_lora(load_checkpoint(base), settings)
    with torch.no_grad():
        for param in adapter_state_dict(model).values():
            param.normal_(0.0, 0.1)
    LoraRun(settings, describe_base(base)).save(model, root / "adapter")
    run = root / "run"
    save_checkpoint(load_checkpoint(base), run / "checkpoints" / "best")
    (run / "record.json").write_text('{"the": "record"}')
    (root / "afile").write_text("a file, not a folder")
    return root


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cflib.export", *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def refused(*arguments: str) -> str:
    """What `python -m cflib.export ARGUMENTS` prints on failure (its SystemExit message), run in-process."""
    with pytest.raises(SystemExit) as caught:
        main(list(arguments))
    assert isinstance(caught.value.code, str), caught.value.code  # a message, not a bare status
    return caught.value.code


# (id, arguments from the world's root, words the message must contain)
CASES: list[tuple[str, Callable[[Path], list[str]], list[str]]] = [
    ("merge-onto-its-own-base", lambda w: ["merge", str(w / "adapter"), str(w / "base"), "--base", str(w / "base")],
     ["base input itself"]),
    ("merge-onto-the-recorded-base", lambda w: ["merge", str(w / "adapter"), str(w / "base")], ["base input itself"]),
    ("merge-over-the-adapters", lambda w: ["merge", str(w / "adapter"), str(w / "adapter")], ["adapter input itself"]),
    ("merge-into-a-run-folder", lambda w: ["merge", str(w / "adapter"), str(w / "run")],
     ["holds 'checkpoints'", "did not write"]),
    ("merge-into-the-folder-holding-its-inputs", lambda w: ["merge", str(w / "adapter"), str(w)],
     ["contains the adapter input", "would delete it"]),
    ("merge-inside-the-base", lambda w: ["merge", str(w / "adapter"), str(w / "base" / "merged")],
     ["lies inside the base input"]),
    ("merge-under-a-file", lambda w: ["merge", str(w / "adapter"), str(w / "afile" / "merged")], ["afile is a file"]),
    ("merge-onto-a-file", lambda w: ["merge", str(w / "adapter"), str(w / "afile")], ["not a folder"]),
    ("merge-adapter-missing", lambda w: ["merge", str(w / "nowhere"), str(w / "merged")], ["nowhere"]),
    ("hub-into-an-existing-folder", lambda w: ["hub", str(w / "base"), str(w / "run")], ["already exists"]),
    ("hub-inside-its-checkpoint", lambda w: ["hub", str(w / "run"), str(w / "run" / "checkpoints" / "best" / "hub")],
     ["lies inside the checkpoint input"]),
    ("hub-under-a-file", lambda w: ["hub", str(w / "base"), str(w / "afile" / "bundle")], ["afile is a file"]),
    ("hub-from-a-file", lambda w: ["hub", str(w / "afile"), str(w / "bundle")], ["afile", "neither a checkpoint"]),
    ("hub-from-adapters", lambda w: ["hub", str(w / "adapter"), str(w / "bundle")], ["LoRA adapters", "merge"]),
    ("hub-tokenizer-missing", lambda w: ["hub", str(w / "base"), str(w / "bundle"), "--tokenizer", str(w / "no.json")],
     ["no.json"]),
]


@pytest.mark.parametrize("arguments, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_export_target_names_the_culprit_and_changes_nothing(world, arguments, words):
    before = digest(world)
    message = refused(*arguments(world))
    assert message.startswith("export: "), message
    for word in words:
        assert word in message, f"{word!r} not in: {message}"
    assert digest(world) == before


@pytest.mark.slow
def test_the_command_line_ends_in_the_message_not_a_traceback(world):
    before = digest(world)
    done = cli("merge", str(world / "adapter"), str(world / "base"))
    assert done.returncode != 0 and done.stderr.startswith("export: ") and "Traceback" not in done.stderr
    assert "base input itself" in done.stderr
    assert digest(world) == before


def test_merge_replaces_only_a_folder_of_its_own_output(world, tmp_path):
    merged = tmp_path / "merged"
    merge(world / "adapter", merged)
    assert (merged / MERGE_MANIFEST).is_file()
    first = digest(merged)
    merge(world / "adapter", merged)  # again over its own output: allowed
    assert digest(merged) == first
    (merged / "notes.txt").write_text("mine")
    before = digest(merged)
    assert "'notes.txt'" in refused("merge", str(world / "adapter"), str(merged))
    assert digest(merged) == before


def test_the_hub_bundle_may_go_inside_the_run_folder(world, tmp_path):
    """What the training notebook does: the run's bundle in out_dir/hub, beside (not inside) its checkpoint."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(world / "run", run)
    main(["hub", str(run), str(run / "hub")])
    assert (run / "hub" / "model.safetensors").is_file()


@pytest.mark.parametrize("command", ["hub", "merge"])
def test_an_export_touches_nothing_beside_its_output_but_its_own_leftovers(world, tmp_path, command):
    """A user's `.{OUT}.keep/`, backup and an editor's swap file beside the target stay; only what a killed export
    of this target left (its hidden staging folder) goes."""
    (tmp_path / ".out.keep").mkdir()
    (tmp_path / ".out.keep" / "notes.txt").write_text("the user's")
    (tmp_path / ".out.bak").write_text("a backup")
    (tmp_path / ".out.swp").write_text("an editor's swap file")
    before = digest(tmp_path)
    (tmp_path / ".out.staging-k1ll3d_x").mkdir()  # an export into `out` killed mid-write
    source = world / "adapter" if command == "merge" else world / "base"
    main([command, str(source), str(tmp_path / "out")])
    after = digest(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("out/")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.bak", ".out.keep", ".out.swp", "out"]


def test_a_full_disk_names_the_bundle_and_leaves_nothing(world, tmp_path, monkeypatch):
    try:
        from small_disk import fill, small_disk
    except ImportError:  # run from the repository root as a package
        from tests.small_disk import fill, small_disk
    with small_disk(tmp_path / "disk", "1m") as disk:
        if disk is None:  # no tmpfs here: the weights' write fails as a full disk makes it fail
            disk = tmp_path / "disk"
            disk.mkdir(exist_ok=True)

            def full(*args, **kwargs):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr("cflib.model.checkpoint.save_file", full)
        else:
            fill(disk, leave=16 * 1024)
        before = digest(disk)
        message = refused("hub", str(world / "base"), str(disk / "bundle"))
        assert message.startswith(f"export: out of disk space writing {disk / 'bundle'}"), message
        assert digest(disk) == before and sorted(p.name for p in disk.iterdir()) == sorted(before)
