"""A run writes and deletes only inside its own folder, and one folder holds one run.

A copied run folder reads as itself (its record's paths re-rooted in the copy), a copy whose checkpoints/ links
into the original is refused, a curriculum stage that cannot be continued is set aside (never deleted), a
curriculum and a single run never share a folder, and a run killed before its first resumable checkpoint starts
over with `resume: latest`, its files kept. Each case hashes every folder around the target before and after.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from sft_shard_helpers import task_shard

from cflib.errors import ParamError
from cflib.export import export_hub
from cflib.lab.evaluate import resolve_bundle
from cflib.lab.report import export_run
from cflib.model import load_checkpoint, save_checkpoint
from cflib.model.checkpoint import WEIGHTS_FILE
from cflib.train import train
from cflib.train.lock import LOCK_FILE
from cflib.train.run_folder import read_run_record

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    return task_shard(tmp_path_factory.mktemp("shard"), 16, 4)


def params(shard: Path, out_dir: Path, **overrides) -> dict:
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "seq_len": 64, "micro_batch_per_rank": 4,
            "global_batch": 8, "max_steps": 2, "lr": 3e-3, "exact_match_limit": 0, "device": "cpu",
            "eval_at_start": False, **overrides}


def digest(folder: Path) -> dict[str, str]:
    """Every file and link under `folder`, hidden ones included, by content (a link by where it points)."""
    return {str(p.relative_to(folder)): "-> " + os.readlink(p) if p.is_symlink()
            else hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file() or p.is_symlink()}


@pytest.fixture(scope="module")
def finished(shard, tmp_path_factory) -> Path:
    """A finished full-parameter run (best and epoch-1 checkpoints, no resumable one)."""
    out_dir = tmp_path_factory.mktemp("finished") / "run"
    train(params(shard, out_dir), progress=False)
    return out_dir


def killed_copy(run: Path, where: Path) -> Path:
    """A copy of `run` as a kill before its end leaves it: no record, no COMPLETE."""
    shutil.copytree(run, where, symlinks=True)
    for name in ("record.json", "COMPLETE"):
        (where / name).unlink()
    return where


def test_a_copied_run_is_exported_from_the_copy_and_the_original_is_never_touched(finished, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy, symlinks=True)
    # The original moves on after the copy: its best weights are no longer the copy's.
    save_checkpoint(load_checkpoint(finished / "checkpoints" / "epoch-1"), finished / "checkpoints" / "best")
    copied_best = load_checkpoint(copy / "checkpoints" / "best").state_dict()
    before = digest(finished)
    record = read_run_record(copy)
    assert record["out_dir"] == str(copy)
    assert record["checkpoints"]["best"] == str(copy / "checkpoints" / "best")
    bundle = export_run(record)
    assert bundle == copy / "hub" and not (finished / "hub").exists() and digest(finished) == before
    exported = load_checkpoint(bundle).state_dict()
    assert all(torch.equal(exported[name], copied_best[name]) for name in copied_best)


def test_a_record_pointing_into_the_original_where_the_copy_lacks_it_is_refused(finished, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy, symlinks=True)
    shutil.rmtree(copy / "checkpoints" / "best")
    with pytest.raises(ParamError, match=rf"names {finished / 'checkpoints' / 'best'}, inside the folder this run was "
                                         rf"copied from .* is missing here"):
        read_run_record(copy)


@pytest.mark.parametrize("resume", [None, "latest"])
def test_a_copy_whose_checkpoints_link_into_the_original_is_refused(shard, finished, tmp_path, resume):
    copy = tmp_path / "copy"
    copy.mkdir()
    for entry in finished.iterdir():
        if entry.name not in ("checkpoints", "record.json", "COMPLETE"):
            shutil.copy2(entry, copy / entry.name)
    (copy / "checkpoints").symlink_to(finished / "checkpoints")
    before, copied = digest(finished), digest(copy)
    with pytest.raises(ParamError, match=rf"out_dir {copy}: checkpoints is a symbolic link \(to "
                                         rf"{finished / 'checkpoints'}\); a job writes and deletes only inside"):
        train(params(shard, copy, resume=resume, save_total_limit=1), progress=False)
    assert digest(finished) == before and digest(copy) == copied


@pytest.mark.parametrize("entry", ["eval_tasks", "samples"])
def test_a_run_folder_whose_scores_or_samples_link_outside_is_refused(shard, tmp_path, entry):
    """lm-eval's scores of each checkpoint are replaced (the old folder deleted) and log_samples' files written:
    through a link they would delete and write outside the run folder."""
    outside = tmp_path / "outside"
    (outside / "epoch-1").mkdir(parents=True)
    (outside / "epoch-1" / "precious.txt").write_text("keep me")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / entry).symlink_to(outside)
    before = digest(outside)
    with pytest.raises(ParamError, match=rf"out_dir {run_dir}: {entry} is a symbolic link \(to {outside}\)"):
        train(params(shard, run_dir, eval_tasks="embedded_exact", eval_tasks_every="epoch", log_samples=1),
              progress=False)
    assert digest(outside) == before


def test_a_run_killed_before_its_first_resumable_checkpoint_starts_over_with_its_files_kept(shard, finished,
                                                                                           tmp_path):
    killed = killed_copy(finished, tmp_path / "killed")
    before = digest(killed)
    with pytest.raises(ParamError, match="already holds a run .*resume: latest .*starts over"):
        train(params(shard, killed), progress=False)
    assert digest(killed) == before
    record = train(params(shard, killed, resume="latest"), progress=False)
    assert record["schedule"]["steps_done"] == 2 and (killed / "COMPLETE").is_file()
    kept = killed / "set-aside-1"
    assert digest(kept) == {name: value for name, value in before.items() if name != LOCK_FILE}  # as it was
    assert sorted(p.name for p in killed.iterdir() if not p.name.startswith(".")) == sorted(
        ["set-aside-1", "params.json", "metrics.jsonl", "checkpoints", "record.json", "COMPLETE"])


@pytest.mark.slow
def test_a_torchrun_worker_never_writes_over_a_run_killed_before_its_first_resumable_checkpoint(shard, finished,
                                                                                                tmp_path):
    """`resume: latest` handed straight to torchrun's worker (python -m cflib.train PARAMS.json), without the
    launcher that sets the killed run's files aside: refused by name, every file left as it was."""
    killed = killed_copy(finished, tmp_path / "killed")
    params_file = tmp_path / "params.json"
    params_file.write_text(json.dumps(params(shard, killed, resume="latest")))
    before = digest(tmp_path)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           "-m", "cflib.train", str(params_file)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert f"out_dir {killed} holds a run killed before its first resumable checkpoint" in done.stdout + done.stderr
    lock = str((killed / LOCK_FILE).relative_to(tmp_path))  # the worker's own lock names it as the last holder
    assert {k: v for k, v in digest(tmp_path).items() if k != lock} == {k: v for k, v in before.items() if k != lock}


