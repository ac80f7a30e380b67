"""The training loop: epochs of optimizer steps, evaluation and checkpoints on schedule, early stopping,
trackers, the record.

`Trainer(run).fit()` trains a prepared `Run` (cflib.train.run) in this process; under torchrun each worker
builds its own. Each optimizer step is its `TrainingStep` (cflib.train.step); the loop keeps the run's books
(steps, evaluations, checkpoints, timings, non-finite steps in a row) and writes them into record.json through a
plain `RunSummary` (cflib.train.records).
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from cflib.atomic import clean_leftovers, is_out_of_space, live_path, write_json_atomic, write_text_atomic
from cflib.data import load_tokenizer, shard_chat_template_sha256, shard_tokenizer_spec
from cflib.errors import ParamError
from cflib.model.checkpoint import CheckpointError, checkpoint_step, save_checkpoint
from cflib.model.lora import describe as describe_lora
from cflib.model.neftune import noise_seed
from cflib.progress import tqdm
from cflib.seeds import stream_seed
from cflib.train.collector import steady_collector
from cflib.train.execution import kernels_requested
from cflib.train.best_metric import ANSWER_METRICS, answer_scores, evaluations_without_improvement
from cflib.train.held_out import answer_texts, eval_loss, exact_match, scored_examples
from cflib.train.lock import RunLock
from cflib.train.optim import describe_groups
from cflib.train.records import MetricsLog, RunSummary, count_parameters, train_record
from cflib.train.registered import describe_registered
from cflib.train.run import RUN_JSON_FILES, Run, recheck_out_dir, schedule_signature
from cflib.train.run_folder import remove_dead_launch_dirs
from cflib.train.step import StepResult, TrainingStep, synchronize
from cflib.train.task_scores import TaskScorer
from cflib.train.trackers import open_trackers


# An evaluation's key for what is left to do after its checkpoint (scores, metrics row, best/): in the books of the
# checkpoint it writes, which are saved before it is done; a run resumed from that checkpoint finishes it, taking
# what its metrics row already holds.
UNFINISHED = "unfinished"
SCORE_KEYS = ("lm_eval", "lm_eval_higher_is_better", "lm_eval_seconds")  # what scoring eval_tasks adds
# The stream of each rank's torch generators among the run's seeded streams: a constant of its own, so that it
# coincides with none of them (NEFTune's generator: cflib.model.neftune.NOISE_STREAM).
RANK_STREAM = 0x5241_4E4B  # "RANK"


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of `rank`'s torch generators in a run of `seed`, from `step` (0: the run's start; a resume that finds
    no state of this rank's own starts a stream of its own at its step): each rank its own stream, so that dropout
    draws other masks on each."""
    return stream_seed(seed, rank, step, RANK_STREAM)


def seed_rank_generators(seed: int, rank: int, step: int = 0) -> None:
    """This process's torch generators, the CPU's and every CUDA device's (LoRA dropout's masks), seeded for `rank`
    (rank_seed). prepare() seeds them from `seed` alone first, so that a preset's weights and fresh adapters are
    drawn alike on every rank; the trainer calls this once they are built."""
    torch.manual_seed(rank_seed(seed, rank, step))


