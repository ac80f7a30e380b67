"""The execution plan: what runs in every step of a run, decided once before step 1, with its reasons.

`plan_execution` resolves each choice that decides a step's work against the run and its device: the kernels
each module runs and the attention backend (cflib.ops.dispatch), the optimizer's implementation, the BF16
weight copies, CUDA-graph replays, the TR-MoE activations kept for backward, activation checkpointing, the
rows the last layer computes, NEFTune's noise on the training forwards' embeddings, for DFT why its loss runs on
the chunked path, and with a teacher (knowledge distillation) the teacher and the loss that compares with it. A
path a run requires (`true`) that cannot run stops it here with KernelUnavailable naming the switch and the
failed check; a path `auto` (or `false`) leaves off keeps its reason. `prepare()` builds the model (and a teacher)
to the plan (`apply_to_model`), the trainer reads it, the record writes it (`ExecutionPlan.record`); nothing
re-derives it. The kernels that actually ran are still read back from the
modules after a step (`TRMoEModel.kernel_path()`), never inferred from the plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from cflib.errors import ParamError
from cflib.model.decoder import TRMoEModel
from cflib.model.fast import checkpoint_layers, keep_activations, use_kernels
from cflib.model.neftune import attach_noise
from cflib.ops.attention import capturable, check_attention
from cflib.ops.dispatch import KernelChoice, choose_kernels, refuse_if_required
from cflib.ops.sft_loss import LOSSES, SFTLoss
from cflib.train.freezing import describe_frozen, freeze, frozen_plan
from cflib.train.graphs import why_eager
from cflib.train.optim import cflib_adamw_problem
from cflib.train.optimizer_choice import describe_choice, optimizer_plan, weight_copies_writer
from cflib.train.params import TrainParams


@dataclass(frozen=True)
class ExecutionPlan:
    """What every step of one run runs."""

    kernels: KernelChoice  # each module's implementation, the attention backend, quack's GEMMs
    # How the chosen optimizer (optimizer_choice) steps: "cflib_adamw" (cflib's AdamW kernel), "torch_fused" (torch's
    # fused AdamW, or under Muon its AdamW part's) or "torch" (unfused; always for Adafactor, which has no fused kernel)
    optimizer: str
    weight_copies: bool  # the fused GEMMs read BF16 copies of their weights, written after each optimizer step
    head_copy: bool  # ... and the loss reads a BF16 copy of the tied head
    cuda_graphs: bool  # each micro-step replayed from CUDA graphs (cflib.train.graphs)
    kept_swiglu_layers: int  # the first layers whose fused TR-MoE block keeps its activation for backward
    grad_ckpt: bool  # activation checkpointing per layer
    supervised_rows_only: bool  # the last layer computes the supervised rows alone (the loss reads only them)
    reasons: dict[str, str] = field(default_factory=dict)  # switch -> why this run leaves its path off
    # NEFTune's noise on the training forwards' embeddings (cflib.model.neftune): its alpha, what L counts and where
    # the noise is drawn from; None: off
    neftune: dict | None = None
    # The weights that stay frozen (cflib.train.freezing.frozen_plan): the families, the layers, their count; None:
    # every weight trains
    frozen: dict | None = None
    # Knowledge distillation (cflib.train.teacher, cflib.ops.distillation): the teacher, the ratio and temperature,
    # the loss's path; None: no teacher
    distill: dict | None = None
    # The optimizer `optimizer` names and the weights each of its parts steps (cflib.train.optimizer_choice.
    # optimizer_plan), with what writes the BF16 weight copies after its step
    optimizer_choice: dict | None = None

    def describe(self) -> str:
        """One line a person checks before the run: what runs, then why each fast path stays off."""
        parts = [self.kernels.describe().split("; ")[0], describe_choice(self.optimizer_choice, self.optimizer)]
        parts += [name for name, on in (("BF16 weight copies", self.weight_copies), ("CUDA graphs", self.cuda_graphs),
                                        ("activation checkpointing", self.grad_ckpt)) if on]
        if self.neftune is not None:
            parts.append(f"NEFTune noise alpha {self.neftune['alpha']:g}")
        if self.frozen is not None:
            parts.append(describe_frozen(self.frozen))
        if self.distill is not None:
            parts.append(f"distillation from {self.distill['teacher']['checkpoint']} (ratio "
                         f"{self.distill['ratio']:g}, temperature {self.distill['temperature']:g})")
        notes = [*self.kernels.notes, *(why if why.startswith(name) else f"{name}: {why}"
                                        for name, why in self.reasons.items())]
        return " + ".join(parts) + "".join(f"; {note}" for note in notes)

    def record(self) -> dict:
        """The plan as record.json keeps it."""
        return {**asdict(self), "kernels": {**asdict(self.kernels), "notes": list(self.kernels.notes)}}


# The kernel parameters a record repeats beside what ran, and the switches of kernel_overrides it names.
KERNELS_REQUESTED = ("use_custom_kernels", "require_liger", "attention_backend")
OVERRIDES_REQUESTED = ("epilogue_swiglu", "quack_gemms", "kept_swiglu_layers")


def kernels_requested(params: TrainParams, plan: ExecutionPlan) -> dict:
    """The kernel parameters as the run set them, and why auto left a kernel off."""
    return {**{name: getattr(params, name) for name in KERNELS_REQUESTED},
            **{name: getattr(params.overrides, name) for name in OVERRIDES_REQUESTED},
            "notes": list(plan.kernels.notes)}


def one_gpu_process_problem(device: torch.device, world_size: int) -> str | None:
    """Why `auto` leaves the BF16 weight copies and cflib's AdamW off: they are measured in one process on a
    GPU."""
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    return f"{world_size} processes (auto: one)" if world_size > 1 else None


def weight_copies_problem(params: TrainParams, custom: bool, strategy: str, device: torch.device) -> str | None:
    """Why this run reads no BF16 weight copies (cflib.model.weight_copies), or None where bf16_weight_copies
    gives it them; `custom`: whether cflib's kernels run, whose fused GEMMs read the copies."""
    choice = params.overrides.bf16_weight_copies
    if choice == "false":
        return "bf16_weight_copies: false"
    return ("bf16 is off" if not params.bf16 else "cflib's kernels are off" if not custom
            else "LoRA adapts the weights" if not params.full_parameter
            else "FSDP shards the masters" if strategy == "fsdp"
            else one_gpu_process_problem(device, params.world_size) if choice == "auto"
            else None)