def test_evaluate_scores_a_copied_run_s_own_best_checkpoint(finished, tmp_path):
    """evaluate on a `cp -a` copy without hub/: the bundle it scores is exported from the copy's best weights into
    its own out_dir, though the original's best has moved on; nothing around the copy changes."""
    copy = tmp_path / "runs" / "copy"
    shutil.copytree(finished, copy, symlinks=True)
    save_checkpoint(load_checkpoint(finished / "checkpoints" / "epoch-1"), finished / "checkpoints" / "best")
    copied_best = load_checkpoint(copy / "checkpoints" / "best").state_dict()
    original, copied = digest(finished), digest(copy)
    bundle, source = resolve_bundle(str(copy), tmp_path / "eval", "cpu")
    assert bundle == tmp_path / "eval" / "bundle" and str(copy) in source
    scored = load_checkpoint(bundle).state_dict()
    assert all(torch.equal(scored[name], copied_best[name]) for name in copied_best)
    assert digest(finished) == original and digest(copy) == copied
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "runs"]


STAGES = [{"name": "a", "max_steps": 2}, {"name": "b", "max_steps": 2}]


def curriculum(path: Path) -> Path:
    path.write_text(yaml.safe_dump({"version": 1, "stages": STAGES}))
    return path


@pytest.fixture(scope="module")
def curriculum_run(shard, tmp_path_factory) -> Path:
    """A finished two-stage curriculum whose stages save no resumable checkpoint (best/ and last/ only)."""
    root = tmp_path_factory.mktemp("curriculum")
    out_dir = root / "run"
    train(params(shard, out_dir, curriculum=str(curriculum(root / "c.yaml")), max_steps=None), progress=False)
    return out_dir


def test_a_curriculum_folder_exports_and_chats_as_its_last_stage(curriculum_run, tmp_path):
    """Export and chat take a curriculum's folder as its last stage's run folder: its best checkpoint."""
    from cflib.lab.chat import find_checkpoint

    best = curriculum_run / "stages" / "b" / "checkpoints" / "best"
    assert find_checkpoint(curriculum_run) == best
    out = export_hub(curriculum_run, tmp_path / "hub", echo=None)
    assert (out / "model.safetensors").is_file()
    assert load_checkpoint(best).state_dict().keys() <= load_checkpoint(out).state_dict().keys()
    killed = shutil.copytree(curriculum_run, tmp_path / "killed", symlinks=True)
    shutil.rmtree(killed / "stages" / "b" / "checkpoints")  # killed during its first save: only the staging left
    (killed / "stages" / "b" / "checkpoints" / ".best.staging-1").mkdir(parents=True)
    assert find_checkpoint(killed) == killed / "stages" / "a" / "checkpoints" / "best"


