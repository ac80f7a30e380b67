"""One optimizer step of a prepared run, as its execution plan has it.

`TrainingStep(run)` wraps the model for DDP or FSDP, builds the optimizer the plan names with its warm-up +
cosine schedule, the loss, the BF16 weight copies and the CUDA-graph replays; each call `step(units,
next_units)` is one optimizer step:

1. the step's micro-batches, collated on the host (staged during the step before where it could be);
2. per micro-batch the forward, loss and backward, replayed from a CUDA graph where one runs, gradients
   accumulated and synchronised over ranks on the last micro-batch only (with a teacher, its forward without
   gradients first, and the distillation loss: cflib.train.teacher);
3. the loss and token totals summed over ranks, the gradients' norm measured and clipped, the update queued:
   the fused AdamW skips a non-finite step on the device, another optimizer is skipped by the host;
4. the next step's host work staged while the GPU still runs this one.

It returns a `StepResult`; what a non-finite step means for the run, and the run's books, are the loop's
(cflib.train.trainer).
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cflib.data.packing import collate_packed
from cflib.data.shards import collate
from cflib.model.fast import attach_weight_copies, detach_weight_copies
from cflib.model.lora import lora_kernel_path
from cflib.model.neftune import embedding_noise, noise_generator
from cflib.model.weight_copies import WeightCopies
from cflib.ops.attention import pack_documents
from cflib.ops.gemm import step_gemms
from cflib.ops.loss import supervised_positions
from cflib.ops.rows import Rows
from cflib.ops.sft_loss import make_loss
from cflib.train.batch import MicroBatch
from cflib.train.distributed import rank_share, wrap_model
from cflib.train.graphs import GraphedMicroSteps
from cflib.train.held_out import autocast
from cflib.train.optim import (
    OptimizerSettings,
    TritonAdamW,
    clip_in_fused_step,
    make_optimizer,
    optimizer_kernel,
)
from cflib.train.params import TrainParams
from cflib.train.run import Run
from cflib.train.teacher import distillation_loss


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timer's boundary); the CPU has none."""
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


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, with every rank's figures summed."""

    loss: float  # the step's token mean (weighted under loss weighting)
    lr: float
    grad_norm: float
    tokens: int  # padded tokens fed to the model
    supervised_tokens: int
    seconds: float
    finite: bool  # false: the update was skipped
    examples: np.ndarray  # the step's examples
    cell_mass: np.ndarray | None  # under loss weighting: the weighted tokens each cell trained
    # With a teacher: the step's cross-entropy and KL terms, each its token mean as `loss` is (loss = (1 - ratio) x
    # ce_loss + ratio x temperature^2 x kl_loss)
    terms: tuple[float, float] | None = None

    def row(self) -> dict:
        """The step as metrics.jsonl writes it."""
        terms = {} if self.terms is None else {"ce_loss": self.terms[0], "kl_loss": self.terms[1]}
        return {"loss": self.loss, **terms, "lr": self.lr, "grad_norm": self.grad_norm, "tokens": self.tokens,
                "supervised_tokens": self.supervised_tokens, "seconds": self.seconds, "skipped": not self.finite}


def optimizer_settings(params: TrainParams) -> OptimizerSettings:
    """The few parameters the optimizer reads (AdamW's, or those of the one `optimizer` names)."""
    return OptimizerSettings(lr=params.lr, weight_decay=params.weight_decay, betas=(params.beta1, params.beta2),
                             expert_lr_multiplier=params.expert_lr_multiplier,
                             lora_lr_multiplier=params.lora_lr_multiplier,
                             lora_plus_ratio=params.lora_plus_ratio or 1.0, eps=params.adam_epsilon,
                             optimizer=params.optimizer, embedding_lr_multiplier=params.embedding_lr_multiplier,
                             muon_momentum=params.muon_momentum)


