"""Kill a run with SIGKILL mid-epoch, resume it, and end with the weights of an uninterrupted run."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from mixture_helpers import mixture, task_roots, varied_root
from sft_shard_helpers import task_shard, write_shard
from tiny_models import KERNEL_DEVICE

from cflib.model.checkpoint import CheckpointError, load_checkpoint
from cflib.train import train
from cflib.train.params import ParamError
from cflib.train.records import read_metrics

try:
    from processes import train_and_kill
except ImportError:  # run from the repository root as a package
    from tests.processes import train_and_kill

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> Path:
    return task_shard(tmp_path_factory.mktemp("shard"), 40, 8)


def params(shard: Path, out_dir: Path, **overrides) -> dict:
    # 40 examples, 16 per step: 3 steps an epoch (8 fill-ins), 12 epochs, a resumable checkpoint every 4 steps.
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "seq_len": 64, "micro_batch_per_rank": 4,
            "global_batch": 16, "epochs": 12, "max_steps": None, "lr": 3e-3, "exact_match_limit": 0,
            "device": "cpu", "save_every_steps": 4, **overrides}


# The highest held-out loss chooses best/: the first epoch's, before the kill, which the resumed run must remember
# (a run that forgot it would take the first evaluation after the resume).
BEST_FIRST = {"best_metric": "eval_loss", "greater_is_better": True}


@pytest.fixture(scope="module")
def four_epochs(shard, tmp_path_factory) -> Path:
    """An uninterrupted 12-step run in one process, every checkpoint kept: what the 4-epoch resumes end at."""
    out_dir = tmp_path_factory.mktemp("four_epochs") / "whole"
    train(params(shard, out_dir, epochs=4, save_total_limit=None, **BEST_FIRST), progress=False)
    return out_dir


def assert_best_remembered(resumed: dict, reference: dict, out_dir: Path, reference_dir: Path) -> None:
    """best/ and the record's best_metric are the uninterrupted run's, chosen before the kill."""
    assert reference["best_metric"]["step"] == 3  # the first epoch's evaluation: before the kill
    assert resumed["best_metric"] == {**reference["best_metric"],
                                      "value": pytest.approx(reference["best_metric"]["value"], abs=1e-6)}
    assert resumed["checkpoints"]["best_step"] == "3"
    best = lambda d: load_checkpoint(d / "checkpoints" / "best").state_dict()  # noqa: E731
    assert_same_weights(best(reference_dir), best(out_dir), atol=1e-6)


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(out_dir / "checkpoints" / "epoch-12").state_dict()


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=atol, msg=name)


@pytest.mark.slow
def test_killed_single_process_run_resumes_to_the_uninterrupted_weights(tmp_path, shard):
    reference = train(params(shard, tmp_path / "whole", **BEST_FIRST), progress=False)
    train_and_kill(params(shard, tmp_path / "killed", **BEST_FIRST), tmp_path / "killed", after_checkpoint="step-8")
    resumed = train(params(shard, tmp_path / "killed", resume="latest", **BEST_FIRST), progress=False)
    assert resumed["model_source"].startswith("resumed from") and resumed["schedule"]["steps_done"] == 36
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "killed"), atol=1e-6)
    steps = [r["step"] for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if r["event"] == "train"]
    assert steps == list(range(1, 37))  # every step logged once: nothing lost, nothing doubled
    assert resumed["eval"]["final"]["loss"] == pytest.approx(reference["eval"]["final"]["loss"], abs=1e-6)
    assert resumed["schedule"]["fill_ins_per_epoch"] == [8] * 12
    assert_best_remembered(resumed, reference, tmp_path / "killed", tmp_path / "whole")


@pytest.mark.slow
def test_a_killed_mixture_resumes_to_the_uninterrupted_weights(tmp_path, shard):
    """The embedded tasks at 0.8/0.2, 40 an epoch: addition draws 32 of its 30 (repeated), uppercase 8 of its 12."""
    roots = task_roots(tmp_path / "roots", {"addition": 30, "uppercase": 12}, held_out=6)

    def mixed(out_dir: Path, weights: tuple[float, float] = (0.8, 0.2), **overrides) -> dict:
        data = mixture(roots, dict(zip(("addition", "uppercase"), weights)))
        return params(shard, out_dir, data=data, examples_per_epoch=40, exact_match_limit=4, **overrides)

    reference = train(mixed(tmp_path / "whole"), progress=False)
    train_and_kill(mixed(tmp_path / "killed"), tmp_path / "killed", after_checkpoint="step-8")
    with pytest.raises(ParamError, match=r"written with mixture \[0.8, 0.2\], this run has \[0.7, 0.3\]"):
        train(mixed(tmp_path / "killed", (0.7, 0.3), resume="latest"), progress=False)
    shutil.copytree(tmp_path / "killed", tmp_path / "scaled")  # 4:1 is 0.8:0.2, the same draw: it resumes
    train(mixed(tmp_path / "scaled", (4.0, 1.0), resume="latest"), progress=False)
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "scaled"), atol=1e-6)
    resumed = train(mixed(tmp_path / "killed", resume="latest"), progress=False)
    assert resumed["model_source"].startswith("resumed from") and resumed["schedule"]["steps_done"] == 36
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "killed"), atol=1e-6)
    assert resumed["data"]["mixture"] == reference["data"]["mixture"]
    assert sum(s["examples"] for s in resumed["data"]["mixture"]["trained"]) == 36 * 16  # 8 fill-ins an epoch
    for source, loss in reference["eval"]["final"]["loss_by_source"].items():
        assert resumed["eval"]["final"]["loss_by_source"][source] == pytest.approx(loss, abs=1e-6)


@pytest.mark.slow
def test_a_killed_packed_mixture_resumes_to_the_uninterrupted_weights(tmp_path, shard):
    """Two sources of unequal lengths at 0.8/0.2, 40 an epoch, each epoch's draw packed anew into 64-token windows,
    4 a step: at seed 3 epoch 1 takes 5 steps and epoch 2 six, so the kill after step 10 stops epoch 2 one step short
    of its end, past where epoch 1 ended. The resumed run plans the same windows from (seed, epoch) alone."""
    roots = {"long": varied_root(tmp_path / "long", 30, 1, 55, seed=0),
             "short": varied_root(tmp_path / "short", 12, 1, 12, seed=1)}

    def packed(out_dir: Path, **overrides) -> dict:
        return params(shard, out_dir, data=mixture(roots, {"long": 0.8, "short": 0.2}), examples_per_epoch=40,
                      pack_sequences=True, global_batch=4, micro_batch_per_rank=2, seed=3, save_every_steps=5,
                      exact_match_limit=4, **overrides)

    reference = train(packed(tmp_path / "whole"), progress=False)
    steps = reference["schedule"]["steps_by_epoch"]
    assert steps[:2] == [5, 6] and reference["schedule"]["steps_done"] == sum(steps)
    train_and_kill(packed(tmp_path / "killed"), tmp_path / "killed", after_checkpoint="step-10")
    resumed = train(packed(tmp_path / "killed", resume="latest"), progress=False)
    assert resumed["model_source"].startswith("resumed from")
    assert resumed["schedule"] == reference["schedule"]  # every epoch's steps and fill-ins, as planned before
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "killed"), atol=1e-6)
    assert resumed["data"]["mixture"] == reference["data"]["mixture"] and resumed["packing"] == reference["packing"]
    logged = [r["step"] for r in read_metrics(tmp_path / "killed" / "metrics.jsonl") if r["event"] == "train"]
    assert logged == list(range(1, sum(steps) + 1))  # every step logged once: nothing lost, nothing doubled
    for source, loss in reference["eval"]["final"]["loss_by_source"].items():
        assert resumed["eval"]["final"]["loss_by_source"][source] == pytest.approx(loss, abs=1e-6)


@pytest.mark.slow
def test_killed_fsdp_run_resumes_and_its_optimizer_state_serves_ddp_too(tmp_path, shard, four_epochs):
    """FSDP gathers the whole optimizer state, keyed by parameter name: FSDP resumes it, and so would DDP; one
    process may not, unless told to."""
    out_dir = tmp_path / "killed"
    fsdp = params(shard, out_dir, nproc_per_node=2, epochs=4, strategy="fsdp", **BEST_FIRST)
    train_and_kill(fsdp, out_dir, after_checkpoint="step-8")
    state = torch.load(out_dir / "checkpoints" / "step-8" / "trainer_state.pt", weights_only=True)
    assert "layers.0.mlp.engine.expert_up" in state["optimizer"]["state"]
    kept = shutil.copytree(out_dir / "checkpoints" / "step-8", tmp_path / "step-8")
    with pytest.raises(ParamError, match="written by 2 process.*allow_world_size_change"):
        train(params(shard, out_dir, epochs=4, resume="latest", **BEST_FIRST), progress=False)
    resumed = train({**fsdp, "resume": "latest"}, progress=False)
    assert resumed["strategy"] == "fsdp" and resumed["schedule"]["steps_done"] == 12
    ddp = train(params(shard, tmp_path / "ddp", nproc_per_node=2, epochs=4, strategy="ddp", resume=str(kept),
                       **BEST_FIRST), progress=False)
    assert ddp["strategy"] == "ddp" and ddp["model_source"].startswith("resumed from")
    weights = lambda d: load_checkpoint(d / "checkpoints" / "epoch-4").state_dict()  # noqa: E731
    assert_same_weights(weights(four_epochs), weights(out_dir), atol=1e-5)
    assert_same_weights(weights(four_epochs), weights(tmp_path / "ddp"), atol=1e-5)
    reference = json.loads((four_epochs / "record.json").read_text())
    assert_best_remembered(resumed, reference, out_dir, four_epochs)


@pytest.mark.parametrize("killed", ["before-its-row", "before-best-saved", "after-best-saved"])
def test_a_run_killed_after_an_evaluation_s_checkpoint_finishes_that_evaluation_on_resume(tmp_path, shard, killed):
    """An evaluation writes its epoch checkpoint, then its metrics row, then best/ when it improved. A kill in
    between leaves a resumable checkpoint whose evaluations hold one that neither metrics.jsonl nor best/ may have
    received: the resumed run finishes it (the checkpoint holds the weights it scored). A kill after all three
    leaves one whose books were written before. Each way the resumed run ends with the uninterrupted run's best,
    in the record as on disk, and its metrics hold each evaluation once."""
    out_dir = tmp_path / "run"
    two_epochs = params(shard, out_dir, epochs=2, save_every_steps=None, save_optimizer_state=True)
    whole = train(two_epochs, progress=False)
    evals = {e["step"]: e["loss"] for e in whole["eval"]["history"]}
    assert whole["best_metric"]["step"] == 6 and evals[6] < evals[3]  # the second epoch improved on the first
    # The folder as the kill leaves it: epoch-2 written, best/ the second epoch's or still the first's, no record.
    for name in ("COMPLETE", "record.json"):
        (out_dir / name).unlink()
    if killed != "after-best-saved":
        shutil.rmtree(out_dir / "checkpoints" / "best")
        shutil.copytree(out_dir / "checkpoints" / "epoch-1", out_dir / "checkpoints" / "best")
    if killed == "before-its-row":
        rows = (out_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
        (out_dir / "metrics.jsonl").write_text("".join(row for row in rows if '"tag": "epoch-2"' not in row))
    resumed = train({**two_epochs, "resume": "latest"}, progress=False)
    assert "checkpoints/epoch-2 at step 6" in resumed["model_source"]
    assert resumed["best_metric"] == {"name": "eval_loss", "greater_is_better": False, "step": 6, "value": evals[6]}
    best = load_checkpoint(out_dir / "checkpoints" / "best").state_dict()
    held = load_checkpoint(out_dir / "checkpoints" / "epoch-2").state_dict()
    assert_same_weights(held, best, atol=0)
    rows = [(row["step"], row["tag"]) for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "eval"]
    assert rows == [(e["step"], e["tag"]) for e in whole["eval"]["history"]]


def test_a_resume_reads_metrics_jsonl_once(tmp_path, shard, monkeypatch):
    """A resume takes three things from metrics.jsonl: the rows up to its checkpoint (the rest dropped), the
    trackers' replay of them, and the row of an evaluation its checkpoint holds unfinished, written before the kill.
    One read serves all three, and each still does its part: every evaluation once in the file and in TensorBoard."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out_dir = tmp_path / "run"
    two_epochs = params(shard, out_dir, epochs=2, save_every_steps=None, save_optimizer_state=True,
                        report_to="tensorboard")
    whole = train(two_epochs, progress=False)
    for name in ("COMPLETE", "record.json"):  # killed after the last evaluation's row: epoch-2 holds it unfinished
        (out_dir / name).unlink()
    with (out_dir / "metrics.jsonl").open("a") as out:  # a row past the checkpoint, which the resume drops
        out.write(json.dumps({"event": "train", "step": 7, "tokens": 1, "loss": 1.0}) + "\n")
    shutil.rmtree(out_dir / "tensorboard")  # what the resume replays is all TensorBoard will hold
    reads = []
    real_open = open

    def counting_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file).name == "metrics.jsonl" and "r" in mode:
            reads.append(mode)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    resumed = train({**two_epochs, "resume": "latest"}, progress=False)
    monkeypatch.undo()
    assert len(reads) == 1
    history = [(e["step"], e["tag"]) for e in whole["eval"]["history"]]
    assert [(e["step"], e["tag"]) for e in resumed["eval"]["history"]] == history
    rows = read_metrics(out_dir / "metrics.jsonl")
    assert [(row["step"], row["tag"]) for row in rows if row["event"] == "eval"] == history
    assert max(row["step"] for row in rows) == 6
    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    assert [s.step for s in events.Scalars("eval/loss")] == [step for step, _ in history]