def _optimizer(params: TrainParams, model: TRMoEModel, strategy: str, device: torch.device) -> tuple[str, str | None]:
    """torch's AdamW (fused on a GPU, but under FSDP), or cflib's kernel where cflib_adamw asks for it and it
    applies; and why not cflib's. Another optimizer is torch's: Adafactor unfused, Muon's AdamW part as AdamW alone
    would be."""
    choice = params.overrides.cflib_adamw
    problem = ("cflib_adamw: false" if choice == "false" else
               f"optimizer: {params.optimizer} (cflib's kernel steps AdamW alone)" if params.optimizer != "adamw" else
               cflib_adamw_problem(model, device, strategy))
    if choice == "auto" and problem is None:
        problem = one_gpu_process_problem(device, params.world_size)
    refuse_if_required("cflib_adamw", choice, problem)
    if problem is None:
        return "cflib_adamw", None
    fused = device.type == "cuda" and strategy != "fsdp" and params.optimizer != "adafactor"  # torch's has no fused
    return ("torch_fused" if fused else "torch"), problem


def _cuda_graphs_problem(params: TrainParams, kernels: KernelChoice, model: TRMoEModel, strategy: str,
                         device: torch.device) -> str | None:
    """Why the micro-steps run eagerly (cflib.train.graphs.why_eager), or None; refused where required."""
    choice = params.overrides.cuda_graphs
    if choice == "false":
        return "cuda_graphs: false"
    builder = LOSSES[params.loss_type]
    fused_loss = isinstance(builder, type) and issubclass(builder, SFTLoss) and kernels.custom
    dtype = torch.bfloat16 if params.bf16 else torch.float32
    attention = device.type == "cuda" and capturable(kernels.attention, params.pack_sequences, device,
                                                     model.config.head_dim, dtype)
    problem = why_eager(device, strategy, params.grad_ckpt, fused_loss, attention)
    if problem is None and params.frozen_modules is not None:
        problem = "frozen_modules: CUDA graphs are not checked with frozen weights yet (the micro-steps run eagerly)"
    if problem is None and params.teacher_checkpoint is not None:
        problem = ("teacher_checkpoint: the teacher's forward and the distillation loss are not captured in CUDA "
                   "graphs (the micro-steps run eagerly)")
    refuse_if_required("cuda_graphs", choice, problem)
    return problem


