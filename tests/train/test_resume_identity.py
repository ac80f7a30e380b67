"""Resume checks what it continues: the data (its manifest's hashes, not only its example count) and every
setting that changes the trajectory, refused by name unless allowed on purpose; a copied run folder deletes
nothing in the folder it was copied from; a truncated trainer state is named."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from sft_shard_helpers import write_shard

from cflib.data.tasks import generate
from cflib.model.checkpoint import CheckpointError
from cflib.train import prepare, train
from cflib.train.params import ParamError, TrainParams
from cflib.train.records import read_metrics


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, Path]:
    train_examples, eval_examples = generate(seed=2)
    root = tmp_path_factory.mktemp("shards")
    return {"a": write_shard(root / "a", train_examples[:16], eval_examples[:4], max_seq_len=64),
            # Another data set of exactly the same size: the example count alone cannot tell them apart.
            "b": write_shard(root / "b", train_examples[16:32], eval_examples[:4], max_seq_len=64)}


def params(shard: Path, out_dir: Path, **overrides) -> dict:
    return {"model": "smoke", "data": str(shard), "out_dir": str(out_dir), "seq_len": 64, "micro_batch_per_rank": 4,
            "global_batch": 8, "max_steps": 6, "lr": 3e-3, "exact_match_limit": 0, "device": "cpu",
            "eval_at_start": False, "save_every_steps": 2, **overrides}


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def killed(shards, tmp_path_factory) -> Path:
    """A run that stopped after its step-4 checkpoint (its COMPLETE removed, as if killed)."""
    out_dir = tmp_path_factory.mktemp("killed") / "run"
    train(params(shards["a"], out_dir), progress=False)
    (out_dir / "COMPLETE").unlink()
    return out_dir


@pytest.mark.parametrize("change, words", [
    ({"data": "b"}, ["other data", "train partition", "manifest's hashes", "allow_resume_changes: data"]),
    ({"model": "quickstart"}, ["model preset smoke", "preset quickstart", "allow_resume_changes: model"]),
    ({"max_grad_norm": 0.5}, ["max_grad_norm 1.0", "has 0.5", "allow_resume_changes: max_grad_norm"]),
    ({"loss_chunk_tokens": 256}, ["loss_chunk_tokens 1024", "has 256"]),
    ({"fp32_loss": False}, ["fp32_loss True", "has False"]),
    ({"lr": 1e-3}, ["lr 0.003", "has 0.001"]),
    ({"seed": 1}, ["seed 0", "has 1", "same stream and schedule"]),
    ({"greater_is_better": True}, ["greater_is_better None", "has True", "allow_resume_changes: greater_is_better"]),
    ({"lr_schedule": "linear"}, ["lr_schedule cosine", "has linear", "same stream and schedule"]),
    ({"min_lr_ratio": 0.1}, ["min_lr_ratio 0.0", "has 0.1", "same stream and schedule"]),
    ({"warmup_steps": 2}, ["warmup_steps 1", "has 2", "(from warmup_steps, or warmup_ratio and the total steps)"]),
    ({"neftune_noise_alpha": 5.0}, ["neftune_noise_alpha None", "has 5.0",
                                    "allow_resume_changes: neftune_noise_alpha"]),
    ({"overlong_examples": "drop"}, ["overlong_examples error", "has drop", "same stream and schedule"]),
    ({"adam_epsilon": 1e-6}, ["adam_epsilon 1e-08", "has 1e-06", "allow_resume_changes: adam_epsilon"]),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2}},
     ["rope_scaling None", "has {'rope_type': 'linear', 'factor': 2.0, 'original_max_position_embeddings': 256}",
      "allow_resume_changes: rope_scaling"]),
    ({"rope_theta": 5e5}, ["rope_theta 10000.0", "has 500000.0", "allow_resume_changes: rope_theta"]),
    ({"optimizer": "muon"}, ["optimizer adamw", "has muon", "optimizer state is adamw's", "muon cannot continue"]),
    ({"embedding_lr_multiplier": 2.0}, ["embedding_lr_multiplier 1.0", "has 2.0", "optimizer's parameter groups"]),
    ({"loss_type": "dft"}, ["loss_type sft_cross_entropy", "has dft", "allow_resume_changes: loss_type"]),
    ({"frozen_modules": "experts", "frozen_layers": "0"}, ["frozen_modules None", "has ['experts']",
                                                           "optimizer's parameter groups"]),
    ({"allow_resume_changes": "bogus"}, ["allow_resume_changes", "'bogus'"]),
    ({"allow_resume_changes": "seed", "seed": 1}, ["allow_resume_changes", "'seed' cannot be allowed"]),
], ids=["other-shard-same-count", "model", "max-grad-norm", "loss-chunk-tokens", "fp32-loss", "lr", "seed",
        "greater-is-better", "lr-schedule", "min-lr-ratio", "warmup-steps", "neftune", "overlong-examples",
        "adam-epsilon", "rope-scaling", "rope-theta", "optimizer", "embedding-lr-multiplier", "loss-type",
        "frozen-modules", "unknown-allowance",
        "stream-not-allowable"])
def test_resume_refuses_what_it_would_not_continue_and_touches_nothing(killed, shards, change, words):
    before = digest(killed)
    change = {**change, "data": str(shards[change["data"]])} if "data" in change else change
    with pytest.raises(ParamError) as caught:
        train({**params(shards["a"], killed, resume="latest"), **change}, progress=False)
    for word in words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    assert "step-4" in str(caught.value) or "allow_resume_changes" in str(caught.value)
    assert digest(killed) == before


@pytest.mark.parametrize("change", [{"max_grad_norm": 0.5, "allow_resume_changes": "max_grad_norm"},
                                    {"data": "b", "allow_resume_changes": ["data"]},
                                    {"neftune_noise_alpha": 5.0, "allow_resume_changes": "neftune_noise_alpha"},
                                    {"neftune_noise_alpha": 0},
                                    {"loss_type": "dft", "allow_resume_changes": "loss_type"}],
                         ids=["max-grad-norm", "data", "neftune", "neftune-0", "dft"])
def test_a_change_allowed_on_purpose_resumes(killed, shards, tmp_path, change):
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    change = {**change, "data": str(shards[change["data"]])} if "data" in change else change
    record = train({**params(shards["a"], copy, resume="latest"), **change}, progress=False)
    assert record["schedule"]["steps_done"] == 6 and "step-4" in record["model_source"]
    if change.get("loss_type") == "dft":  # DFT trained steps 5 and 6, on the chunked loss off cflib's kernels
        assert record["params"]["loss_type"] == "dft" and record["kernel_path"]["loss"] == "torch_chunked_linear_dft"
        assert record["execution_plan"]["reasons"]["loss_type"].startswith("dft runs on the chunked PyTorch loss")


@pytest.fixture(scope="module")
def scored(shards, tmp_path_factory) -> Path:
    """A run whose best/ exact match over 2 held-out prompts chooses, stopped after its step-4 checkpoint (its
    evaluations of steps 2 and 4 scored)."""
    out_dir = tmp_path_factory.mktemp("scored") / "run"
    train(params(shards["a"], out_dir, exact_match_limit=2, best_metric="exact_match"), progress=False)
    (out_dir / "COMPLETE").unlink()
    return out_dir


def rewrite_state(folder: Path, change) -> None:
    """The step-4 checkpoint's trainer state as `change` rewrites it (a checkpoint another version wrote)."""
    path = folder / "checkpoints" / "step-4" / "trainer_state.pt"
    torch.save(change(torch.load(path, weights_only=True)), path)