def test_a_resumed_run_keeps_the_eval_tasks_scores_its_rows_hold_and_its_best_by_them(tmp_path, shard, monkeypatch):
    """An epoch checkpoint's books are saved before its evaluation is scored. Resumed from it, the run takes the
    scores its metrics row holds (scoring nothing again), keeps best/ by them, and scores only what is new."""
    from cflib.train import task_scores

    scored = []

    def score(self, checkpoint: Path, folder: Path) -> dict:
        scored.append(checkpoint.name)
        folder.mkdir(parents=True, exist_ok=True)
        value = 0.9 if checkpoint.name == "epoch-1" else 0.5  # the first epoch scores best
        return {"lm_eval": {"embedded_exact": {"exact_match": value}}, "lm_eval_higher_is_better": {},
                "lm_eval_seconds": 0.0}

    monkeypatch.setattr(task_scores.TaskScorer, "score", score)
    monkeypatch.setattr(task_scores, "check_tasks", lambda names, what: None)
    out_dir = tmp_path / "run"
    two_epochs = params(shard, out_dir, epochs=2, save_every_steps=None, save_optimizer_state=True,
                        eval_tasks="embedded_exact", eval_tasks_every="epoch",
                        best_metric="lm_eval/embedded_exact/exact_match", greater_is_better=True)
    assert train(two_epochs, progress=False)["best_metric"]["step"] == 3 and scored == ["epoch-1", "epoch-2"]
    # Killed during the second epoch: epoch-1 is the latest resumable checkpoint.
    for name in ("COMPLETE", "record.json"):
        (out_dir / name).unlink()
    for name in ("epoch-2", "last"):
        shutil.rmtree(out_dir / "checkpoints" / name, ignore_errors=True)
    scored.clear()
    resumed = train({**two_epochs, "resume": "latest"}, progress=False)
    assert scored == ["epoch-2"]
    assert resumed["best_metric"]["step"] == 3 and resumed["best_metric"]["value"] == 0.9
    assert [e.get("lm_eval") for e in resumed["eval"]["history"] if e["tag"] == "epoch-1"] == [
        {"embedded_exact": {"exact_match": 0.9}}]
    assert "epoch-1" in resumed["checkpoints"]  # the checkpoint resumed from is the run's too


