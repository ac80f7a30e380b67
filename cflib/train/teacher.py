"""The teacher of knowledge distillation (`teacher_checkpoint`): where it is, its architecture checked against the
student's, its weights loaded frozen, and what they cost a rank's memory.

`teacher_checkpoint` names a checkpoint folder or a Hub bundle, `hub:ORG/NAME[@REVISION]`, read as
`init_checkpoint` is (cflib.export.pull: a revision is pinned to its commit once, and the record, the resume
identity and torchrun's workers name that commit), or `init`: the run's `init_checkpoint` itself (a curriculum's,
whichever stage), KL to the starting model against forgetting; for a LoRA run that is the base its adapters train on.
The teacher is a full model of the student's vocabulary (its size is checked from its config.json before any
weight is read; the architecture may differ: a larger teacher), with at least the run's seq_len positions (`init` takes the run's rope_scaling, rope_theta and
max_position_embeddings, as the student's start does). It is
held frozen, in eval mode, its layers' matrices in BF16 where the run trains in BF16 (its embeddings, which are its
tied head, and its norms in FP32, as a LoRA run's frozen base), on the run's device, with the run's kernels; every
rank holds a whole copy (DDP and FSDP alike), which the memory estimate counts (teacher_bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cflib.errors import ParamError
from cflib.export.peft import is_adapter_checkpoint
from cflib.export.pull import HubStart, fetch_bundle, is_hub, resolve_start
from cflib.model.checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint, load_config
from cflib.model.config import ConfigError, ModelConfig
from cflib.model.decoder import POSITION_KEYS, TRMoEModel
from cflib.model.lora import base_bytes
from cflib.ops.distillation import DistillationLoss
from cflib.ops.sft_loss import LOSSES
from cflib.paths import resolve_path
from cflib.train.adapters import adapter_base
from cflib.train.params import TEACHER_INIT as INIT
from cflib.train.params import TrainParams


@dataclass
class Teacher:
    """A teacher, where it comes from, and its weights where this process computes with them."""

    model: TRMoEModel | None  # None in the launcher of torchrun's workers: they load it, it plans from config.json
    spec: str  # the checkpoint teacher_checkpoint resolves to: a folder, or a Hub bundle pinned to its commit
    folder: Path  # where its weights are read (a Hub bundle's: in the Hugging Face cache)
    hub: HubStart | None
    config: ModelConfig  # its config.json, checked against the student (teacher_config)
    matrices_dtype: str  # its layers' matrices as held: bfloat16 under bf16, else float32

    def describe(self) -> dict:
        """What the execution plan and the record say of it."""
        config = self.config
        return {"checkpoint": self.spec, "folder": str(self.folder),
                "hub_start": None if self.hub is None else self.hub.record(), "params": config.num_parameters(),
                "hidden_size": config.hidden_size, "num_hidden_layers": config.num_hidden_layers,
                "head_dim": config.head_dim, "matrices_dtype": self.matrices_dtype}


def teacher_spec(params: TrainParams) -> str | None:
    """The checkpoint teacher_checkpoint names (`init`: init_teacher's), or None without a teacher."""
    if params.teacher_checkpoint == INIT:
        return init_teacher(params.init_checkpoint)
    return params.teacher_checkpoint


def init_teacher(init_checkpoint: str | None) -> str | None:
    """The model `teacher_checkpoint: init` names: init_checkpoint, or where it holds a LoRA run's adapters, the base
    they adapt (a teacher is a full model, and a LoRA run's start to keep close to is its frozen base)."""
    if init_checkpoint is None or is_hub(init_checkpoint):  # a Hub bundle is a model, never adapters
        return init_checkpoint
    folder = resolve_path(init_checkpoint)
    return adapter_base(folder)["path"] if is_adapter_checkpoint(folder) else init_checkpoint


def pinned_teacher(params: TrainParams, state: dict | None = None) -> tuple[TrainParams, HubStart | None]:
    """`params` with a Hub teacher_checkpoint pinned to its commit (a resume's: the one its checkpoint's trainer
    `state` records, named as the run named it), so that the record, the resume identity and torchrun's workers
    name that commit; `init` follows init_checkpoint, pinned as the run's start (cflib.train.run.pinned_hub_start)."""
    spec = teacher_spec(params)
    if params.teacher_checkpoint == INIT or not is_hub(spec):
        return params, None
    recorded = (state or {}).get("teacher_checkpoint")
    hub = resolve_start(spec, recorded if is_hub(recorded) else None, (state or {}).get("teacher_start"))
    return replace(params, teacher_checkpoint=hub.spec), hub


def teacher_identity(params: TrainParams) -> str | None:
    """The teacher as a resume compares it: a Hub bundle by its pinned spec, a folder by where it is."""
    spec = teacher_spec(params)
    return spec if spec is None or is_hub(spec) else str(resolve_path(spec).resolve())


def _folder(params: TrainParams, weights: bool) -> Path:
    """The teacher's checkpoint folder (a Hub bundle's fetched, its config.json alone unless `weights`), which must
    hold a full model; ParamError naming teacher_checkpoint otherwise."""
    spec = teacher_spec(params)
    named = f"teacher_checkpoint {params.teacher_checkpoint}" + (
        f" (init_checkpoint {params.init_checkpoint}" + ("" if spec == params.init_checkpoint else
                                                         f", its adapters' base {spec}") + ")"
        if params.teacher_checkpoint == INIT else "")
    try:
        folder = fetch_bundle(spec, weights=weights) if is_hub(spec) else resolve_path(spec)
    except (CheckpointError, ConfigError) as err:
        raise ParamError(f"{named}: {err}") from None
    if is_adapter_checkpoint(folder):
        raise ParamError(f"{named}: {folder} holds LoRA adapters, not a model: a teacher is a full model; merge them "
                         "into their base first (python -m cflib.export merge) and name the merged model")
    return folder


def teacher_config(params: TrainParams, student: ModelConfig) -> ModelConfig | None:
    """The teacher's architecture from its config.json alone (no weight is read), checked against the student:
    the same vocabulary, and positions for seq_len; None without a teacher. ParamError naming the file and both
    sizes otherwise."""
    if params.teacher_checkpoint is None:
        return None
    folder = _folder(params, weights=False)
    try:
        config = load_config(folder)
    except (CheckpointError, ConfigError, OSError) as err:
        raise ParamError(f"teacher_checkpoint {params.teacher_checkpoint}: {err}") from None
    if config.vocab_size != student.vocab_size:
        raise ParamError(f"teacher_checkpoint {params.teacher_checkpoint}: {folder / CONFIG_FILE} has vocab_size "
                         f"{config.vocab_size:,}, the model trained has {student.vocab_size:,}: distillation compares "
                         "the two models' distributions token by token, so the teacher must share the student's "
                         "tokenizer and vocabulary")
    if params.teacher_checkpoint == INIT:  # the starting model as the run trains it: at the student's positions
        config = replace(config, **{key: getattr(student, key) for key in POSITION_KEYS})
    if config.max_position_embeddings < params.seq_len:
        raise ParamError(f"teacher_checkpoint {params.teacher_checkpoint}: {folder / CONFIG_FILE} has "
                         f"max_position_embeddings {config.max_position_embeddings:,}, fewer than seq_len "
                         f"{params.seq_len:,}: a teacher reads every position the student trains on; name one "
                         "whose context reaches seq_len (extend it in a run of its own: rope_scaling), or "
                         "teacher_checkpoint: init, the starting model, which takes this run's positions")
    return config


def teacher_bytes(config: ModelConfig, bf16: bool) -> int:
    """A teacher's weights in memory, held as a LoRA run's frozen base is (cflib.model.lora.base_bytes): its layers'
    matrices in BF16 under bf16 (else FP32), its embeddings (the tied head) and norms in FP32; no gradient, no
    optimizer state."""
    return base_bytes(config, "bfloat16" if bf16 else "float32")


def load_teacher(params: TrainParams, student: ModelConfig, hub: HubStart | None = None, weights: bool = True
                 ) -> Teacher | None:
    """The teacher's weights (checked as init_checkpoint's are), frozen and in eval mode, on the CPU (prepare moves
    it with the model); None without a teacher. hub: the commit pinned_teacher pinned a Hub teacher to. Without
    `weights` (the launcher of torchrun's workers, which load them) none is read: its config.json alone, checked,
    and a Hub teacher's files fetched for the workers."""
    config = teacher_config(params, student)
    if config is None:
        return None
    folder = _folder(params, weights=True)
    if not weights:
        return Teacher(None, teacher_spec(params), folder, hub, config, "bfloat16" if params.bf16 else "float32")
    try:
        model = load_checkpoint(folder)
    except (CheckpointError, ConfigError) as err:
        raise ParamError(f"teacher_checkpoint {params.teacher_checkpoint}: {err}") from None
    if params.teacher_checkpoint == INIT and model.config != config:  # at the run's positions (teacher_config)
        model.set_positions(config)
    model.requires_grad_(False)
    if params.bf16:  # as a LoRA run's frozen base in BF16: the layers' matrices, not the embeddings and norms
        for param in model.layers.parameters():
            if param.dim() >= 2:
                param.data = param.data.to(torch.bfloat16)
    dtype = next(param.dtype for param in model.layers.parameters() if param.dim() >= 2)
    return Teacher(model.eval(), teacher_spec(params), folder, hub, config, str(dtype).removeprefix("torch."))


def start_teacher(params: TrainParams, state: dict | None, student: ModelConfig, weights: bool = True
                  ) -> tuple[TrainParams, Teacher | None]:
    """The run's teacher, pinned (pinned_teacher; `state`: the trainer state a resume continues) and loaded
    (load_teacher; without `weights`, its config alone); `params` naming its pinned commit."""
    params, hub = pinned_teacher(params, state)
    return params, load_teacher(params, student, hub, weights)


def distillation_loss(params: TrainParams) -> DistillationLoss | None:
    """The run's training loss with a teacher: its loss_type's cross-entropy term (DFT's, for dft) beside the KL
    term; None without a teacher."""
    if params.teacher_checkpoint is None:
        return None
    # TrainParams refuses a teacher beside a registered loss: the loss is SFTLoss's or DFTLoss's (cflib.ops.sft_loss)
    return DistillationLoss(params.distill_ratio, params.distill_temperature, dft=LOSSES[params.loss_type].dft)
