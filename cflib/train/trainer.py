"""The training loop: optimizer steps with accumulation, evaluation and checkpoints on schedule, the record.

`Trainer(run).fit()` trains a prepared `Run` (cflib.train.run) in this process;
under torchrun each worker builds its own. One optimizer step is `train_step`.
"""
from __future__ import annotations

import contextlib
import math
import shutil
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from tqdm.auto import tqdm

from cflib.atomic import clean_leftovers, is_out_of_space, write_json_atomic
from cflib.data.packing import collate_packed
from cflib.data.shards import collate
from cflib.errors import ParamError
from cflib.model.checkpoint import CheckpointError, save_checkpoint
from cflib.model.fast import attach_weight_copies, detach_weight_copies
from cflib.model.lora import lora_kernel_path
from cflib.model.weight_copies import WeightCopies
from cflib.ops.attention import pack_documents
from cflib.ops.gemm import step_gemms
from cflib.ops.sft_loss import make_loss
from cflib.ops.loss import supervised_positions
from cflib.ops.rows import Rows
from cflib.train.distributed import epoch_stream, rank_share, wrap_model
from cflib.train.evaluate import autocast, eval_loss, exact_match
from cflib.train.batch import MicroBatch
from cflib.train.collector import steady_collector
from cflib.train.graphs import GraphedMicroSteps
from cflib.train.lock import RunLock
from cflib.train.optim import (
    TritonAdamW,
    clip_in_fused_step,
    describe_groups,
    lr_factor,
    make_optimizer,
    optimizer_kernel,
)
from cflib.train.records import MetricsLog, train_record
from cflib.train.run import RUN_JSON_FILES, Run, recheck_out_dir, schedule_signature
from cflib.train.trackers import open_trackers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StagedStep:
    """One optimizer step's host work, done ahead: its examples, their supervised tokens, and this rank's
    micro-batches collated and pinned (at their CUDA graphs' static shape where one replays)."""

    units: np.ndarray
    examples: np.ndarray
    supervised: int
    tokens: int  # the micro-batches' label positions before any static-shape padding
    micro_batches: list[MicroBatch]