def _loss_problem(params: TrainParams, kernels: KernelChoice) -> str | None:
    """Why a built-in loss runs on the chunked PyTorch reference (cflib.ops.loss) rather than a fused kernel, where
    the plan knows it before a step: DFT's fused path is cflib's kernel alone (Liger's fused CE serves the plain
    cross-entropy only)."""
    builder = LOSSES[params.loss_type]
    if isinstance(builder, type) and issubclass(builder, SFTLoss) and builder.dft and not kernels.custom:
        return (f"{params.loss_type} runs on the chunked PyTorch loss (cflib.ops.loss): its fused path is cflib's "
                "kernel, and cflib's kernels are off (use_custom_kernels)")
    return None


def _distill(params: TrainParams, kernels: KernelChoice, device: torch.device, teacher: dict | None
             ) -> tuple[dict | None, str | None]:
    """The distillation a run with a teacher trains with, and why its loss runs on the chunked PyTorch path (where
    a fused loss would otherwise run); the teacher, which runs the run's kernels, checked against its attention
    backend (KernelUnavailable naming teacher_checkpoint where it cannot attend with it)."""
    if params.teacher_checkpoint is None:
        return None, None
    if teacher is None:
        raise ValueError("a run with teacher_checkpoint plans with its teacher (cflib.train.teacher.Teacher.describe)")
    try:
        check_attention(kernels.attention, device, teacher["head_dim"], params.pack_sequences)
    except ParamError as err:
        raise type(err)(f"teacher_checkpoint {params.teacher_checkpoint}: its head_dim {teacher['head_dim']}: {err}"
                        ) from None
    kind = "dft" if LOSSES[params.loss_type].dft else "ce"
    plan = {"teacher": teacher, "ratio": params.distill_ratio, "temperature": params.distill_temperature,
            "loss": f"(1 - ratio) x {kind} + ratio x temperature^2 x KL(teacher || student), summed over the "
                    "supervised tokens as the cross-entropy is",
            "path": f"torch_chunked_linear_{kind}_kl: the student's and the teacher's head over chunks of "
                    "loss_chunk_tokens (cflib.ops.distillation)"}
    fused = kernels.custom or (kernels.liger and kind == "ce")
    why = ("distillation runs on the chunked PyTorch loss (cflib.ops.distillation): cflib's and Liger's fused "
           "losses compute the cross-entropy alone") if fused else None
    return plan, why


def _neftune(params: TrainParams) -> dict | None:
    """NEFTune's noise as the run adds it (cflib.model.neftune), or None where neftune_noise_alpha leaves it off.
    It runs on every path: eager, under DDP and FSDP, and inside CUDA graphs, whose captures register its
    generator so that each replay draws new noise."""
    alpha = params.neftune_noise_alpha
    if not alpha:
        return None
    return {"alpha": alpha, "noise": "U(-1, 1) x alpha / sqrt(L x hidden_size) on each embedding, training only",
            "L": "the token count of each token's example, not the padded length",
            "generator": "each rank its own, seeded from seed and rank, kept by checkpoints"}