def test_a_checkpoint_with_optimizer_state_keyed_by_position_still_resumes(tmp_path, shard, four_epochs):
    """Checkpoints written before optimizer state was keyed by parameter name hold torch's positional form."""
    old = shutil.copytree(four_epochs / "checkpoints" / "step-8", tmp_path / "step-8")
    state = torch.load(old / "trainer_state.pt", weights_only=True)
    named = state["optimizer"]
    position = {name: i for i, name in enumerate(n for group in named["param_groups"] for n in group["params"])}
    state["optimizer"] = {"state": {position[name]: value for name, value in named["state"].items()},
                          "param_groups": [{**group, "params": [position[n] for n in group["params"]]}
                                           for group in named["param_groups"]]}
    torch.save(state, old / "trainer_state.pt")
    train(params(shard, tmp_path / "resumed", epochs=4, resume=str(old), **BEST_FIRST), progress=False)
    weights = lambda d: load_checkpoint(d / "checkpoints" / "epoch-4").state_dict()  # noqa: E731
    assert_same_weights(weights(four_epochs), weights(tmp_path / "resumed"), atol=1e-6)


def test_resume_needs_a_resumable_checkpoint(tmp_path, shard):
    with pytest.raises(CheckpointError, match="missing does not exist: resume: latest continues a run in its out_dir"):
        train(params(shard, tmp_path / "missing", resume="latest"), progress=False)
    assert not (tmp_path / "missing").exists()
    train(params(shard, tmp_path / "run", max_steps=2, save_every_steps=None), progress=False)
    with pytest.raises(ParamError, match="holds a completed run"):
        train(params(shard, tmp_path / "run", resume="latest"), progress=False)
    (tmp_path / "run" / "COMPLETE").unlink()  # as if it had been killed before its end
    with pytest.raises(CheckpointError, match="best/trainer_state.pt: missing; only checkpoints saved with optimizer"):
        train(params(shard, tmp_path / "run", resume=str(tmp_path / "run" / "checkpoints" / "best")), progress=False)
    with pytest.raises(ParamError, match="already holds a run .* resume: latest"):
        train(params(shard, tmp_path / "run"), progress=False)
    # resume: latest finds nothing to continue there: it starts over (tests/train/test_run_folders.py)
    # A global batch of 8: packed, the 40 examples fill 12 windows, enough for one.
    again = {"global_batch": 8, "max_steps": 5}
    train(params(shard, tmp_path / "again", **again), progress=False)
    (tmp_path / "again" / "COMPLETE").unlink()  # killed before its end, with step-4 saved
    with pytest.raises(ParamError, match="written with global_batch 8, this run has 16"):
        train(params(shard, tmp_path / "again", resume="latest", **{**again, "global_batch": 16}), progress=False)
    with pytest.raises(ParamError, match=r"written with total_steps 5, this run has 6 \(from epochs, max_steps,"):
        train(params(shard, tmp_path / "again", resume="latest", **{**again, "max_steps": 6}), progress=False)
    with pytest.raises(ParamError, match="written with pack_sequences False, this run has True"):
        train(params(shard, tmp_path / "again", resume="latest", pack_sequences=True, **again), progress=False)
    groups = {"all": {"target_share": 1.0, "tasks": ["addition", "uppercase"],
                      "task_target_shares": {"addition": 0.5, "uppercase": 0.5}}}
    with pytest.raises(ParamError, match="written with loss_groups None, this run has"):
        train(params(shard, tmp_path / "again", resume="latest", loss_groups=groups, **again), progress=False)