def test_a_stage_holding_only_a_best_checkpoint_is_set_aside_not_deleted(shard, curriculum_run, tmp_path):
    killed = tmp_path / "run"
    shutil.copytree(curriculum_run, killed, symlinks=True)
    for path in (killed / "COMPLETE", killed / "record.json", killed / "stages" / "b" / "COMPLETE",
                 killed / "stages" / "b" / "record.json"):  # killed in stage b, after its best/ was written
        path.unlink()
    for checkpoint in (killed / "stages" / "b" / "checkpoints").iterdir():
        if checkpoint.name != "best":
            shutil.rmtree(checkpoint)
    stage_b = digest(killed / "stages" / "b")
    assert stage_b and "checkpoints/best/model.safetensors" in stage_b
    record = train(params(shard, killed, curriculum=str(curriculum(tmp_path / "c.yaml")), max_steps=None,
                          resume="latest"), progress=False)
    assert [stage["name"] for stage in record["curriculum"]["stages"]] == ["a", "b"]
    assert digest(killed / "stages" / "b.set-aside-1") == stage_b  # kept whole
    assert (killed / "stages" / "b" / "COMPLETE").is_file()
    # The finished stage a was read back from the copy, not from the folder it was copied from.
    assert record["curriculum"]["stages"][0]["out_dir"] == str(killed / "stages" / "a")


def test_a_curriculum_and_a_single_run_never_share_a_folder(shard, finished, curriculum_run, tmp_path):
    single = killed_copy(finished, tmp_path / "single")
    course = tmp_path / "course"
    shutil.copytree(curriculum_run, course, symlinks=True)
    for name in ("COMPLETE", "record.json"):
        (course / name).unlink()
    before = {folder: digest(folder) for folder in (single, course)}
    path = curriculum(tmp_path / "c.yaml")
    for resume in (None, "latest"):
        with pytest.raises(ParamError, match=rf"out_dir {single} holds a single run \(params.json\), not a "
                                             "curriculum"):
            train(params(shard, single, curriculum=str(path), resume=resume), progress=False)
        with pytest.raises(ParamError, match=rf"out_dir {course} holds a curriculum run \(curriculum.json\)"):
            train(params(shard, course, resume=resume), progress=False)
    assert {folder: digest(folder) for folder in (single, course)} == before


@pytest.mark.slow
def test_a_curriculum_and_a_single_run_started_together_into_one_folder_one_is_refused(shard, tmp_path):
    """Two processes at the same moment, one training a curriculum, one a single run, into one empty folder: one
    trains, the other is refused by name (the folder's lock, or its verdict taken again under the lock)."""
    out_dir = tmp_path / "run"
    go = tmp_path / "go"
    code = ("import json, sys, time, pathlib\nwhile not pathlib.Path(sys.argv[1]).exists(): time.sleep(0.001)\n"
            "from cflib.train import train\ntrain(json.loads(sys.argv[2]), progress=False)")
    jobs = {"curriculum": params(shard, out_dir, curriculum=str(curriculum(tmp_path / "c.yaml")), max_steps=None),
            "single": params(shard, out_dir, max_steps=8)}
    children = {name: subprocess.Popen([sys.executable, "-c", code, str(go), json.dumps(job)], cwd=ROOT, text=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                for name, job in jobs.items()}
    time.sleep(3)  # both interpreters up, cflib and torch imported
    go.write_text("")
    results = {name: (child.wait(timeout=300), child.stderr.read()) for name, child in children.items()}
    winners = [name for name, (returncode, _) in results.items() if returncode == 0]
    assert len(winners) == 1, results
    refusal = results["single" if winners == ["curriculum"] else "curriculum"][1].strip().splitlines()[-1]
    assert ("is being written by another run" in refusal or "holds a curriculum run" in refusal
            or "holds a single run" in refusal or "already holds" in refusal), refusal
    kinds = {"curriculum": (out_dir / "curriculum.json").is_file(), "single": (out_dir / "params.json").is_file()}
    assert kinds == {name: name == winners[0] for name in kinds}
    assert (out_dir / "COMPLETE").is_file()


def test_a_copied_lora_run_merges_into_the_copy(shard, tmp_path):
    base = save_checkpoint(load_checkpoint_of_preset(), tmp_path / "base")
    original = tmp_path / "lora"
    train(params(shard, original, full_parameter=False, init_checkpoint=str(base), lora_rank=2), progress=False)
    copy = tmp_path / "copy"
    shutil.copytree(original, copy, symlinks=True)
    before = digest(original)
    bundle = export_run(read_run_record(copy))
    assert bundle == copy / "hub" and (copy / "merged" / WEIGHTS_FILE).is_file()
    assert digest(original) == before and not (original / "merged").exists()


def load_checkpoint_of_preset():
    from cflib.model import TRMoEModel, preset

    torch.manual_seed(0)
    return TRMoEModel(preset("smoke"))


def test_export_hub_is_still_the_copys_own(finished, tmp_path):
    """The command line on a copy takes the copy's checkpoint (it reads the folder, not the record)."""
    copy = tmp_path / "copy"
    shutil.copytree(finished, copy, symlinks=True)
    before = digest(finished)
    export_hub(copy, tmp_path / "bundle", tokenizer="byte", echo=None)
    assert digest(finished) == before