def _kept_layers(params: TrainParams, model: TRMoEModel) -> int:
    layers, kept = model.config.num_hidden_layers, params.overrides.kept_swiglu_layers
    if kept == "all":
        return layers
    if kept > layers:
        raise ParamError(f"kept_swiglu_layers: {kept} layers, the model has {layers} (or give all)")
    return kept


def plan_execution(params: TrainParams, model: TRMoEModel, strategy: str, device: torch.device,
                   teacher: dict | None = None) -> ExecutionPlan:
    """The run's execution plan (module docstring), or KernelUnavailable / ParamError naming what cannot run.
    teacher: a run with teacher_checkpoint's teacher, as cflib.train.teacher.Teacher.describe() gives it."""
    # The quack GEMMs' auto follows the weight copies as cflib's kernels would have them; with cflib's kernels off
    # it is off anyway.
    kernels = choose_kernels(params.use_custom_kernels, params.require_liger, device, params.attention_backend,
                             model.config.head_dim, packed=params.pack_sequences,
                             epilogue_swiglu=params.overrides.epilogue_swiglu,
                             weight_copies_problem=weight_copies_problem(params, True, strategy, device),
                             quack_gemms=params.overrides.quack_gemms)
    copies_problem = weight_copies_problem(params, kernels.custom, strategy, device)
    refuse_if_required("bf16_weight_copies", params.overrides.bf16_weight_copies, copies_problem)
    optimizer, optimizer_problem = _optimizer(params, model, strategy, device)
    graphs_problem = _cuda_graphs_problem(params, kernels, model, strategy, device)
    distill, distill_problem = _distill(params, kernels, device, teacher)
    reasons = {name: problem for name, problem in (("bf16_weight_copies", copies_problem),
                                                   ("cflib_adamw", optimizer_problem), ("cuda_graphs", graphs_problem),
                                                   ("loss_type", _loss_problem(params, kernels)),
                                                   ("teacher_checkpoint", distill_problem))
               if problem is not None}
    builder = LOSSES[params.loss_type]
    weight_copies = copies_problem is None
    # Every optimizer steps eagerly after the micro-steps, replayed or not: the choice changes no captured graph.
    choice = {**optimizer_plan(params, model, strategy),
              "weight_copies": weight_copies_writer(params.optimizer, optimizer, weight_copies)}
    return ExecutionPlan(
        kernels=kernels, optimizer=optimizer, weight_copies=weight_copies,
        # The distillation loss reads the FP32 head, as the chunked cross-entropy does.
        head_copy=(weight_copies and isinstance(builder, type) and issubclass(builder, SFTLoss) and not params.fp32_loss
                   and distill is None),
        cuda_graphs=graphs_problem is None, kept_swiglu_layers=_kept_layers(params, model), grad_ckpt=params.grad_ckpt,
        supervised_rows_only=bool(getattr(builder, "reads_supervised_rows_only", False)), reasons=reasons,
        neftune=_neftune(params), frozen=frozen_plan(params.frozen_modules, params.frozen_layers, model),
        distill=distill, optimizer_choice=choice)


def apply_to_model(model: TRMoEModel, plan: ExecutionPlan, teacher: TRMoEModel | None = None) -> TRMoEModel:
    """Every module of `model` as the plan has it: its kernels' classes, checkpointed layers, kept activations,
    NEFTune's noise on the embeddings, the frozen weights; and a distillation `teacher` on the run's kernels (it runs
    forward alone, so it keeps no activation for a backward)."""
    if teacher is not None:
        keep_activations(use_kernels(teacher, plan.kernels), 0)
    freeze(model, plan.frozen)
    use_kernels(model, plan.kernels)
    checkpoint_layers(model, plan.grad_ckpt)
    attach_noise(model, plan.neftune["alpha"] if plan.neftune else None)
    return keep_activations(model, plan.kept_swiglu_layers)