def test_resume_ignores_a_save_that_a_kill_left_half_done(tmp_path, shard):
    out_dir = tmp_path / "run"
    train(params(shard, out_dir, max_steps=9), progress=False)
    (out_dir / "COMPLETE").unlink()  # as if killed while writing the step-8 checkpoint...
    stale = out_dir / "checkpoints" / ".step-8.k1ll3d"  # ...whose staging folder was left behind
    stale.mkdir()
    (stale / "trainer_progress.json").write_text('{"step": 8, "epoch"')  # cut off mid-write
    (stale / "trainer_state.pt").write_bytes(b"partial")
    record = train(params(shard, out_dir, max_steps=9, resume="latest"), progress=False)
    assert "checkpoints/step-8 at step 8" in record["model_source"]
    assert record["schedule"]["steps_done"] == 9


def adapters_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    from cflib.export.peft import read_adapter

    return read_adapter(checkpoint)[2]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    from cflib.model.checkpoint import save_checkpoint
    from cflib.model.config import preset
    from cflib.model.decoder import TRMoEModel

    torch.manual_seed(5)
    return save_checkpoint(TRMoEModel(preset("smoke")), tmp_path_factory.mktemp("base") / "base")


@pytest.mark.slow
def test_killed_lora_run_resumes_to_the_uninterrupted_adapters(tmp_path, shard, base, monkeypatch):
    """Adapters, their AdamW state and the stream continue; the frozen base is reloaded and checked."""
    lora = {"init_checkpoint": str(base), "full_parameter": False, "lora_rank": 4, "lora_dropout": 0.1,
            "lr": 1e-2, "epochs": 4}
    train(params(shard, tmp_path / "whole", **lora), progress=False)
    train_and_kill(params(shard, tmp_path / "killed", **lora), tmp_path / "killed", after_checkpoint="step-8")
    # the base named as params files name it (relative to the project), from another working directory
    monkeypatch.chdir(tmp_path)
    lora["init_checkpoint"] = os.path.relpath(base, ROOT)
    resumed = train(params(shard, tmp_path / "killed", resume="latest", **lora), progress=False)
    assert resumed["model_source"].startswith("resumed from") and resumed["schedule"]["steps_done"] == 12
    whole = adapters_of(tmp_path / "whole" / "checkpoints" / "epoch-4")
    again = adapters_of(tmp_path / "killed" / "checkpoints" / "epoch-4")
    assert_same_weights(whole, again, atol=1e-6)
    assert any(tensor.abs().sum() > 0 for name, tensor in whole.items() if ".lora_B." in name)  # they trained
    state = torch.load(tmp_path / "killed" / "checkpoints" / "step-8" / "trainer_state.pt", weights_only=True)
    assert set(state["optimizer"]["state"]) == set(whole)  # the optimizer holds the adapters alone