def resumed_state(folder: Path) -> dict:
    return torch.load(folder / "checkpoints" / "epoch-3" / "trainer_state.pt", weights_only=True)


def test_an_answer_scoring_best_metric_resumes_only_over_the_prompts_it_scored(scored, shards, tmp_path):
    """best_metric exact_match compares the best so far (and early stopping its count) with each new score: over
    another exact_match_limit's prompts, or another choice of as many, the resume is refused before step 1 unless
    allowed; allowed, the checkpoints from then on record the new prompts."""
    copy = tmp_path / "run"
    shutil.copytree(scored, copy)
    before = digest(copy)
    resume = params(shards["a"], copy, resume="latest", exact_match_limit=2, best_metric="exact_match")
    with pytest.raises(ParamError) as caught:
        train({**resume, "exact_match_limit": 3}, progress=False)
    for word in ["step-4 was written with exact_match_limit 2 (2 held-out prompts scored), this run has 3 (3)",
                 "best_metric 'exact_match'", "resume with exact_match_limit 2",
                 "allow_resume_changes: exact_match_limit"]:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"
    assert digest(copy) == before
    # As many prompts, chosen otherwise (as before each task's were taken in turn): refused as well.
    rewrite_state(copy, lambda state: {**state, "exact_match_prompts": {"count": 2, "sha256": "0" * 64}})
    with pytest.raises(ParamError, match=r"scored 2 held-out prompts \(exact_match_limit 2\), this run's "
                                         r"exact_match_limit 2 chooses 2 others .*; set allow_resume_changes: "
                                         r"exact_match_limit"):
        train(resume, progress=False)
    record = train({**resume, "exact_match_limit": 3, "allow_resume_changes": "exact_match_limit",
                    "save_optimizer_state": True}, progress=False)
    assert record["schedule"]["steps_done"] == 6
    state = resumed_state(copy)
    assert state["exact_match_limit"] == 3 and state["exact_match_prompts"]["count"] == 3