class Trainer:
    def __init__(self, run: Run, progress: bool = True) -> None:
        if run.launches_workers:
            raise ParamError("this parameter set runs on several processes: use cflib.train.launch.fit(run), "
                             "which starts torchrun")
        self.run, self.params, self.device, self.model = run, run.params, run.device, run.model
        self.dist = run.dist
        self.progress = progress and self.dist.is_main
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the record's peak is this run's alone
        self.training_step = TrainingStep(run)
        self.metrics = MetricsLog(run.out_dir / "metrics.jsonl")  # appends only once fit() writes
        self.step = 0
        self.evals: list[dict] = []
        self.checkpoints: dict[str, str] = {}
        self.best_loss = math.inf  # the lowest held-out loss after step 0
        self.best_metric = self.params.best()
        self.best_value: float | None = None  # the best_metric of the evaluation best/ holds
        self.timing = {"train_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0, "wall_s": 0.0}  # over every process
        self.started = time.perf_counter()  # this process's part of wall_s counts from here
        self.steady = {"tokens": 0, "supervised_tokens": 0, "seconds": 0.0, "steps": 0}
        self.fill_ins: list[int] = []
        self.bad_steps = 0  # consecutive non-finite steps
        self.position = (0, 0)  # (epoch, global batches done in it)
        self.random_states: tuple[int, list[dict]] | None = None  # (step, every rank's): _gather_random_states
        weights = run.loss_weights
        self.trained_mass = np.zeros(len(weights.cells)) if weights else None  # weighted tokens per cell, consumed
        if run.resume_state is not None:
            self._restore(run.resume_state)
        else:  # the model and its adapters are built, alike on every rank: from here each rank draws its own
            seed_rank_generators(self.params.seed, self.dist.rank)
        self.decode, self.scorer = self._answers_and_tasks()
        # The first steps of each process pay for allocator growth and kernel selection: not steady state.
        self.warmup_exclude = min(3, max(run.total_steps // 5, 0))
        self.first_step = self.step  # the step this process starts after (a resumed run's checkpoint)

    def _restore(self, state: dict) -> None:
        saved, optimizer, scheduler = state["optimizer"], self.training_step.optimizer, self.training_step.scheduler
        # The saved state carries the groups' settings and the schedule's base rates as well as the moments: this
        # run's own (the same, or changed on purpose through allow_resume_changes) are put back over them.
        settings = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
        if saved["param_groups"] and saved["param_groups"][0]["params"] and isinstance(
                saved["param_groups"][0]["params"][0], int):
            optimizer.load_state_dict(saved)  # written before optimizer state was keyed by parameter name
        else:  # keyed by parameter name, whole: any strategy (single, DDP, FSDP shards) takes its part
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
        scheduler.load_state_dict(state["scheduler"])
        for group, own in zip(optimizer.param_groups, settings):
            group.update(own)
        scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)  # LambdaLR's rate at the step resumed from
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
        self.step, self.position = state["step"], (state["epoch"], state["batch_in_epoch"])
        self.evals, self.fill_ins = state["evals"], state["fill_ins"]
        # An evaluation the checkpoint holds may not have reached best_loss before a kill: derived from them all.
        self.best_loss = min((result["loss"] for result in self.evals if result["step"] > 0), default=math.inf)
        self.checkpoints = self._rooted(state["checkpoints"])
        self.timing = {"wall_s": 0.0, **state["timing"]}  # wall_s: the parts before, up to this checkpoint
        self._restore_best()
        self._warn_unrecorded_prompts(state)
        if self.trained_mass is not None and state.get("trained_mass") is not None:
            self.trained_mass = np.asarray(state["trained_mass"], dtype=np.float64)
        own = self._own_random_state(state)
        if own is None:  # no state of this rank's own kept: a stream of its own from the step resumed from
            seed_rank_generators(self.params.seed, self.dist.rank, self.step)
        else:
            torch.set_rng_state(own["torch"])
            if self.device.type == "cuda":  # dropout's masks on the GPU; a CPU run's checkpoint kept none
                if own.get("cuda") is not None:
                    torch.cuda.set_rng_state(own["cuda"], self.device)
                else:
                    with torch.cuda.device(self.device):
                        torch.cuda.manual_seed(rank_seed(self.params.seed, self.dist.rank, self.step))
        self._restore_noise(own.get("neftune") if own is not None else None)

    def _own_random_state(self, state: dict) -> dict | None:
        """This rank's random state as the checkpoint kept it, so that the resumed steps draw the dropout masks the
        uninterrupted run drew: its entry of every rank's (`rank_rng`), or, in a checkpoint written before those
        were kept, the one state it has where that is this rank's (rank 0 of the same number of processes). None
        where it kept none of this rank's (another number of processes): taking another rank's would give two
        ranks one stream, the same masks."""
        states, same_world = state.get("rank_rng"), state.get("world_size") == self.dist.world_size
        if isinstance(states, list):
            return states[self.dist.rank] if len(states) == self.dist.world_size else None
        if same_world and self.dist.rank == 0:
            return {"torch": state["torch_rng"], "cuda": state.get("cuda_rng")}
        return None

    def _restore_noise(self, saved: torch.Tensor | None) -> None:
        """NEFTune's generator as the checkpoint kept it for this rank, so that the resumed steps draw the noise the
        uninterrupted run drew; one that kept none (trained without NEFTune, or by another number of processes)
        starts this rank's stream of its own at the step resumed from (cflib.model.neftune.noise_seed)."""
        generator = self.training_step.noise.generator if self.training_step.noise is not None else None
        if generator is None:
            return
        if saved is not None:
            generator.set_state(saved)
        else:
            generator.manual_seed(noise_seed(self.params.seed, self.dist.rank, self.step))

    def _warn_unrecorded_prompts(self, state: dict) -> None:
        """A checkpoint written before checkpoints recorded which held-out prompts exact match scores
        (cflib.train.resume_identity) cannot show that its answer scores were over this run's: where best_metric
        compares with them, said once, before step 1. Refusing would strand every such run; forgetting its scores
        would let a worse checkpoint replace best/. This run's checkpoints record the prompts."""
        if "exact_match_prompts" in state or not self.best_metric.needs_answers or not self.dist.is_main:
            return
        scored = [r["step"] for r in self.evals if r["step"] > 0 and self.best_metric.value(r) is not None]
        if not scored:
            return
        best = "" if self.best_value is None else f", best/ holding {self.best_value:g} of step " \
                                                   f"{self.checkpoints['best_step']}"
        warnings.warn(
            f"{self.run.model_source}: its checkpoint does not record which held-out prompts exact match scored, so "
            f"best_metric {self.best_metric.name!r} and early stopping compare its scores of steps "
            f"{', '.join(map(str, scored))}{best} with scores over this run's prompts (exact_match_limit "
            f"{self.params.exact_match_limit}) as if they were the same prompts. To keep them comparable, resume "
            "with the exact_match_limit that run used; or start a new run from this checkpoint (init_checkpoint) to "
            "compare over one set. Checkpoints from here on record the prompts.",
            stacklevel=2)

    def _gather_random_states(self) -> None:
        """Every rank's random state at this step, for the checkpoints written at it (rank 0 writes them): every
        rank calls it together, after an evaluation and before a step-N save."""
        own = {"torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        if self.training_step.noise is not None:  # NEFTune's generator, this rank's own
            own["neftune"] = self.training_step.noise.generator.get_state()
        self.random_states = (self.step, self.dist.gather(own))

    def _restore_best(self) -> None:
        """The best so far is the evaluation whose weights best/ holds. An evaluation writes its checkpoint, then
        best/ when it improved, so the resumed checkpoint's books can be a save behind best/ (a kill after best/
        was written) or ahead of it (a kill between the two saves): the step best/ was saved at decides."""
        best = self.run.out_dir / "checkpoints" / "best"
        held = live_path(best)  # an interrupted replacement leaves the previous best/ aside (cflib.atomic)
        on_disk = checkpoint_step(held) if self.dist.is_main and held.is_dir() else None
        if on_disk in {result["step"] for result in self.evals}:
            self.checkpoints["best"], self.checkpoints["best_step"] = str(best), str(on_disk)
        best_step = int(self.checkpoints["best_step"]) if "best_step" in self.checkpoints else None
        self.best_value = next((self.best_metric.value(r) for r in self.evals if r["step"] == best_step), None)

    def _rooted(self, saved: dict[str, str]) -> dict[str, str]:
        """Saved checkpoint paths re-rooted in this run's out_dir (the run folder may have been copied or moved),
        those no longer there left out (deleted by hand, or never here: a checkpoint resumed into a new folder)."""
        folder = self.run.out_dir / "checkpoints"
        kept = {name: str(folder / name) for name in saved if name != "best_step" and live_path(folder / name).is_dir()}
        if "best" in kept and "best_step" in saved:
            kept["best_step"] = saved["best_step"]
        return kept

    def _trainer_state(self, optimizer_state: dict, checkpoints: dict[str, str]) -> dict:
        epoch, batch_in_epoch = self.position
        return {"optimizer": optimizer_state, "scheduler": self.training_step.scheduler.state_dict(),
                "step": self.step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                "world_size": self.dist.world_size, "global_batch": self.params.global_batch,
                "seed": self.params.seed, "best_loss": self.best_loss, "evals": self.evals,
                "fill_ins": self.fill_ins, "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
                "rank_rng": self.random_states[1] if self.random_states and self.random_states[0] == self.step
                else None,
                "checkpoints": checkpoints,
                "trained_mass": None if self.trained_mass is None else self.trained_mass.tolist(),
                "timing": self.timing_so_far(), **schedule_signature(self.run)}

    def _answers_and_tasks(self):
        """What turns generated ids into text (answer metrics, log_samples) and the lm-eval scorer
        (eval_tasks_every, rank 0), both checked before step 1."""
        p, shard = self.params, self.run.eval_data
        spec = shard_tokenizer_spec(shard)
        if spec is None and (p.log_samples or self.best_metric.name.split("/")[0] in ANSWER_METRICS):
            raise ParamError(f"{'log_samples' if p.log_samples else 'best_metric'}: the data's index names no "
                             "tokenizer to turn answers into text; convert the data with --tokenizer")
        self._check_best_task(shard)
        decode = load_tokenizer(spec).decode if spec is not None else None
        scorer = None
        if p.eval_tasks_every is not None and self.dist.is_main:
            scorer = TaskScorer(p.eval_task_names(), p.eval_tasks_limit, spec, shard_chat_template_sha256(shard),
                                str(self.device))
        return decode, scorer

    def _check_best_task(self, shard) -> None:
        """best_metric exact_match/<task> names a task exact match decodes: else best/ would never be chosen."""
        name, limit = self.best_metric.name, self.params.exact_match_limit
        task = name.partition("/")[2] if name.startswith("exact_match/") else None
        if task is None or limit == 0:
            return
        scored = sorted({str(shard.rows[int(i)].get("task")) for i in scored_examples(shard, limit)})
        if task not in scored:
            decoded = "every held-out example" if limit is None else f"{limit} held-out examples, the tasks in turn"
            raise ParamError(f"best_metric {name!r}: exact match decodes no example of task {task!r} ({decoded}, of "
                             f"tasks {', '.join(scored) or 'none'}), so best/ would never be chosen; name one of "
                             "those tasks, or raise exact_match_limit")

    # --- evaluation and checkpoints -------------------------------------------------
    @property
    def evaluates(self) -> bool:
        """Rank 0 evaluates alone, except under FSDP, where every rank holds a shard of each forward."""
        return self.dist.is_main or self.run.strategy == "fsdp"

    def evaluate(self, tag: str, epoch: int, with_exact_match: bool) -> dict:
        """Held-out loss; exact match, the registered answer metrics and log_samples' file where asked (or
        best_metric needs them). Logged by `log_evaluation`, once lm-eval's scores may have joined it."""
        p = self.params
        synchronize(self.device)
        start = time.perf_counter()
        result = {"tag": tag, "step": self.step, "epoch": epoch}
        result.update(eval_loss(self.model, self.run.eval_data, p.eval_micro_batch or p.micro_batch_per_rank,
                                self.device, p.bf16, p.loss_chunk_tokens, p.fp32_loss))
        if (with_exact_match or self.best_metric.needs_answers or p.log_samples) and p.exact_match_limit != 0:
            matched = exact_match(self.model, self.run.eval_data, p.bf16, p.exact_match_limit)
            result.update(exact_match=matched["exact_match"], exact_match_by_group=matched["exact_match_by_group"],
                          exact_match_samples=matched["samples"])
            if "exact_match_by_source" in matched:  # a mixture's sources
                result["exact_match_by_source"] = matched["exact_match_by_source"]
            if self.decode is not None and (ANSWER_METRICS or p.log_samples):
                texts = answer_texts(self.run.eval_data, matched["answers"], self.decode)
                if ANSWER_METRICS:
                    result["metrics"] = answer_scores([(t["task"], t["answer"], t["reference"]) for t in texts])
                if p.log_samples and self.dist.is_main:
                    result["samples_file"] = self._write_samples(tag, texts[:p.log_samples])
        synchronize(self.device)
        result["seconds"] = time.perf_counter() - start
        self.timing["eval_s"] += result["seconds"]
        self.evals.append(result)
        return result

    def _write_samples(self, tag: str, texts: list[dict]) -> str:
        """log_samples' prompts and greedy answers: out_dir/samples/step-<step>-<tag>.jsonl, its path in the
        run folder."""
        name = f"samples/step-{self.step:06d}-{tag}.jsonl"
        path = self.run.out_dir / name
        path.parent.mkdir(exist_ok=True)
        write_text_atomic(path, "".join(json.dumps(text) + "\n" for text in texts))
        return name

    def log_evaluation(self, result: dict) -> None:
        """The evaluation's metrics row (trackers see it) and its line in the output."""
        if not self.dist.is_main:
            return
        self.metrics.write(event="eval", **{k: v for k, v in result.items() if k != "exact_match_samples"})
        summary = f"eval {result['tag']} step {self.step}: loss {result['loss']:.4f}"
        if "exact_match" in result:
            summary += f", exact match {result['exact_match']['overall']:.3f}"
        if "loss_by_source" in result:  # a mixture's sources
            summary += f" ({', '.join(f'{name} {loss:.4f}' for name, loss in result['loss_by_source'].items())})"
        for task, scores in result.get("lm_eval", {}).items():
            summary += "".join(f", {task} {metric} {value:.3f}" for metric, value in scores.items())
        tqdm.write(summary)

    def save(self, name: str, epoch: int, resumable: bool | None = None) -> None:
        """Rank 0 writes; under FSDP every rank first joins in gathering the full weights."""
        if not self.params.save_checkpoints:
            return
        # torch's distributed checkpointing takes half a second to import: a process that saves nothing skips it
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        resumable = self.params.save_optimizer_state if resumable is None else resumable
        start = time.perf_counter()
        weights = optimizer_state = None
        fsdp = self.run.strategy == "fsdp"
        if fsdp:  # every rank joins the gathers; rank 0 receives the whole (a LoRA run's adapters only)
            weights = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.run.lora is not None))
        if resumable and (fsdp or self.dist.is_main):
            # Keyed by parameter name and whole, so a run on another strategy or world size can resume it.
            optimizer_state = get_optimizer_state_dict(self.model, self.training_step.optimizer, options=StateDictOptions(
                full_state_dict=True, cpu_offload=fsdp))
        if self.dist.is_main:
            target = self.run.out_dir / "checkpoints" / name
            # Its books list the checkpoint itself: a run resumed from it keeps it (pruning, eval_tasks scores).
            listed = {**{other: path for other, path in self.checkpoints.items() if other != name}, name: str(target)}
            state = self._trainer_state(optimizer_state, listed) if resumable else None
            progress = {"step": self.step, "epoch": self.position[0], "batch_in_epoch": self.position[1]}
            try:
                # best/ names its step (progress) even when it is not resumable: a resume reads which evaluation
                # it holds.
                progress = progress if resumable or name == "best" else None
                if self.run.lora is not None:  # the adapters, in PEFT's format, naming their base
                    path = self.run.lora.save(self.model, target, weights, state, progress)
                else:
                    path = save_checkpoint(self.model, target, state, weights, progress)
            except Exception as err:  # safetensors and torch wrap the OS error in their own types
                if not is_out_of_space(err):
                    raise
                kept = [p for n, p in self.checkpoints.items() if n != "best_step"]
                raise CheckpointError(f"out of disk space writing checkpoint {target}; it was not written and "
                                      f"the earlier checkpoints are intact: {kept or 'none yet'}") from err
            self.checkpoints.pop(name, None)  # re-inserted last: the dict's order is the saving order
            self.checkpoints[name] = str(path)
            self._prune_checkpoints()
        self.timing["checkpoint_s"] += time.perf_counter() - start

    def _prune_checkpoints(self) -> None:
        """Keep the newest save_total_limit checkpoints; "best" is never pruned."""
        limit = self.params.save_total_limit
        rolling = [name for name in self.checkpoints if name not in ("best", "best_step")]
        for name in rolling[:-limit] if limit else ():
            self.checkpoints.pop(name)
            # By name under this run's own folder: a stored path may point into the folder this one was copied from.
            folder = self.run.out_dir / "checkpoints" / name
            if folder.resolve().parent == (self.run.out_dir / "checkpoints").resolve():
                shutil.rmtree(folder, ignore_errors=True)

    def evaluation_point(self, tag: str, epoch: int, with_exact_match: bool, checkpoint: str | None = None,
                         score_tasks: bool = False) -> None:
        """Evaluate, write the scheduled checkpoint, then finish the evaluation (`finish_evaluation`); then every
        rank goes on together."""
        result = self.evaluate(tag, epoch, with_exact_match) if self.evaluates else None
        self._gather_random_states()  # every rank, for this step's checkpoint and a best/ rank 0 may write
        if result is not None:  # what is left once the checkpoint holds it: a resume finishes it (UNFINISHED)
            result[UNFINISHED] = {"epoch": epoch, "checkpoint": checkpoint, "score_tasks": score_tasks}
        if checkpoint is not None:
            self.save(checkpoint, epoch)
        if result is not None:
            self.finish_evaluation(result)
        self.dist.barrier()

    def finish_evaluation(self, result: dict, resumed: bool = False, kept_rows: Sequence[dict] = ()) -> None:
        """Score eval_tasks on the evaluation's checkpoint (where asked), log its metrics row, keep the best weights
        by best_metric. A run killed after the checkpoint was written runs this on resume, with the weights the
        checkpoint holds, which are the ones evaluated (`resumed`; `kept_rows`: the metrics rows the resume kept):
        what was done already (the row, best/) is not done twice."""
        todo = result.pop(UNFINISHED)
        checkpoint = todo["checkpoint"]
        logged = logged_row(result, kept_rows) if resumed else None
        if logged is not None:  # written before the kill, with the scores: none is run again
            result.update({key: logged[key] for key in SCORE_KEYS if key in logged})
        elif todo["score_tasks"] and self.scorer is not None and checkpoint in self.checkpoints:
            scores = self.scorer.score(Path(self.checkpoints[checkpoint]), self.run.out_dir / "eval_tasks" / checkpoint)
            result.update(scores)
            self.timing["eval_s"] += scores["lm_eval_seconds"]
        if logged is None:
            self.log_evaluation(result)
        if self.step > 0:
            self.best_loss = min(self.best_loss, result["loss"])
        value = self.best_metric.value(result)
        if resumed and self.checkpoints.get("best_step") == str(self.step):
            self.best_value = value  # best/ holds these weights already: its value, scores included
        improved = self.step > 0 and self.best_metric.improves(value, self.best_value)
        if self.run.strategy == "fsdp":  # every rank evaluated, and the save gathers: rank 0 decides
            improved = self.dist.agree(improved)
        if improved:
            self.best_value = value
            self.save("best", todo["epoch"])
            if "best" in self.checkpoints:
                self.checkpoints["best_step"] = str(self.step)

    # --- training -------------------------------------------------------------------
    def train_step(self, step_units: np.ndarray, next_units: np.ndarray | None = None) -> dict:
        """One optimizer step (TrainingStep), and the run's books: its metrics row; more than nan_patience
        non-finite steps in a row stop the run."""
        result = self.training_step(step_units, next_units)
        if result.cell_mass is not None:
            self.trained_mass += result.cell_mass
        self.bad_steps = 0 if result.finite else self.bad_steps + 1
        if self.bad_steps > self.params.nan_patience:
            self._stop_non_finite(result)
        self.step += 1
        self.timing["train_s"] += result.seconds
        if self.step - self.first_step > self.warmup_exclude:
            for key, value in (("tokens", result.tokens), ("supervised_tokens", result.supervised_tokens),
                               ("seconds", result.seconds), ("steps", 1)):
                self.steady[key] += value
        return {"step": self.step, **result.row()}

    def _stop_non_finite(self, result: StepResult) -> None:
        rows = self.run.train_data.rows
        ids = [rows[int(i)].get("example_id", int(i)) for i in result.examples[:8]]
        saved = [path for name, path in self.checkpoints.items() if name != "best_step"]
        last_good = saved[-1] if saved else "none yet"
        raise FloatingPointError(
            f"step {self.step + 1}: loss {result.loss}, gradient norm {result.grad_norm}, after {self.bad_steps} "
            f"non-finite step(s) in a row (nan_patience {self.params.nan_patience}); the optimizer skipped the step, "
            f"so no non-finite weight was written. Batch examples (first 8): {ids}. Last checkpoint: {last_good}")

    def fit(self) -> dict:
        """Train to the end and return the record, under the run folder's lock (rank 0 writes, so rank 0 holds
        it); report_to's trackers (rank 0) see every metrics row."""
        lock = RunLock(self.run.out_dir).acquire() if self.dist.is_main else None
        try:
            if lock is not None:
                recheck_out_dir(self.run)
            self.started = time.perf_counter()
            # Rank 0's folder put right first: the trackers replay the metrics rows it kept, read once.
            kept_rows = self._open_run_folder() if self.dist.is_main else []
            with open_trackers(self.run, self.metrics, self.step, kept_rows, active=self.dist.is_main) as trackers, \
                    steady_collector():
                return trackers.finished(self._fit(kept_rows))
        finally:
            if lock is not None:
                lock.release()

    def _fit(self, kept_rows: list[dict]) -> dict:
        run, p = self.run, self.params
        if self.evaluates:  # an evaluation the resumed checkpoint holds that a kill left half done
            for result in [result for result in self.evals if UNFINISHED in result]:
                self.finish_evaluation(result, resumed=True, kept_rows=kept_rows)
        self.dist.barrier()
        self.model.train()
        last_eval_step = self.evals[-1]["step"] if self.evals else -1
        if run.resume_state is None and (p.eval_at_start or run.total_steps == 0):
            self.evaluation_point("start", 0, with_exact_match=True)
            last_eval_step = 0
        epoch, batches_done = self.position  # the epoch in progress (0 before the first), its batches done
        if 0 < batches_done < run.steps_in_epoch(epoch):
            epoch -= 1  # resumed mid-epoch: the loop below re-enters that epoch where it stopped
        else:
            batches_done = 0
        log_every = max(1, run.total_steps // 10)
        bar = tqdm(total=run.total_steps, initial=self.step, desc="train", unit="step", disable=not self.progress)
        while self.step < run.total_steps:
            epoch += 1
            order, fill_ins = run.epoch_order(epoch)
            if batches_done == 0:
                self.fill_ins.append(fill_ins)
            for batch_start in range(batches_done * p.global_batch, len(order), p.global_batch):
                following = batch_start + p.global_batch
                row = self.train_step(order[batch_start:following],
                                      order[following:following + p.global_batch] if following < len(order) else None)
                self.position = (epoch, batch_start // p.global_batch + 1)
                if self.dist.is_main:
                    self.metrics.write(event="train", epoch=epoch, **row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}")
                if self.step % log_every == 0:  # a text trace too: papermill keeps no live widget state
                    rank = f"[rank {self.dist.rank}] " if self.dist.active else ""
                    self._trace(f"{rank}step {self.step}/{run.total_steps} epoch {epoch} loss {row['loss']:.4f} "
                                f"lr {row['lr']:.2e} {row['tokens'] / row['seconds']:,.0f} tokens/s")
                if self._scheduled_points(epoch, epoch_ended=batch_start + p.global_batch >= len(order)):
                    last_eval_step = self.step
                if self.step >= run.total_steps or self.stopped_early:
                    break
            batches_done = 0
            if self.stopped_early:
                break
        bar.close()
        if last_eval_step != self.step:
            self.evaluation_point("end", epoch, with_exact_match=True, checkpoint="last" if self.step > 0 else None,
                                  score_tasks=p.eval_tasks_every is not None)
        if not self.dist.is_main:
            return {}
        record = self.record(epoch)
        write_json_atomic(run.out_dir / "record.json", record)
        # Written last: its presence says the record and every checkpoint are final.
        write_json_atomic(run.out_dir / "COMPLETE", {"completed_utc": record["created_utc"],
                                                     "steps": self.step})
        return record

    def _trace(self, line: str) -> None:
        """A line of the text trace: above rank 0's bar; on the other ranks, whole in one write, so lines of ranks
        sharing one output (torchrun's) never run into each other."""
        if self.progress:
            tqdm.write(line)
        else:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def _scheduled_points(self, epoch: int, epoch_ended: bool) -> bool:
        """The evaluation and checkpoints due after this step; True when it evaluated."""
        p, total = self.params, self.run.total_steps
        evaluated = True
        every = p.eval_tasks_every
        tasks_due = every == "epoch" and epoch_ended or isinstance(every, int) and self.step % every == 0
        if epoch_ended:
            self.evaluation_point(f"epoch-{epoch}", epoch, with_exact_match=True, checkpoint=f"epoch-{epoch}",
                                  score_tasks=tasks_due)
        elif tasks_due and self.step < total:  # eval_tasks_every: N scores a checkpoint written for it
            self.evaluation_point("periodic", epoch, with_exact_match=True, checkpoint=f"step-{self.step}",
                                  score_tasks=True)
        elif p.eval_every_steps and self.step % p.eval_every_steps == 0 and self.step < total:
            self.evaluation_point("periodic", epoch, with_exact_match=False)
        else:
            evaluated = False
        if p.save_every_steps and self.step % p.save_every_steps == 0 and self.step < total:
            self._gather_random_states()
            self.save(f"step-{self.step}", epoch, resumable=True)
            self.dist.barrier()
        return evaluated

    @property
    def stopped_early(self) -> bool:
        """early_stopping_patience evaluations in a row without a better best_metric (as transformers'
        EarlyStoppingCallback counts them: the first evaluation after training sets the best). Derived from the
        evaluations, which a resumed run restores; rank 0's verdict on every rank, since only it may evaluate."""
        patience = self.params.early_stopping_patience
        if patience is None:
            return False
        return self.dist.agree(evaluations_without_improvement(self.evals, self.best_metric) >= patience)

    def _open_run_folder(self) -> list[dict]:
        """The run folder ready for step 1: what an interrupted run left put right, the parameters written. Returns
        the metrics rows a resumed run keeps (none for a new run)."""
        run = self.run
        run.out_dir.mkdir(parents=True, exist_ok=True)
        # Under the lock no other writer exists: staging left by a killed save can go, a retired one back.
        clean_leftovers(run.out_dir / "checkpoints")
        clean_leftovers(run.out_dir, targets=RUN_JSON_FILES)
        remove_dead_launch_dirs(run.out_dir)  # a killed launch's folder, which a resume on one process leaves
        kept_rows: list[dict] = []
        if run.resume_state is not None:
            kept_rows = self.metrics.truncate_after(self.step)  # what the interrupted run logged past its checkpoint
        else:  # a run that stopped before step 1 may have left these (prepare allows that folder only)
            for name in ("metrics.jsonl", "loss_weighting.json"):
                (run.out_dir / name).unlink(missing_ok=True)
        write_json_atomic(run.out_dir / "params.json", {**asdict(self.params), "out_dir": str(run.out_dir)})
        if run.loss_weights is not None:  # the audit is on disk before the first step
            write_json_atomic(run.out_dir / "loss_weighting.json", self.loss_weighting())
        return kept_rows

    # --- the record -----------------------------------------------------------------
    def timing_so_far(self) -> dict[str, float]:
        """Seconds in training, evaluation and checkpoints, and of wall-clock time, over every process of the run:
        a resumed run's earlier parts up to the checkpoint it resumed from, then this process's."""
        return {**self.timing, "wall_s": self.timing["wall_s"] + time.perf_counter() - self.started}

    def record(self, epochs_done: int) -> dict:
        """record.json: train_record of the run's summary."""
        return train_record(self.summary(epochs_done))

    def summary(self, epochs_done: int) -> RunSummary:
        """The run so far as plain data (cflib.train.records.RunSummary)."""
        run, p, model, step = self.run, self.params, self.model, self.training_step
        patience = p.early_stopping_patience
        return RunSummary(
            params=p, device=self.device, out_dir=run.out_dir, world_size=self.dist.world_size,
            strategy=run.strategy, memory_estimate=run.memory_estimate, model_source=run.model_source,
            hub_start=None if run.hub_start is None else run.hub_start.record(),
            model_config=model.config.to_dict(), params_active=model.config.active_parameters(),
            parameter_counts=count_parameters(model),
            lora=None if run.lora is None else {**describe_lora(model), "base": {
                key: value for key, value in run.lora.base.items() if key != "config"},
                "init_adapters": run.init_adapters},  # where a run from adapters started, resumed or not
            kernel_path={**(step.kernel_path or model.kernel_path()), "loss": step.loss.last_backend,
                         "gemms": step.gemms.describe()},
            kernels_requested=kernels_requested(p, run.plan), execution_plan=run.plan.record(),
            step_capture=step.graphs_summary(),
            data=run.data_record(self.step),
            packing=run.packing_efficiency(), loss_weighting=self.loss_weighting(),
            schedule={"steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps,
                      **run.schedule.record(), "steps_done": self.step, "epochs_started": epochs_done,
                      "fill_ins_per_epoch": self.fill_ins,
                      **({"steps_by_epoch": steps} if (steps := run.epoch_steps()) is not None else {})},
            evals=self.evals, checkpoints=self.checkpoints, timing=self.timing_so_far(),
            steady=self.steady, warmup_steps_excluded=self.warmup_exclude,
            peak_memory_gib=(torch.cuda.max_memory_allocated(self.device) / 2**30
                             if self.device.type == "cuda" else None),
            optimizer_groups=describe_groups(step.optimizer), filters=run.filter_counts,
            best_metric={**self.best_metric.describe(), "value": self.best_value,
                         "step": int(self.checkpoints["best_step"]) if "best_step" in self.checkpoints else None},
            early_stopping=None if patience is None else {
                "patience": patience, "stopped_at_step": self.step if self.step < run.total_steps else None},
            registered=describe_registered(p))

    def loss_weighting(self) -> dict | None:
        """The audit: raw shares, targets, coefficients, the achieved shares, and those trained so far."""
        weights = self.run.loss_weights
        if weights is None:
            return None
        return {"max_task_loss_weight": weights.max_task_loss_weight,
                "normalisation": "sum of weighted token losses / weighted supervised tokens of the step",
                "cells": weights.audit(self.trained_mass)}


def logged_row(result: dict, kept_rows: Sequence[dict]) -> dict | None:
    """The row metrics.jsonl already holds for this evaluation (a run killed after writing it, resumed), among the
    rows the resume kept (rank 0's; none on the other ranks, which log nothing)."""
    return next((row for row in kept_rows if row.get("event") == "eval" and row.get("step") == result["step"]
                 and row.get("tag") == result["tag"]), None)