@pytest.mark.slow  # eight interpreted AdamW steps and a run before them
def test_a_run_on_torchs_adamw_resumes_on_cflibs_kernel(tmp_path, shard):
    """cflib_adamw keeps torch's optimizer state: a checkpoint of a run stepped by torch's AdamW resumes on cflib's
    kernel (Triton's interpreter on a CPU) and ends where the uninterrupted run ends."""
    device = KERNEL_DEVICE.type
    train(params(shard, tmp_path / "whole", epochs=4, save_total_limit=None, device=device), progress=False)
    kept = shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-8", tmp_path / "step-8")
    resumed = train(params(shard, tmp_path / "resumed", epochs=4, resume=str(kept), device=device,
                           kernel_overrides={"cflib_adamw": "true"}), progress=False)
    assert resumed["kernel_path"]["optimizer"] == "cflib_triton"
    weights = lambda d: load_checkpoint(d / "checkpoints" / "epoch-4").state_dict()  # noqa: E731
    # on a GPU the uninterrupted run steps with torch's fused kernel, which rounds its FP64 scalars differently
    assert_same_weights(weights(tmp_path / "whole"), weights(tmp_path / "resumed"),
                        atol=1e-6 if device == "cpu" else 1e-5)


def masks_drawn_from(rank_states: list[dict]) -> list[torch.Tensor]:
    """The dropout mask each rank's saved CPU state draws next for one same-shaped input: what its next step's LoRA
    dropout (cflib.model.lora.dropout_input) draws first."""
    masks = []
    with torch.random.fork_rng(devices=[]):
        for state in rank_states:
            torch.set_rng_state(state["torch"])
            masks.append(torch.nn.functional.dropout(torch.ones(64, 64), 0.5, training=True) != 0)
    return masks