def test_exact_match_limit_feeding_no_best_metric_is_only_recorded(killed, shards):
    """With best_metric eval_loss, exact match's prompts compare with nothing: another limit resumes."""
    run = prepare(TrainParams.from_dict(params(shards["a"], killed, resume="latest", exact_match_limit=2)))
    assert run.params.exact_match_limit == 2 and run.resume_state["step"] == 4


def test_a_checkpoint_that_recorded_no_prompts_resumes_saying_its_scores_may_be_over_others(scored, shards, tmp_path):
    """A checkpoint written before the prompts were recorded (an older exact_match_limit, or the older choice of the
    first prompts in file order, unknown): it resumes, and says its earlier scores are compared as if over this
    run's prompts, which its checkpoints then record."""
    copy = tmp_path / "run"
    shutil.copytree(scored, copy)
    rewrite_state(copy, lambda state: {k: v for k, v in state.items()
                                       if k not in ("exact_match_prompts", "exact_match_limit")})
    resume = params(shards["a"], copy, resume="latest", exact_match_limit=3, best_metric="exact_match",
                    save_optimizer_state=True)
    with pytest.warns(UserWarning, match=r"step-4 at step 4: its checkpoint does not record which held-out prompts "
                                         r"exact match scored, so best_metric 'exact_match' and early stopping "
                                         r"compare its scores of steps 2, 4, best/ holding .* \(exact_match_limit 3\) "
                                         r"as if they were the same prompts\. To keep them comparable, resume with "
                                         r"the exact_match_limit that run used; or start a new run from this "
                                         r"checkpoint \(init_checkpoint\) to compare over one set\. Checkpoints "
                                         r"from here on record the prompts\.$") as said:
        record = train(resume, progress=False)
    assert not any("before" in str(w.message) or "file order" in str(w.message) for w in said)  # the product's terms
    assert record["schedule"]["steps_done"] == 6
    assert resumed_state(copy)["exact_match_prompts"]["count"] == 3