class TrainingStep:
    """step(units, next_units) -> StepResult: one optimizer step of `run` (module docstring)."""

    def __init__(self, run: Run) -> None:
        self.run, self.plan, self.params = run, run.plan, run.params
        self.model, self.device, self.dist = run.model, run.device, run.dist
        # FSDP shards the model in place, so the optimizer is built after wrapping.
        self.train_model = wrap_model(self.model, run.strategy, self.dist, self.device)
        self.optimizer = make_optimizer(self.model, optimizer_settings(run.params),
                                        fused=self.plan.optimizer == "torch_fused",
                                        triton=self.plan.optimizer == "cflib_adamw")
        # A lambda, not the bound method: LambdaLR's state dict keeps no state of a function (a checkpoint's
        # scheduler state stays as before)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: run.schedule.factor(step))
        # With a teacher the loss is the distillation's (cflib.ops.distillation), its cross-entropy term loss_type's.
        self.teacher = None if run.teacher is None else run.teacher.model
        self.loss = distillation_loss(self.params) or make_loss(self.params.loss_type, self.plan.kernels)
        self.gemms = step_gemms(self.plan.kernels.quack_gemms)  # the loss's GEMMs and those reading the copies
        self.supervised_rows_only = self.plan.supervised_rows_only
        # NEFTune's noise, where the plan attached it: drawn from a generator of this rank's own, seeded from the run's
        # seed and the rank (a resume puts back the state its checkpoint kept: cflib.train.trainer).
        self.noise = embedding_noise(self.model)
        if self.noise is not None:
            self.noise.generator = noise_generator(self.device, self.params.seed, self.dist.rank)
        self.example_lengths = torch.from_numpy(run.train_data.lengths) if self.noise is not None else None
        self.weight_copies = self._weight_copies()
        self.graphs = self._graphed_micro_steps()
        self.staged: StagedStep | None = None  # the next step's host work, done during this one
        weights = run.loss_weights
        self.example_weights = torch.from_numpy(weights.example_weights()).float() if weights else None
        self.kernel_path: dict | None = None  # read back after a step: evaluation runs unpacked

    def _weight_copies(self) -> WeightCopies | None:
        """The BF16 weight copies (cflib.model.weight_copies) the plan has, written after every optimizer step
        (the kernel read-back says where they ran: `weights`)."""
        detach_weight_copies(self.model)  # none left by an earlier trainer of this model, which refreshed them
        if not self.plan.weight_copies:
            return None
        copies = attach_weight_copies(self.model, head=self.plan.head_copy, gemms=self.gemms)
        if isinstance(self.optimizer, TritonAdamW):  # it writes each copy as it updates the copy's masters
            self.optimizer.weight_copies = copies
        else:
            self.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: copies.refresh())
        return copies

    def _graphed_micro_steps(self) -> GraphedMicroSteps | None:
        """The CUDA-graph replays of the micro-steps (cflib.train.graphs), where the plan has them."""
        if not self.plan.cuda_graphs:
            return None
        return GraphedMicroSteps(self.forward_backward, list(self.model.parameters()), self.device,
                                 self.params.seq_len, self.run.train_data.eos_token_id,
                                 generators=() if self.noise is None else (self.noise.generator,))

    def graphs_summary(self) -> dict:
        """How the micro-steps ran: replayed from CUDA graphs (how many, how many shapes), or eagerly and why."""
        if self.graphs is None:
            return {"cuda_graphs": False, "reason": self.plan.reasons["cuda_graphs"]}
        return self.graphs.summary()

    # --- the host's work ------------------------------------------------------------
    def host_batch(self, units: np.ndarray) -> MicroBatch:
        """Some units' batch, on the host. Everything the step's kernels need to know of its shape (packed
        documents, supervised positions) is worked out here, so no step reads the device back."""
        data, packed = self.run.train_data, self.run.packed
        documents = None
        if packed is None:
            input_ids, labels = collate([data[int(i)] for i in units], data.eos_token_id)
            example_index = torch.as_tensor(np.asarray(units, dtype=np.int64))[:, None].expand_as(labels)
        else:
            input_ids, labels, document_ids, example_index = collate_packed(data, packed, units)
            documents = pack_documents(document_ids)
        token_weights = None
        if self.example_weights is not None:  # padding (-1) takes any weight: its label is -100
            token_weights = self.example_weights[example_index.clamp(min=0)]
        lengths = None
        if self.example_lengths is not None:  # NEFTune's L: each position's example's tokens; a window's padding, its T
            lengths = torch.where(example_index >= 0, self.example_lengths[example_index.clamp(min=0)],
                                  input_ids.shape[1]).to(torch.int32)
        return MicroBatch(input_ids, labels, documents, token_weights, supervised_positions(labels),
                          example_lengths=lengths)

    def stage(self, step_units: np.ndarray) -> StagedStep:
        """The step's host work (collation, padding, pinning), which needs nothing from the GPU: a step does it
        for the next step while the GPU runs the current one."""
        micro, data = self.params.micro_batch_per_rank, self.run.train_data
        step_examples = self.run.examples_of(step_units)
        mine = rank_share(step_units, self.dist)
        micro_batches, tokens = [], 0
        for micro_start in range(0, len(mine), micro):
            host = self.host_batch(mine[micro_start:micro_start + micro])
            tokens += host.labels.numel()
            micro_batches.append(self.graphs.stage(host) if self.graphs is not None else
                                 host.pinned() if self.device.type == "cuda" else host)
        return StagedStep(np.array(step_units), step_examples, data.supervised_tokens(step_examples), tokens,
                          micro_batches)

    # --- the device's work ----------------------------------------------------------
    def __call__(self, step_units: np.ndarray, next_units: np.ndarray | None = None) -> StepResult:
        """One optimizer step on these units; with `next_units`, the next step's host work is staged while the
        GPU runs this one's."""
        if self.weight_copies is not None:  # a replayed graph checks no master: rewrite what moved since
            self.weight_copies.refresh(stale_only=True)
        synchronize(self.device)
        start = time.perf_counter()
        staged, self.staged = self.staged, None
        if staged is None or not np.array_equal(staged.units, step_units):
            staged = self.stage(step_units)
        # Every rank knows the whole step's examples, so every rank divides by the same count (or mass).
        step_mass, cell_mass = staged.supervised, None
        if self.example_weights is not None:
            cell_mass = self.run.loss_weights.cell_mass(staged.examples, self.run.train_data.supervised_counts)
            step_mass = float(cell_mass.sum())
        totals = self._accumulate(staged, scale=self.dist.world_size / step_mass)
        lr = self._logged_rate()
        norm, on_device = self._queue_update(totals[0])
        # Host work the GPU's results do not change, done while the GPU still runs this step.
        self.kernel_path = {**self.model.kernel_path(), **lora_kernel_path(self.model),
                            "optimizer": optimizer_kernel(self.optimizer), **self._teacher_path()}
        if next_units is not None:
            self.staged = self.stage(next_units)
        # One read of the device: the loss, the tokens, the distillation's terms where a teacher teaches, the norm.
        loss_total, tokens, *terms, grad_norm = torch.cat([totals, norm.double().reshape(1)]).tolist()
        loss = loss_total / step_mass
        finite = math.isfinite(loss) and math.isfinite(grad_norm)  # global values: every rank agrees
        if not on_device:
            if finite:
                self.optimizer.step()
            self._end_step()
        synchronize(self.device)
        return StepResult(loss, lr, grad_norm, int(tokens), staged.supervised, time.perf_counter() - start, finite,
                          staged.examples, cell_mass, tuple(term / step_mass for term in terms) or None)

    def _logged_rate(self) -> float:
        """The step's learning rate as metrics.jsonl logs it: that of the first group training at lr itself (the
        embedding's group under embedding_lr_multiplier comes first, at its own rate, which the record's
        optimizer_groups gives), or the first group's where every group has a multiplier (a LoRA run's adapters)."""
        rates = self.scheduler.get_last_lr()
        own = (i for i, group in enumerate(self.optimizer.param_groups) if group["initial_lr"] == self.params.lr)
        return rates[next(own, 0)]

    def _accumulate(self, staged: StagedStep, scale: float) -> torch.Tensor:
        """Every micro-batch's forward, loss and backward; [summed loss, tokens] over every rank, and with a teacher
        the summed cross-entropy and KL after them. `scale`: the step's (weighted) token mean, times world size:
        data parallelism averages gradients."""
        figures = [0.0, staged.tokens] + ([0.0, 0.0] if self.teacher is not None else [])
        totals = torch.tensor(figures, dtype=torch.float64, device=self.device)
        for index, host in enumerate(staged.micro_batches):
            last = index == len(staged.micro_batches) - 1
            with self._gradient_sync(last):
                loss_sum = self._micro_step(host, scale, accumulate=index > 0)
            totals[0] += loss_sum.double()
            if self.teacher is not None:
                totals[2:] += self.loss.last_terms.double()
        return self.dist.sum(totals)  # every rank sees the global loss and agrees

    def _gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Only the last microbatch of a step all-reduces gradients."""
        if self.run.strategy == "ddp":
            return contextlib.nullcontext() if enabled else self.train_model.no_sync()
        if self.run.strategy == "fsdp":
            self.train_model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    def _micro_step(self, host: MicroBatch, scale: float, accumulate: bool) -> torch.Tensor:
        """One micro-batch's forward, loss and backward: replayed from its CUDA graph where one runs."""
        if self.graphs is not None:
            return self.graphs(host, scale, accumulate=accumulate)
        return self.forward_backward(host.to(self.device), scale)

    def forward_backward(self, batch: MicroBatch, scale: torch.Tensor | float, capturing: bool = False
                         ) -> torch.Tensor:
        """One micro-batch's forward, loss and backward (gradients added to .grad); its summed loss, detached.
        capturing: inside a CUDA graph's capture, where autocast must not cache casts across replays."""
        p = self.params
        extra = {} if batch.row_mask is None else {"row_mask": batch.row_mask}
        # A loss that reads the supervised rows alone gets just those, and the last layer computes no other.
        rows = Rows(batch.supervised, batch.row_mask) if self.supervised_rows_only and batch.supervised.numel() \
            else None
        if rows is not None:
            extra["gathered"] = True
        with autocast(self.device, p.bf16, cache=not capturing):
            hidden = self.train_model(batch.input_ids, batch.documents, rows=rows,
                                      example_lengths=batch.example_lengths)
            if self.teacher is not None:
                loss_sum = self._distillation(hidden, batch, rows)
            else:
                head_weight, head = self._head()
                loss_sum, _ = self.loss(hidden, head_weight, batch.labels, p.loss_chunk_tokens, p.fp32_loss,
                                        token_weights=batch.token_weights, supervised=batch.supervised, **extra,
                                        **head)
        (loss_sum * scale).backward()
        return loss_sum.detach()

    def _distillation(self, hidden: torch.Tensor, batch: MicroBatch, rows: Rows | None) -> torch.Tensor:
        """The distillation loss of one micro-batch: the teacher's forward over the same rows, without gradients
        (its last layer, like the student's, computes the supervised rows alone), then both heads chunk by chunk.
        The plan runs it eagerly, on the FP32 head: no row_mask, no head copy."""
        p = self.params
        with torch.no_grad():
            teacher_hidden = self.teacher(batch.input_ids, batch.documents, rows=rows)
        loss_sum, _ = self.loss(hidden, self.model.head_weight, teacher_hidden, self.teacher.head_weight, batch.labels,
                                p.loss_chunk_tokens, p.fp32_loss, token_weights=batch.token_weights,
                                supervised=batch.supervised, gathered=rows is not None)
        return loss_sum

    def _head(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The head the loss reads: the FP32 head, or (cflib's loss in BF16) its BF16 copy, with the master the
        loss writes the FP32 gradient into."""
        copies = self.weight_copies
        if copies is not None and "head" in copies.copies:
            return copies.tensor("head"), {"head_master": copies.copies["head"].masters[0]}
        return self.model.head_weight, {}

    def _teacher_path(self) -> dict[str, str]:
        """What the teacher's last forward ran, read back from its modules as the model's is: one entry."""
        if self.teacher is None:
            return {}
        return {"teacher": ", ".join(f"{key}={value}" for key, value in self.teacher.kernel_path().items())}

    # --- the update -----------------------------------------------------------------
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