def assert_ranks_draw_their_own(checkpoint: Path) -> None:
    states = torch.load(checkpoint / "trainer_state.pt", weights_only=True)["rank_rng"]
    assert len(states) == 2
    assert not torch.equal(states[0]["torch"], states[1]["torch"]), "both ranks hold one random state"
    first, second = masks_drawn_from(states)
    assert not torch.equal(first, second), "both ranks draw the same dropout mask"


@pytest.fixture(scope="module")
def one_example(tmp_path_factory) -> Path:
    """16 copies of one example: every micro-batch of every rank has one shape and one content, so the ranks'
    random states after a step differ only where they started apart (a layer that sees the supervised tokens alone
    would otherwise draw as many numbers as its batch has of them)."""
    from sft_shard_helpers import CHATS, chat_example

    return write_shard(tmp_path_factory.mktemp("one_example"), [chat_example(i, *CHATS[3]) for i in range(16)])


def dropout_run(shard: Path, base: Path, out_dir: Path, **overrides) -> dict:
    # 16 examples, 4 per step: 4 steps an epoch, a resumable checkpoint after each of the 3.
    return params(shard, out_dir, init_checkpoint=str(base), full_parameter=False, lora_rank=4, lora_dropout=0.1,
                  lr=1e-2, micro_batch_per_rank=2, global_batch=4, max_steps=3, save_every_steps=1,
                  save_total_limit=None, eval_at_start=False, **overrides)