def evaluations_without_improvement(evals: list[dict]) -> int:
    """Trailing evaluations after training began whose held-out loss did not beat the best before them."""
    best, since = math.inf, 0
    for result in evals:
        if result["step"] == 0:
            continue
        best, since = (result["loss"], 0) if result["loss"] < best else (best, since + 1)
    return since


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
        # FSDP shards the model in place, so the optimizer is built after wrapping.
        self.train_model = wrap_model(self.model, run.strategy, self.dist, self.device)
        self.optimizer = self._make_optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, run.warmup_steps, run.total_steps))
        self.loss = make_loss(self.params.loss_type, run.plan.kernels)
        self.gemms = step_gemms(run.plan.kernels.quack_gemms)  # the loss's GEMMs and those reading the weight copies
        self.loss_rows_only = run.plan.supervised_rows_only
        self.weight_copies = self._weight_copies()
        self.graphs = self._graphed_micro_steps()
        self.staged: StagedStep | None = None  # the next step's host work, done during this one (train_step)
        self.metrics = MetricsLog(run.out_dir / "metrics.jsonl")  # appends only once fit() writes
        self.step = 0
        self.evals: list[dict] = []
        self.checkpoints: dict[str, str] = {}
        self.best_loss = math.inf
        self.timing = {"train_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0}
        self.steady = {"tokens": 0, "supervised_tokens": 0, "seconds": 0.0, "steps": 0}
        self.fill_ins: list[int] = []
        self.bad_steps = 0  # consecutive non-finite steps
        self.position = (0, 0)  # (epoch, global batches done in it)
        weights = run.loss_weights
        self.example_weights = torch.from_numpy(weights.example_weights()).float() if weights else None
        self.trained_mass = np.zeros(len(weights.cells)) if weights else None  # weighted tokens per cell, consumed
        self.train_kernel_path: dict | None = None  # read back after a training step: evaluation runs unpacked
        if run.resume_state is not None:
            self._restore(run.resume_state)
        # The first steps pay for allocator growth and kernel selection: not steady state.
        self.warmup_exclude = min(3, max(run.total_steps // 5, 0))

    def _restore(self, state: dict) -> None:
        saved = state["optimizer"]
        if saved["param_groups"] and saved["param_groups"][0]["params"] and isinstance(
                saved["param_groups"][0]["params"][0], int):
            self.optimizer.load_state_dict(saved)  # written before optimizer state was keyed by parameter name
        else:  # keyed by parameter name, whole: any strategy (single, DDP, FSDP shards) takes its part
            set_optimizer_state_dict(self.model, self.optimizer, saved, options=StateDictOptions(full_state_dict=True))
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.position = state["step"], (state["epoch"], state["batch_in_epoch"])
        self.evals, self.best_loss, self.fill_ins = state["evals"], state["best_loss"], state["fill_ins"]
        self.checkpoints, self.timing = self._rooted(state["checkpoints"]), state["timing"]
        if self.trained_mass is not None and state.get("trained_mass") is not None:
            self.trained_mass = np.asarray(state["trained_mass"], dtype=np.float64)
        torch.set_rng_state(state["torch_rng"])

    def _rooted(self, saved: dict[str, str]) -> dict[str, str]:
        """Saved checkpoint paths re-rooted in this run's out_dir (the run folder may have been copied or moved)."""
        return {name: value if name == "best_step" else str(self.run.out_dir / "checkpoints" / name)
                for name, value in saved.items()}

    def _trainer_state(self, optimizer_state: dict) -> dict:
        epoch, batch_in_epoch = self.position
        return {"optimizer": optimizer_state, "scheduler": self.scheduler.state_dict(),
                "step": self.step, "epoch": epoch, "batch_in_epoch": batch_in_epoch,
                "world_size": self.dist.world_size, "global_batch": self.params.global_batch,
                "seed": self.params.seed, "best_loss": self.best_loss, "evals": self.evals,
                "fill_ins": self.fill_ins, "torch_rng": torch.get_rng_state(), "checkpoints": self.checkpoints,
                "trained_mass": None if self.trained_mass is None else self.trained_mass.tolist(),
                "timing": self.timing, **schedule_signature(self.run)}

    # --- evaluation and checkpoints -------------------------------------------------
    @property
    def evaluates(self) -> bool:
        """Rank 0 evaluates alone, except under FSDP, where every rank holds a shard of each forward."""
        return self.dist.is_main or self.run.strategy == "fsdp"

    def evaluate(self, tag: str, epoch: int, with_exact_match: bool) -> dict:
        p = self.params
        _sync(self.device)
        start = time.perf_counter()
        result = {"tag": tag, "step": self.step, "epoch": epoch}
        result.update(eval_loss(self.model, self.run.eval_data, p.eval_micro_batch or p.micro_batch_per_rank,
                                self.device, p.bf16, p.loss_chunk_tokens, p.fp32_loss))
        if with_exact_match and p.exact_match_limit != 0:
            matched = exact_match(self.model, self.run.eval_data, p.bf16, p.exact_match_limit)
            result.update(exact_match=matched["exact_match"], exact_match_by_group=matched["exact_match_by_group"],
                          exact_match_samples=matched["samples"])
        _sync(self.device)
        result["seconds"] = time.perf_counter() - start
        self.timing["eval_s"] += result["seconds"]
        self.evals.append(result)
        if self.dist.is_main:
            self.metrics.write(event="eval", **{k: v for k, v in result.items() if k != "exact_match_samples"})
            summary = f"eval {tag} step {self.step}: loss {result['loss']:.4f}"
            if "exact_match" in result:
                summary += f", exact match {result['exact_match']['overall']:.3f}"
            tqdm.write(summary)
        return result

    def save(self, name: str, epoch: int, resumable: bool | None = None) -> None:
        """Rank 0 writes; under FSDP every rank first joins in gathering the full weights."""
        if not self.params.save_checkpoints:
            return
        resumable = self.params.save_optimizer_state if resumable is None else resumable
        start = time.perf_counter()
        weights = optimizer_state = None
        fsdp = self.run.strategy == "fsdp"
        if fsdp:  # every rank joins the gathers; rank 0 receives the whole (a LoRA run's adapters only)
            weights = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=self.run.lora is not None))
        if resumable and (fsdp or self.dist.is_main):
            # Keyed by parameter name and whole, so a run on another strategy or world size can resume it.
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(
                full_state_dict=True, cpu_offload=fsdp))
        if self.dist.is_main:
            state = self._trainer_state(optimizer_state) if resumable else None
            progress = {"step": self.step, "epoch": self.position[0], "batch_in_epoch": self.position[1]}
            target = self.run.out_dir / "checkpoints" / name
            try:
                if self.run.lora is not None:  # the adapters, in PEFT's format, naming their base
                    path = self.run.lora.save(self.model, target, weights, state, progress if resumable else None)
                else:
                    path = save_checkpoint(self.model, target, state, weights, progress if resumable else None)
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

    def evaluation_point(self, tag: str, epoch: int, with_exact_match: bool, checkpoint: str | None = None) -> None:
        """Evaluate, keep the best weights, write the scheduled checkpoint; then every rank goes on together."""
        if self.evaluates:
            result = self.evaluate(tag, epoch, with_exact_match)
            improved = result["loss"] < self.best_loss and self.step > 0
            if self.run.strategy == "fsdp":  # every rank evaluated, and the save gathers: rank 0 decides
                improved = self.dist.agree(improved)
            if improved:
                self.best_loss = result["loss"]
                self.save("best", epoch)
                if "best" in self.checkpoints:
                    self.checkpoints["best_step"] = str(self.step)
        if checkpoint is not None:
            self.save(checkpoint, epoch)
        self.dist.barrier()

    # --- training -------------------------------------------------------------------
    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Only the last microbatch of a step all-reduces gradients."""
        if self.run.strategy == "ddp":
            return contextlib.nullcontext() if enabled else self.train_model.no_sync()
        if self.run.strategy == "fsdp":
            self.train_model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def host_batch(self, units: np.ndarray) -> MicroBatch:
        """Some units' batch, on the host. Everything the step's kernels need to know of its shape (packed
        documents, supervised positions) is worked out here, so no step reads the device back."""
        data, plan = self.run.train_data, self.run.packed
        documents = None
        if plan is None:
            input_ids, labels = collate([data[int(i)] for i in units], data.eos_token_id)
            example_index = torch.as_tensor(np.asarray(units, dtype=np.int64))[:, None].expand_as(labels)
        else:
            input_ids, labels, document_ids, example_index = collate_packed(data, plan, units)
            documents = pack_documents(document_ids)
        token_weights = None
        if self.example_weights is not None:  # padding (-1) takes any weight: its label is -100
            token_weights = self.example_weights[example_index.clamp(min=0)]
        return MicroBatch(input_ids, labels, documents, token_weights, supervised_positions(labels))

    def forward_backward(self, batch: MicroBatch, scale: torch.Tensor | float, capturing: bool = False
                         ) -> torch.Tensor:
        """One micro-batch's forward, loss and backward (gradients added to .grad); its summed loss, detached.
        capturing: inside a CUDA graph's capture, where autocast must not cache casts across replays."""
        p = self.params
        extra = {} if batch.row_mask is None else {"row_mask": batch.row_mask}
        # A loss that reads the supervised rows alone gets just those, and the last layer computes no other.
        rows = Rows(batch.supervised, batch.row_mask) if self.loss_rows_only and batch.supervised.numel() else None
        if rows is not None:
            extra["gathered"] = True
        with autocast(self.device, p.bf16, cache=not capturing):
            hidden = self.train_model(batch.input_ids, batch.documents, rows=rows)
            head_weight, head = self._head()
            loss_sum, _ = self.loss(hidden, head_weight, batch.labels, p.loss_chunk_tokens, p.fp32_loss,
                                    token_weights=batch.token_weights, supervised=batch.supervised, **extra, **head)
        (loss_sum * scale).backward()
        return loss_sum.detach()

    def _graphed_micro_steps(self) -> GraphedMicroSteps | None:
        """The CUDA-graph replays of the micro-steps (cflib.train.graphs), where the plan has them."""
        if not self.run.plan.cuda_graphs:
            return None
        return GraphedMicroSteps(self.forward_backward, list(self.model.parameters()), self.device,
                                 self.params.seq_len, self.run.train_data.eos_token_id)

    def _make_optimizer(self) -> torch.optim.AdamW:
        """The AdamW the plan names: cflib's Triton kernel, or torch's (fused on a GPU)."""
        optimizer = self.run.plan.optimizer
        return make_optimizer(self.model, self.params, self.device, fused=optimizer == "torch_fused",
                              triton=optimizer == "cflib_adamw")

    def _weight_copies(self) -> WeightCopies | None:
        """The BF16 weight copies (cflib.model.weight_copies) the plan has, written after every optimizer step
        (the kernel read-back says where they ran: `weights`)."""
        detach_weight_copies(self.model)  # none left by an earlier trainer of this model, which refreshed them
        if not self.run.plan.weight_copies:
            return None
        copies = attach_weight_copies(self.model, head=self.run.plan.head_copy, gemms=self.gemms)
        if isinstance(self.optimizer, TritonAdamW):  # it writes each copy as it updates the copy's masters
            self.optimizer.weight_copies = copies
        else:
            self.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: copies.refresh())
        return copies

    def _head(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The head the loss reads: the FP32 head, or (cflib's loss in BF16) its BF16 copy, with the master the
        loss writes the FP32 gradient into."""
        copies = self.weight_copies
        if copies is not None and "head" in copies.copies:
            return copies.tensor("head"), {"head_master": copies.copies["head"].masters[0]}
        return self.model.head_weight, {}

    def graphs_summary(self) -> dict:
        """How the micro-steps ran: replayed from CUDA graphs (how many, how many shapes), or eagerly and why."""
        if self.graphs is None:
            return {"cuda_graphs": False, "reason": self.run.plan.reasons["cuda_graphs"]}
        return self.graphs.summary()

    def stage(self, step_units: np.ndarray) -> StagedStep:
        """The step's host work (collation, padding, pinning), which needs nothing from the GPU: train_step
        does it for the next step while the GPU runs the current one."""
        p, data = self.params, self.run.train_data
        step_examples = self.run.examples_of(step_units)
        mine = rank_share(step_units, self.dist)
        micro_batches, tokens = [], 0
        for micro_start in range(0, len(mine), p.micro_batch_per_rank):
            host = self.host_batch(mine[micro_start:micro_start + p.micro_batch_per_rank])
            tokens += host.labels.numel()
            micro_batches.append(self.graphs.stage(host) if self.graphs is not None else
                                 host.pinned() if self.device.type == "cuda" else host)
        return StagedStep(np.array(step_units), step_examples, data.supervised_tokens(step_examples), tokens,
                          micro_batches)

    def train_step(self, step_units: np.ndarray, next_units: np.ndarray | None = None) -> dict:
        """One optimizer step on these units; with `next_units`, the next step's host work is staged while the
        GPU runs this one's."""
        p, data = self.params, self.run.train_data
        if self.weight_copies is not None:  # a replayed graph checks no master: rewrite what moved since
            self.weight_copies.refresh(stale_only=True)
        _sync(self.device)
        start = time.perf_counter()
        staged, self.staged = self.staged, None
        if staged is None or not np.array_equal(staged.units, step_units):
            staged = self.stage(step_units)
        step_examples, step_supervised = staged.examples, staged.supervised
        # Every rank knows the whole step's examples, so every rank divides by the same count (or mass).
        step_mass = step_supervised
        if self.example_weights is not None:
            cell_mass = self.run.loss_weights.cell_mass(step_examples, data.supervised_counts)
            self.trained_mass += cell_mass
            step_mass = float(cell_mass.sum())
        totals = torch.tensor([0.0, staged.tokens], dtype=torch.float64, device=self.device)  # loss sum, tokens
        # The step's (weighted) token mean, times world size: data parallelism averages gradients.
        scale = self.dist.world_size / step_mass
        for index, host in enumerate(staged.micro_batches):
            last = index == len(staged.micro_batches) - 1
            with self._gradient_sync(last):
                loss_sum = self._micro_step(host, scale, accumulate=index > 0)
            totals[0] += loss_sum.double()
        totals = self.dist.sum(totals)  # every rank sees the global loss and agrees
        lr = self.scheduler.get_last_lr()[0]
        norm, on_device = self._queue_update(totals[0])
        # Host work the GPU's results do not change, done while the GPU still runs this step.
        self.train_kernel_path = {**self.model.kernel_path(), **lora_kernel_path(self.model),
                                  "optimizer": optimizer_kernel(self.optimizer)}
        if next_units is not None:
            self.staged = self.stage(next_units)
        loss_total, tokens, grad_norm = torch.stack([totals[0], totals[1], norm.double()]).tolist()
        tokens = int(tokens)
        loss = loss_total / step_mass
        finite = math.isfinite(loss) and math.isfinite(grad_norm)  # global values: every rank agrees
        self.bad_steps = 0 if finite else self.bad_steps + 1
        if self.bad_steps > p.nan_patience:
            self._stop_non_finite(loss, grad_norm, step_examples)
        if not on_device:
            if finite:
                self.optimizer.step()
            self._end_step()
        _sync(self.device)
        seconds = time.perf_counter() - start
        self.step += 1
        self.timing["train_s"] += seconds
        if self.step > self.warmup_exclude:
            self.steady["tokens"] += tokens
            self.steady["supervised_tokens"] += step_supervised
            self.steady["seconds"] += seconds
            self.steady["steps"] += 1
        return {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                "supervised_tokens": step_supervised, "seconds": seconds, "skipped": not finite}

    def _queue_update(self, loss_total: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The gradients' norm, and whether the update is queued already: the fused AdamW skips a non-finite
        step on the device (found_inf, as under GradScaler), so the host queues it while the backward still
        runs instead of waiting to read the norm; another optimizer steps after the host has read it."""
        on_device = all(group.get("fused") for group in self.optimizer.param_groups)
        norm = self._clip(on_device)
        if on_device:
            self.optimizer.found_inf = (~torch.isfinite(loss_total + norm.double())).float()
            self.optimizer.step()
            self._end_step()
        return norm, on_device

    def _micro_step(self, host: MicroBatch, scale: float, accumulate: bool) -> torch.Tensor:
        """One micro-batch's forward, loss and backward: replayed from its CUDA graph where one runs."""
        if self.graphs is not None:
            return self.graphs(host, scale, accumulate=accumulate)
        return self.forward_backward(host.to(self.device), scale)

    def _clip(self, fused: bool) -> torch.Tensor:
        """The gradients' total norm, measured even unclipped (max_norm None) so a non-finite gradient is
        caught; clipped by the fused AdamW's next step, or here."""
        if fused:
            return clip_in_fused_step(self.optimizer, list(self.model.parameters()), self.params.max_grad_norm)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.params.max_grad_norm or math.inf)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a DTensor

    def _end_step(self) -> None:
        with warnings.catch_warnings():  # torch warns when the schedule moves without an optimizer step
            warnings.simplefilter("ignore", UserWarning)
            self.scheduler.step()  # a skipped step still consumes its data and its place in the schedule
        self.optimizer.zero_grad(set_to_none=True)  # stream-ordered: the update queued before still reads them

    def _stop_non_finite(self, loss: float, grad_norm: float, step_examples: np.ndarray) -> None:
        rows = self.run.train_data.rows
        ids = [rows[int(i)].get("example_id", int(i)) for i in step_examples[:8]]
        saved = [path for name, path in self.checkpoints.items() if name != "best_step"]
        last_good = saved[-1] if saved else "none yet"
        raise FloatingPointError(
            f"step {self.step + 1}: loss {loss}, gradient norm {grad_norm}, after {self.bad_steps} non-finite "
            f"step(s) in a row (nan_patience {self.params.nan_patience}); the optimizer skipped the step, so "
            f"no non-finite weight was written. Batch examples (first 8): {ids}. Last checkpoint: {last_good}")

    def fit(self) -> dict:
        """Train to the end and return the record, under the run folder's lock (rank 0 writes, so rank 0 holds
        it); report_to's trackers (rank 0) see every metrics row."""
        lock = RunLock(self.run.out_dir).acquire() if self.dist.is_main else None
        try:
            if lock is not None:
                recheck_out_dir(self.run)
            with open_trackers(self.run, self.metrics, self.step, active=self.dist.is_main) as trackers, \
                    steady_collector():
                return trackers.finished(self._fit())
        finally:
            if lock is not None:
                lock.release()

    def _fit(self) -> dict:
        run, p = self.run, self.params
        started = time.perf_counter()
        if self.dist.is_main:
            self._open_run_folder()
        self.model.train()
        last_eval_step = self.evals[-1]["step"] if self.evals else -1
        if run.resume_state is None and (p.eval_at_start or run.total_steps == 0):
            self.evaluation_point("start", 0, with_exact_match=True)
            last_eval_step = 0
        epoch, batches_done = self.position  # the epoch in progress (0 before the first), its batches done
        if 0 < batches_done < run.steps_per_epoch:
            epoch -= 1  # resumed mid-epoch: the loop below re-enters that epoch where it stopped
        else:
            batches_done = 0
        log_every = max(1, run.total_steps // 10)
        bar = tqdm(total=run.total_steps, initial=self.step, desc="train", unit="step", disable=not self.progress)
        while self.step < run.total_steps:
            epoch += 1
            order, fill_ins = epoch_stream(run.train_units, p.seed, epoch, p.global_batch)
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
                    tqdm.write(f"{rank}step {self.step}/{run.total_steps} epoch {epoch} loss {row['loss']:.4f} "
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
            self.evaluation_point("end", epoch, with_exact_match=True, checkpoint="last" if self.step > 0 else None)
        if not self.dist.is_main:
            return {}
        record = self.record(epoch, time.perf_counter() - started)
        write_json_atomic(run.out_dir / "record.json", record)
        # Written last: its presence says the record and every checkpoint are final.
        write_json_atomic(run.out_dir / "COMPLETE", {"completed_utc": record["created_utc"],
                                                     "steps": self.step})
        return record

    def _scheduled_points(self, epoch: int, epoch_ended: bool) -> bool:
        """The evaluation and checkpoints due after this step; True when it evaluated."""
        p, total = self.params, self.run.total_steps
        evaluated = True
        if epoch_ended:
            self.evaluation_point(f"epoch-{epoch}", epoch, with_exact_match=True, checkpoint=f"epoch-{epoch}")
        elif p.eval_every_steps and self.step % p.eval_every_steps == 0 and self.step < total:
            self.evaluation_point("periodic", epoch, with_exact_match=False)
        else:
            evaluated = False
        if p.save_every_steps and self.step % p.save_every_steps == 0 and self.step < total:
            self.save(f"step-{self.step}", epoch, resumable=True)
            self.dist.barrier()
        return evaluated

    @property
    def stopped_early(self) -> bool:
        """early_stopping_patience evaluations in a row without a lower held-out loss (as transformers'
        EarlyStoppingCallback counts them: the first evaluation after training sets the best). Derived from the
        evaluations, which a resumed run restores; rank 0's verdict on every rank, since only it may evaluate."""
        patience = self.params.early_stopping_patience
        if patience is None:
            return False
        return self.dist.agree(evaluations_without_improvement(self.evals) >= patience)

    def _open_run_folder(self) -> None:
        """The run folder ready for step 1: what an interrupted run left put right, the parameters written."""
        run = self.run
        run.out_dir.mkdir(parents=True, exist_ok=True)
        # Under the lock no other writer exists: staging left by a killed save can go, a retired one back.
        clean_leftovers(run.out_dir / "checkpoints")
        clean_leftovers(run.out_dir, targets=RUN_JSON_FILES)
        if run.resume_state is not None:
            self.metrics.truncate_after(self.step)  # what the interrupted run logged past its checkpoint
        else:  # a run that stopped before step 1 may have left these (prepare allows that folder only)
            for name in ("metrics.jsonl", "loss_weighting.json"):
                (run.out_dir / name).unlink(missing_ok=True)
        write_json_atomic(run.out_dir / "params.json", {**asdict(self.params), "out_dir": str(run.out_dir)})
        if run.loss_weights is not None:  # the audit is on disk before the first step
            write_json_atomic(run.out_dir / "loss_weighting.json", self.loss_weighting())

    # --- the record -----------------------------------------------------------------
    def record(self, epochs_done: int, wall_s: float) -> dict:
        """record.json: train_record's fields, with the optimizer's groups, the filters and early stopping."""
        record = train_record(self, dict(self.evals[-1]), epochs_done, wall_s)
        patience = self.params.early_stopping_patience
        record["data"]["train_supervised_tokens"] = self.run.train_data.supervised_tokens()  # after the filters
        return {**record, "optimizer_groups": describe_groups(self.optimizer), "filters": self.run.filter_counts,
                "early_stopping": None if patience is None else {
                    "patience": patience, "stopped_at_step": self.step if self.step < self.run.total_steps else None}}

    def loss_weighting(self) -> dict | None:
        """The audit: raw shares, targets, coefficients, the achieved shares, and those trained so far."""
        weights = self.run.loss_weights
        if weights is None:
            return None
        return {"max_task_loss_weight": weights.max_task_loss_weight,
                "normalisation": "sum of weighted token losses / weighted supervised tokens of the step",
                "cells": weights.audit(self.trained_mass)}