def test_a_checkpoint_written_before_schedules_could_be_chosen_resumes_as_the_cosine_it_trained(killed, shards,
                                                                                               tmp_path):
    """Its trainer state names no lr_schedule, min_lr_ratio or lr_decay_ratio: it trained the released cosine to 0,
    which this run continues (the same warm-up, here named in steps); another schedule is refused by name."""
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    rewrite_state(copy, lambda state: {k: v for k, v in state.items()
                                       if k not in ("lr_schedule", "min_lr_ratio", "lr_decay_ratio")})
    run = prepare(TrainParams.from_dict(params(shards["a"], copy, resume="latest", warmup_steps=1)))
    assert run.resume_state["step"] == 4 and run.schedule.name == "cosine" and run.warmup_steps == 1
    with pytest.raises(ParamError, match=r"written with lr_schedule cosine, this run has wsd"):
        prepare(TrainParams.from_dict(params(shards["a"], copy, resume="latest", lr_schedule="wsd",
                                             lr_decay_ratio=0.5)))


def test_a_checkpoint_written_before_adam_epsilon_and_lora_plus_resumes_as_the_defaults_it_trained(killed, shards,
                                                                                                    tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    rewrite_state(copy, lambda state: {k: v for k, v in state.items() if k not in ("adam_epsilon", "lora_plus_ratio")})
    assert prepare(TrainParams.from_dict(params(shards["a"], copy, resume="latest"))).resume_state["step"] == 4
    with pytest.raises(ParamError, match=r"written with adam_epsilon 1e-08, this run has 1e-05"):
        prepare(TrainParams.from_dict(params(shards["a"], copy, resume="latest", adam_epsilon=1e-5)))


def test_optimizer_settings_changed_on_purpose_apply_from_the_resumed_step(killed, shards, tmp_path):
    """The checkpoint's optimizer state holds the old rate, decay and betas (and the schedule its base rates):
    what allow_resume_changes lets through must be what the resumed steps use, and what the record says."""
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    before = {row["step"]: row["lr"] for row in read_metrics(killed / "metrics.jsonl") if row["event"] == "train"}
    record = train({**params(shards["a"], copy, resume="latest"), "lr": 1e-2, "weight_decay": 0.5, "beta2": 0.9,
                    "adam_epsilon": 1e-6, "allow_resume_changes": ["lr", "weight_decay", "beta2", "adam_epsilon"],
                    "save_optimizer_state": True}, progress=False)
    after = {row["step"]: row["lr"] for row in read_metrics(copy / "metrics.jsonl") if row["event"] == "train"}
    assert [after[step] for step in (1, 2, 3, 4)] == [before[step] for step in (1, 2, 3, 4)]  # kept from the kill
    assert [after[step] for step in (5, 6)] == pytest.approx([before[step] * 1e-2 / 3e-3 for step in (5, 6)])
    groups = record["optimizer_groups"]
    assert {group["lr"] for group in groups} == {1e-2}
    assert {group["weight_decay"] for group in groups} == {0.0, 0.5}  # norms and embeddings decay nothing
    assert {group["eps"] for group in groups} == {1e-6}
    resumed = torch.load(copy / "checkpoints" / "epoch-3" / "trainer_state.pt", weights_only=True)
    assert {tuple(group["betas"]) for group in resumed["optimizer"]["param_groups"]} == {(0.9, 0.9)}
    assert {group["eps"] for group in resumed["optimizer"]["param_groups"]} == {1e-6}


def test_another_folder_s_checkpoint_continues_only_into_a_folder_without_a_run_of_its_own(killed, shards, tmp_path):
    """Continued in a folder that trained a run of its own, the two histories would interleave (its metrics, the
    other's checkpoints in the record); into a new folder the record lists only the checkpoints that folder holds."""
    foreign = str(killed / "checkpoints" / "step-4")
    own = tmp_path / "own"
    train(params(shards["a"], own, max_steps=2), progress=False)
    (own / "COMPLETE").unlink()  # as if killed
    before = digest(own)
    with pytest.raises(ParamError, match=r"resume .*step-4 is a checkpoint of another folder, but out_dir .*own "
                                         r"holds a run that trained"):
        train(params(shards["a"], own, resume=foreign), progress=False)
    assert digest(own) == before
    record = train(params(shards["a"], tmp_path / "new", resume=foreign), progress=False)
    assert "step-4" in record["model_source"] and record["schedule"]["steps_done"] == 6
    listed = {name: Path(path) for name, path in record["checkpoints"].items() if name != "best_step"}
    assert listed and all(path.is_dir() and path.parent == tmp_path / "new" / "checkpoints" for path in listed.values())


def test_a_resumed_run_s_times_cover_its_every_part(killed, shards, tmp_path):
    """train_s, eval_s, checkpoint_s and wall_s add the parts before the checkpoint resumed from to this
    process's; its steady-state throughput leaves out this process's own first steps, as a fresh run's."""
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    saved = torch.load(copy / "checkpoints" / "step-4" / "trainer_state.pt", weights_only=True)["timing"]
    record = train(params(shards["a"], copy, resume="latest"), progress=False)
    timing = record["timing"]
    assert saved["wall_s"] > saved["train_s"] > 0
    assert timing["wall_s"] > saved["wall_s"] and timing["train_s"] > saved["train_s"]
    assert timing["wall_s"] >= timing["train_s"] + timing["eval_s"] + timing["checkpoint_s"] - saved["wall_s"] * 0.01
    assert record["throughput"]["timed_steps"] == 2 - record["timing_protocol"]["warmup_steps_excluded"] == 1


def test_a_copied_run_folder_deletes_nothing_in_the_original(shards, tmp_path):
    original = tmp_path / "original"
    run = params(shards["a"], original, save_every_steps=1, save_total_limit=2)
    train(run, progress=False)
    (original / "COMPLETE").unlink()  # as if killed before its end
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    before = digest(original)
    record = train({**run, "out_dir": str(copy), "resume": "latest"}, progress=False)
    assert digest(original) == before  # the copy's pruning stayed in the copy
    assert all(str(copy) in path for name, path in record["checkpoints"].items() if name != "best_step")


def test_a_truncated_trainer_state_is_named(killed, shards, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    state = copy / "checkpoints" / "step-4" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    before = digest(copy)
    with pytest.raises(CheckpointError, match=r"step-4/trainer_state.pt: not a readable trainer state \(truncated"):
        train(params(shards["a"], copy, resume="latest"), progress=False)
    assert digest(copy) == before


class RunsCode:
    """What a hostile trainer_state.pt holds: an object whose unpickling would run a command."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/cflib-trainer-state-ran",))


def test_a_trainer_state_holding_code_is_refused_without_advice_to_load_it_anyway(killed, shards, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    state = copy / "checkpoints" / "step-4" / "trainer_state.pt"
    torch.save({**torch.load(state, weights_only=True), "payload": RunsCode()}, state)
    before = digest(copy)
    with pytest.raises(CheckpointError) as caught:
        train(params(shards["a"], copy, resume="latest"), progress=False)
    assert "step-4/trainer_state.pt: refused: it holds Python objects other than tensors" in str(caught.value)
    assert "weights_only" not in str(caught.value) and caught.value.__cause__ is None
    assert digest(copy) == before and not Path("/tmp/cflib-trainer-state-ran").exists()


def test_a_metrics_line_cut_off_by_the_kill_is_dropped_on_resume(killed, shards, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(killed, copy)
    with open(copy / "metrics.jsonl", "a") as log:
        log.write('{"event": "train", "step": 5, "lo')  # the append the kill interrupted
    record = train(params(shards["a"], copy, resume="latest"), progress=False)
    assert record["schedule"]["steps_done"] == 6
    steps = [row["step"] for row in read_metrics(copy / "metrics.jsonl") if row["event"] == "train"]
    assert steps == list(range(1, 7))  # every step once, the cut-off row gone


def test_a_corrupt_metrics_line_is_named(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON row"):
        read_metrics(log)