def test_each_rank_s_generators_take_a_stream_of_their_own():
    """One seed per (seed, rank, step), none of them NEFTune's: no two ranks, and no resume of a rank that kept no
    state, share a stream."""
    from cflib.model.neftune import noise_seed
    from cflib.train.trainer import rank_seed

    keys = [(seed, rank, step) for seed in (0, 1) for rank in range(4) for step in (0, 8)]
    seeds = {rank_seed(*key) for key in keys}
    assert len(seeds) == len(keys) and not seeds & {noise_seed(*key) for key in keys}
    assert rank_seed(0, 1) == rank_seed(0, 1, 0)


@pytest.mark.parametrize(("every_rank", "world", "rank", "own"), [
    (True, 2, 1, 1), (True, 4, 1, None), (True, 1, 0, None), (False, 2, 0, 0), (False, 2, 1, None),
    (False, 1, 0, None)],
    ids=["same-world", "more-processes", "fewer-processes", "old-rank-0", "old-rank-1", "old-other-world"])
def test_a_resumed_rank_takes_back_its_own_random_state_and_never_another_s(every_rank, world, rank, own):
    """A rank takes back the state a two-process checkpoint kept of it (every rank's, or rank 0's alone in one
    written before they were kept); where it kept none of this rank's (None), the rank reseeds from seed, rank and
    step (Trainer._restore) rather than taking another rank's."""
    from types import SimpleNamespace

    from cflib.train.trainer import Trainer

    states = [{"torch": torch.tensor([index], dtype=torch.uint8), "cuda": None} for index in range(2)]
    state = {"world_size": 2, "torch_rng": states[0]["torch"], "cuda_rng": None,
             "rank_rng": states if every_rank else None}
    trainer = Trainer.__new__(Trainer)
    trainer.dist = SimpleNamespace(rank=rank, world_size=world)
    found = trainer._own_random_state(state)
    assert (None if found is None else int(found["torch"][0])) == own


@pytest.mark.slow  # torchrun, twice
def test_two_ranks_draw_their_own_masks_and_noise_and_resume_to_the_uninterrupted_adapters(tmp_path, one_example,
                                                                                         base):
    """Under torchrun each rank seeds its generators from the seed and its rank once the model and its adapters are
    built (drawn alike on every rank): after step 1 on the same batches the ranks' states differ, and so do the
    dropout masks they draw next and their NEFTune generators. A checkpoint keeps every rank's states and a resume
    gives each its own back (with one rank's alone, the other's masks and noise, and so the adapters, drift apart)."""
    two = {"nproc_per_node": 2, "neftune_noise_alpha": 5.0}
    train(dropout_run(one_example, base, tmp_path / "whole", **two), progress=False)
    kept = shutil.copytree(tmp_path / "whole" / "checkpoints" / "step-1", tmp_path / "step-1")
    assert_ranks_draw_their_own(kept)
    noise = [rank["neftune"] for rank in torch.load(kept / "trainer_state.pt", weights_only=True)["rank_rng"]]
    assert not torch.equal(*noise), "both ranks hold one NEFTune generator state"
    train(dropout_run(one_example, base, tmp_path / "resumed", resume=str(kept), **two), progress=False)
    assert_same_weights(adapters_of(tmp_path / "whole" / "checkpoints" / "last"),
                        adapters_of(tmp_path / "resumed" / "checkpoints" / "last"), atol=1e-6)


@pytest.mark.slow
def test_a_resume_on_more_processes_gives_each_rank_a_random_state_of_its_own(tmp_path, one_example, base):
    """A one-process checkpoint holds one rank's random state: resumed on two processes, each rank reseeds from the
    seed, its rank and the step rather than both taking that one, so their masks differ after the resume too."""
    train(dropout_run(one_example, base, tmp_path / "one"), progress=False)
    kept = shutil.copytree(tmp_path / "one" / "checkpoints" / "step-1", tmp_path / "step-1")
    assert torch.load(kept / "trainer_state.pt", weights_only=True)["world_size"] == 1
    train(dropout_run(one_example, base, tmp_path / "two", resume=str(kept), nproc_per_node=2,
                      allow_world_size_change=True), progress=False)
    assert_ranks_draw_their_own(tmp_path / "two" / "checkpoints" / "step-2")
