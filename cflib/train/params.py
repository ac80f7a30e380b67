"""Training parameters: the notebook's parameters cell, papermill `-p`/`-f`, params/*.yaml.

Every value is checked here, before anything is built or written: unknown
names, wrong types, impossible ranges and impossible batch arithmetic. The
fields are declared in sections (`cflib.schema` reads them, from papermill's
strings and YAML's typed values alike); `TrainParams` joins them and checks
them together.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from cflib.data.filters import parse_filters
from cflib.data.mixture import data_sources
from cflib.data.weighting import parse_loss_groups
from cflib.errors import ParamError, shown
from cflib.export.push import repo_id_problem
from cflib.ops.attention import backend_names, packed_problem
from cflib.ops.sft_loss import LOSSES, SFTLoss
from cflib.schema import Params, coerce, composed, is_none_word, parsed_by
from cflib.train.best_metric import BestMetric, resolve_best_metric
from cflib.train.optim import OPTIMIZERS, SCHEDULES
from cflib.yamlio import read_yaml

if TYPE_CHECKING:
    from cflib.model.lora import LoraSettings

DEVICES = ("auto", "cpu", "cuda")
# The experiment trackers report_to names (cflib.train.trackers), each with the package it needs.
REPORTERS = ("tensorboard", "mlflow", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
KERNEL_CHOICES = ("auto", "true", "false")
STRATEGIES = ("auto", "ddp", "fsdp")
OVERLONG = ("error", "drop")  # what a run does with examples longer than seq_len (cflib.train.run_data)


def kernel_choice(name: str, value: Any) -> str:
    """A KERNEL_CHOICES value: YAML gives booleans, papermill strings in any case."""
    return str(value).strip().lower() if isinstance(value, (bool, str)) else coerce(name, value, str)


def layer_count(name: str, value: Any) -> int | str:
    """A number of layers >= 0, or "all" (checked against the model when the run is prepared)."""
    if isinstance(value, str) and value.strip().lower() == "all":
        return "all"
    try:
        count = coerce(name, value, int)
    except ParamError:
        count = -1
    if count < 0:
        raise ParamError(f"{name} must be a number of layers >= 0 or all, got {value!r}")
    return count


# Token ids: a vocabulary of 2**24 entries is far past any model's; a row of trainable embeddings per id named.
MAX_TOKEN_ID = 2**24 - 1
MAX_TRAINABLE_TOKENS = 2**20
MAX_LAYER_INDEX = 2**16 - 1  # far past any model's depth; the model's own is checked when the run is prepared


def token_ids(name: str, value: Any) -> tuple[int, ...] | None:
    """Token ids: a YAML list of ids and "a-b" ranges, or one such string ("69-94,101-126")."""
    return id_ranges(name, value, "token id", MAX_TOKEN_ID)


def layer_indices(name: str, value: Any) -> tuple[int, ...] | None:
    """Layer indices, as token_ids reads ids: a list of indices and "a-b" ranges, or one such string ("0-7"), in
    ascending order (the same layers are the same value, on resume too); checked against the model's layers when the
    run is prepared."""
    indices = id_ranges(name, value, "layer index", MAX_LAYER_INDEX)
    return None if indices is None else tuple(sorted(indices))


def id_ranges(name: str, value: Any, what: str, top: int) -> tuple[int, ...] | None:
    """Distinct whole numbers in [0, top]: a YAML list of them and "a-b" ranges, or one such string; None or a none
    word: None."""
    if value is None or is_none_word(value):
        return None
    items = value.strip().strip("[]()").split(",") if isinstance(value, str) else value
    ranges: list[range] = []
    for item in items if isinstance(items, (list, tuple)) else [items]:
        text = str(item).strip() if isinstance(item, (str, int)) and not isinstance(item, bool) else "?"
        low, _, high = text.partition("-") if "-" in text[1:] else (text, "", text)
        try:
            ranges.append(range(int(low), int(high) + 1) if max(len(low), len(high)) <= 20 else range(-1))
        except ValueError:
            raise ParamError(f"{name}: {shown(item)} is not a {what} or an a-b range of them") from None
        if not 0 <= ranges[-1].start < ranges[-1].stop <= top + 1:
            raise ParamError(f"{name}: {shown(text)} is not a {what} in [0, {top}] or an a-b range of them (a <= b)")
    # Counted before any id is listed: a range of a billion ids is refused, not built.
    if sum(len(ids) for ids in ranges) > MAX_TRAINABLE_TOKENS:
        raise ParamError(f"{name}: {sum(len(ids) for ids in ranges):,} {what}s, more than {MAX_TRAINABLE_TOKENS:,}")
    ids = [token for ids in ranges for token in ids]
    if len(set(ids)) != len(ids):
        raise ParamError(f"{name}: {what}s must be distinct, got {shown(value)}")
    return tuple(ids)


def every_choice(name: str, value: Any) -> str | int | None:
    """eval_tasks_every: None, "epoch", or a number of steps (papermill gives strings)."""
    if value is None or is_none_word(value):
        return None
    if isinstance(value, str) and value.strip().lower() == "epoch":
        return "epoch"
    try:
        steps = coerce(name, value, int)
    except ParamError:
        steps = 0
    if steps <= 0:
        raise ParamError(f"{name} must be None, epoch or a positive number of steps, got {value!r}")
    return steps


def resume_choice(name: str, value: Any) -> str | None:
    """resume: true means "latest", false None (YAML gives booleans, papermill strings)."""
    if isinstance(value, bool) or str(value).lower() in ("true", "false"):
        return "latest" if str(value).lower() == "true" else None
    return coerce(name, value, str | None)


def resolve_report_to(names: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """report_to as transformers takes it: "none" (or None, or ["none"]) is no tracker; "all" is every one
    installed."""
    if names is None:
        return None
    names = tuple(name.lower() for name in names)
    if names in ((), ("none",)):
        return None
    if "all" in names:
        return tuple(name for name in REPORTERS if importlib.util.find_spec(_PACKAGES[name]) is not None) or None
    return names


def check_report_to(report_to: tuple[str, ...] | None, tracking_uri: str | None) -> None:
    """ParamError naming an unknown or uninstalled tracker, before anything runs."""
    for name in report_to or ():
        if name not in REPORTERS:
            raise ParamError(f"report_to: unknown tracker {name!r}; choose none, all, or from "
                             f"{', '.join(REPORTERS)} (a list, or one comma-separated string)")
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise ParamError(f"report_to: {name} is not installed in this environment: pip install {_PACKAGES[name]}")
    if report_to and len(set(report_to)) != len(report_to):
        raise ParamError(f"report_to repeats a tracker: {list(report_to)}")
    if tracking_uri is not None and "mlflow" not in (report_to or ()):
        raise ParamError(f"mlflow_tracking_uri is {tracking_uri!r} but report_to has no mlflow: add it "
                         "(report_to: mlflow), or remove mlflow_tracking_uri")
    problem = tracking_uri_problem(tracking_uri) if tracking_uri is not None else None
    if problem:
        raise ParamError(f"mlflow_tracking_uri {shown(tracking_uri)}: {problem}; a server is http://host:5000 (or "
                         "https://), a local store sqlite:////absolute/path/mlflow.db")


# The stores MLflow's tracking client opens by scheme (a database's driver may follow a '+': postgresql+psycopg2).
MLFLOW_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow could not open `uri` as a tracking store, or None; read from the URI alone (nothing is
    contacted), so a malformed one stops the run before it starts, not as a warning at its first step."""
    if not uri or len(uri) > 2048 or any(character.isspace() or ord(character) < 32 for character in uri):
        return "not a URI (empty, longer than 2048 characters, or holding spaces or control characters)"
    try:
        parsed = urlsplit(uri)
        port = parsed.port  # a port that is not a number in [0, 65535] raises here
    except ValueError as err:
        return f"not a URI ({err})"
    scheme = parsed.scheme.split("+")[0] or (uri if uri in ("databricks", "databricks-uc") else "")
    if scheme not in MLFLOW_SCHEMES:
        return (f"scheme {parsed.scheme + ':' if parsed.scheme else '(none)'} is none of MLflow's stores "
                f"({', '.join(MLFLOW_SCHEMES)})")
    if scheme in ("http", "https") and (not parsed.hostname or port == 0):
        return "names no host (and port) to reach"
    if scheme in ("sqlite", "file") and not (uri.startswith(f"{scheme}:///") and parsed.path.strip("/")):
        return f"a local store is {scheme}:/// followed by an absolute path"
    return None


def tracker_names(name: str, value: Any) -> tuple[str, ...] | None:
    """report_to's trackers: a list of names, "none" for no tracker, "all" for every one (as transformers)."""
    return resolve_report_to(coerce(name, value, tuple[str, ...] | None))


# An epoch's order of examples is an array in memory (cflib.data.mixture): 8 GB of int64 at this bound.
MAX_EXAMPLES_PER_EPOCH = 10**9


def rope_scaling_choice(name: str, value: Any) -> dict | None:
    """A transformers rope_scaling dict (YAML, or its text from papermill), checked as a model config checks it:
    linear, yarn or llama3 with their keys, original_max_position_embeddings left to the starting model's positions
    where unset (cflib.train.positions); None: the starting model's own."""
    from cflib.model.config import ConfigError, canonical_rope_scaling  # the model layer owns what RoPE computes

    raw = coerce(name, value, dict | None)
    try:
        scaling = canonical_rope_scaling(raw, positions_optional=True)
    except ConfigError as err:
        raise ParamError(str(err)) from None
    if raw is not None and scaling is None:
        raise ParamError(f"{name}: rope_type default is plain RoPE; leave {name} unset to keep the starting model's")
    return scaling


@dataclass(frozen=True)
class Model:
    """The model a run starts from, and the positions it trains (cflib.train.positions)."""

    model: str = "smoke"  # a preset of cflib.model.config.PRESETS; ignored when init_checkpoint is set
    # a checkpoint dir, or a Hub bundle hub:ORG/NAME[@REVISION] (pinned to its commit); its config.json gives the
    # architecture
    init_checkpoint: str | None = None
    # a longer context: transformers' rope_scaling, e.g. {rope_type: linear, factor: 4} (also yarn, llama3), set on
    # the starting model and written to every checkpoint's config.json; None: the starting model's own
    rope_scaling: dict | None = parsed_by(rope_scaling_choice)
    rope_theta: float | None = None  # RoPE's base; None: the starting model's
    # the positions the trained model takes; None: the starting model's, or with rope_scaling what it covers
    max_position_embeddings: int | None = None


@dataclass(frozen=True)
class Data:
    """The data path: the shard, packing, 2-D loss weighting (cflib.data.weighting), shard preflight
    (cflib.data.preflight)."""

    # "embedded", a shard root with train/ and eval/, or a mixture: [{path: ROOT, weight: 0.7, name: NAME}, ...]
    data: str | tuple[dict, ...] = parsed_by(data_sources, "embedded")
    examples_per_epoch: int | None = None  # examples an epoch draws from the sources by weight; None: all of them
    train_tasks: tuple[str, ...] | None = None  # train only on examples of these `task`s; eval stays whole
    pack_sequences: bool = False  # whole examples in seq_len windows, each attending only to itself
    # examples longer than seq_len: error stops the run before step 1, naming the longest; drop leaves them out of
    # training and evaluation, counted per partition and source (never truncated)
    overlong_examples: str = "error"
    loss_groups: dict | None = None  # group -> {target_share, tasks, task_target_shares}; None: unweighted
    max_task_loss_weight: float = 30.0  # a larger loss coefficient stops the run before training
    require_release_ready: bool = False  # any shard/manifest mismatch is fatal, not a warning


@dataclass(frozen=True)
class Schedule:
    """Batches and how long the run trains."""

    seed: int = 0
    seq_len: int = 64
    micro_batch_per_rank: int = 16
    global_batch: int = 32
    epochs: int = 1
    max_steps: int | None = 30  # None: whole epochs; 0: evaluation only


@dataclass(frozen=True)
class Optimisation:
    """AdamW, its learning-rate schedule (cflib.train.optim.LrSchedule), clipping and non-finite steps."""

    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_epsilon: float = 1e-8  # AdamW's epsilon (transformers' name), added to the second moment's root in each update
    # adamw | adafactor | muon (cflib.train.optim): torch's Adafactor (no first moment, a factored second), or
    # torch's Muon on the 2-D matrices with AdamW on every other weight
    optimizer: str = "adamw"
    muon_momentum: float = 0.95  # muon only: Muon's momentum (torch's default); the AdamW part keeps beta1, beta2
    warmup_ratio: float = 0.03
    warmup_steps: int | None = None  # warm-up steps; where set, warmup_ratio is unused
    lr_schedule: str = "cosine"  # after the warm-up: cosine | linear | constant | wsd (cflib.train.optim.SCHEDULES)
    min_lr_ratio: float = 0.0  # the floor cosine, linear and wsd fall to, as a fraction of lr
    lr_decay_ratio: float | None = None  # wsd only: the last share of the steps that decay linearly; None: 0.1
    max_grad_norm: float | None = 1.0
    nan_patience: int = 0  # non-finite steps skipped in a row before the run stops


@dataclass(frozen=True)
class Loss:
    """The training loss, its precision, and the noise NEFTune adds to the training forward's embeddings."""

    bf16: bool = False
    loss_type: str = "sft_cross_entropy"  # a loss of cflib.ops.sft_loss.LOSSES (register_loss adds one)
    loss_chunk_tokens: int = 1024
    fp32_loss: bool = True
    # NEFTune (cflib.model.neftune): uniform noise of bound alpha / sqrt(L x hidden size) on each token's embedding
    # in training forwards only, L the token count of the token's example; None (or 0): off. The paper's 5 is a start
    neftune_noise_alpha: float | None = None
    # Knowledge distillation (cflib.train.teacher): a teacher checkpoint of the same vocabulary, a folder or
    # hub:ORG/NAME[@REVISION], or init (init_checkpoint itself: KL to the starting model); None: off
    teacher_checkpoint: str | None = None
    distill_ratio: float = 0.5  # the KL term's share of the loss: (1 - ratio) x CE + ratio x temperature^2 x KL
    distill_temperature: float = 1.0  # both models' logits are divided by it before their softmax


@dataclass(frozen=True)
class Lora:
    """Full-parameter training, or LoRA adapters on a frozen base (cflib.model.lora)."""

    full_parameter: bool = True  # false: LoRA adapters on a frozen init_checkpoint (cflib.model.lora)
    lora_rank: int | None = None  # None: 8 when full_parameter is false
    lora_alpha: float | None = None  # None: lora_rank (scale alpha / rank = 1); rslora needs it set
    lora_scaling: str | None = None  # standard: scale alpha / rank; rslora: alpha / sqrt(rank); None: standard
    lora_dora: bool | None = None  # true: DoRA, a trained magnitude per output row (linear targets); None: false
    lora_dropout: float | None = None  # None: 0.0 (the fused paths then run on the effective weights)
    # "q_proj,v_proj" or a list; None: all ten (cflib.model.lora), the seven linear ones under lora_dora
    lora_targets: tuple[str, ...] | None = None
    base_dtype: str | None = None  # float32 | bfloat16 (frozen weights held in BF16; needs bf16); None: float32
    # embedding rows that train too: "69-94,101-126" or a list
    lora_trainable_tokens: tuple[int, ...] | None = parsed_by(token_ids)
    # LoRA+: the B matrices (and DoRA's magnitudes) learn at this x the A matrices' rate; None or 1: off
    lora_plus_ratio: float | None = None


# The module families frozen_modules names (cflib.train.freezing says which weights each holds).
FROZEN_FAMILIES = ("embeddings", "attention", "shared", "experts", "norms")
# The families within each layer, which frozen_layers narrows to its layers.
LAYER_FAMILIES = ("attention", "shared", "experts", "norms")


def module_families(name: str, value: Any) -> tuple[str, ...] | None:
    """Module families: a list or one "embeddings,experts" string, in FROZEN_FAMILIES' order (the same families are
    the same value, on resume too; a name of none comes last, for the validation to refuse)."""
    if value is None or is_none_word(value):
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ParamError(f"{name} must be a list of module families or one comma-separated string, got {shown(value)}")
    order = {family: index for index, family in enumerate(FROZEN_FAMILIES)}
    return tuple(sorted((str(item).strip() for item in items), key=lambda family: order.get(family, len(order))))


@dataclass(frozen=True)
class Freezing:
    """Which weights a full-parameter run trains (cflib.train.freezing): the others keep their starting values."""

    # module families that stay frozen, a list or "embeddings,experts": embeddings (the tied head too), attention
    # (q/k/v/o projections), shared (the shared SwiGLU), experts (the routed experts), norms (every RMSNorm); None:
    # every weight trains
    frozen_modules: tuple[str, ...] | None = parsed_by(module_families)
    # the layers whose attention, shared, experts and norms frozen_modules freezes, "0-7" or a list (the final norm
    # counts with the last layer); None: every layer
    frozen_layers: tuple[int, ...] | None = parsed_by(layer_indices)


@dataclass(frozen=True)
class KernelOverrides(Params):
    """The step's speed switches (docs/kernels.md), each `auto` unless a run names it in `kernel_overrides`:
    auto takes it where every check passes (and where it was measured faster), true requires it (the run stops
    before step 1 where it cannot run), false leaves it off. The execution plan (cflib.train.execution) resolves
    them once, with its reasons."""

    # The TR-MoE block's forward SwiGLU in quack's GEMM epilogue (Hopper, quack-kernels): auto where it runs and the
    # run reads the BF16 weight copies, true with or without them, false for cflib's SwiGLU kernel
    epilogue_swiglu: str = parsed_by(kernel_choice, "auto")
    # The step's other GEMMs each on quack's GEMM or cuBLAS, whichever was faster at the first call of its size
    # class (Hopper, quack-kernels; cflib.ops.gemm): auto where it runs and the run reads the BF16 weight copies
    quack_gemms: str = parsed_by(kernel_choice, "auto")
    # Each micro-step's forward, loss and backward replayed from CUDA graphs (cflib.train.graphs): auto where it
    # runs (one CUDA process, cflib's fused loss, a capturable attention kernel, no grad_ckpt)
    cuda_graphs: str = parsed_by(kernel_choice, "auto")
    # BF16 copies of the fused GEMMs' weights written after each optimizer step instead of autocast's casts in every
    # forward (cflib.model.weight_copies): auto in one process on a GPU (full-parameter BF16 runs on cflib's
    # kernels, not FSDP), true under DDP too
    bf16_weight_copies: str = parsed_by(kernel_choice, "auto")
    # AdamW stepped by cflib's Triton kernel (cflib.ops.adamw) instead of torch's fused one, writing the weight
    # copies in the same pass: auto in one process on a GPU (not FSDP), true under DDP too
    cflib_adamw: str = parsed_by(kernel_choice, "auto")
    # The TR-MoE block's activation kept from forward to backward in this many layers (the first ones; all: every
    # layer) where cflib's kernels run, instead of recomputed by the backward kernel: faster, for 2 bytes x the
    # block's width a token in each (docs/kernels.md); 0 gives that memory back
    kept_swiglu_layers: int | str = parsed_by(layer_count, "all")

    def validate(self) -> None:
        for name in SWITCHES:
            if getattr(self, name) not in KERNEL_CHOICES:
                raise ParamError(f"{name} must be one of {KERNEL_CHOICES} (or a boolean), got {getattr(self, name)!r}")


# The tri-state switches of KernelOverrides (kept_swiglu_layers counts layers).
SWITCHES = ("epilogue_swiglu", "quack_gemms", "cuda_graphs", "bf16_weight_copies", "cflib_adamw")


def kernel_overrides(name: str, value: Any) -> dict[str, Any] | None:
    """The switches a run names, each read as KernelOverrides reads it: a YAML mapping, or its text from papermill
    ("{cuda_graphs: false}"); a name KernelOverrides does not declare is refused with the likeliest meant."""
    raw = coerce(name, value, dict | None)
    if not raw:
        return None
    try:
        given = KernelOverrides.from_dict(raw, source=name)
    except ParamError as err:  # each message names the switch; the parameter it sits in goes first
        raise ParamError(str(err) if str(err).startswith(name) else f"{name}: {err}") from None
    return {key: getattr(given, key) for key in raw}


@dataclass(frozen=True)
class Kernels:
    """Which implementation computes each step (docs/kernels.md)."""

    grad_ckpt: bool = False
    # auto: fast paths where every check passes; true: require them; false: PyTorch
    use_custom_kernels: str = parsed_by(kernel_choice, "auto")
    require_liger: bool = False  # fail before training unless Liger's kernels run
    # auto: FlashAttention-4 where it runs (Hopper+, bf16), else the next fastest; or one of ATTENTION_BACKENDS,
    # required (fa4 and cudnn_sdpa compute in bf16 even in an fp32 run; cudnn_sdpa cannot attend packed windows)
    attention_backend: str = "auto"
    # The speed switches a run overrides, e.g. {cuda_graphs: false, kept_swiglu_layers: 0}; the others stay auto
    # (KernelOverrides names them all)
    kernel_overrides: dict | None = parsed_by(kernel_overrides)


@dataclass(frozen=True)
class Evaluation:
    """Held-out loss and exact match during the run, lm-evaluation-harness after it."""

    eval_at_start: bool = True
    eval_every_steps: int | None = None
    eval_micro_batch: int | None = None  # None: micro_batch_per_rank
    exact_match_limit: int | None = None  # None: every eval prompt; 0: skip exact match
    # lm-evaluation-harness on the run's Hub bundle after training (cflib.lab.evaluate, train_sft's last cell),
    # task names as "embedded_choice,embedded_exact" (shipped) or "piqa,arc_easy" (lm-eval's, needs network)
    eval_tasks: str | None = None
    # None: eval_tasks after training only; "epoch": also on every epoch's checkpoint; N: every N steps, on a
    # step-N checkpoint written for it (cflib.train.task_scores)
    eval_tasks_every: str | int | None = parsed_by(every_choice)
    eval_tasks_limit: int | None = None  # examples per task during training; None: all
    # What chooses best/, a curriculum stage's hand-off and early stopping: eval_loss, exact_match,
    # exact_match/<task>, lm_eval/<task>/<metric>, or a name register_metric added (cflib.train.best_metric)
    best_metric: str = "eval_loss"
    greater_is_better: bool | None = None  # None: inferred from best_metric
    log_samples: int = 0  # held-out prompts written with their greedy answers at each evaluation (out_dir/samples)


@dataclass(frozen=True)
class Checkpoints:
    """The run folder, its checkpoints and resuming from them."""

    out_dir: str | None = None  # None: a new outputs/runs/<time>-<model> folder
    save_checkpoints: bool = True
    save_optimizer_state: bool = False  # beside epoch checkpoints, so a run can resume from them
    save_every_steps: int | None = None  # resumable step-N checkpoints in between
    save_total_limit: int | None = None  # keep the newest N epoch/step checkpoints, plus the best
    # None; "latest" (or true): out_dir's newest resumable checkpoint; or its path
    resume: str | None = parsed_by(resume_choice)
    allow_world_size_change: bool = False  # resume on another number of processes
    allow_resume_changes: tuple[str, ...] | None = None  # changed on purpose by a resume: "data,max_grad_norm"
    # None; or ORG/NAME: at the end of the run its model (the Hub bundle, or a LoRA run's adapters, with a model card)
    # pushed to this Hugging Face Hub repository, created private when missing (cflib.export.publish)
    push_to_hub: str | None = None


@dataclass(frozen=True)
class Distributed:
    """The device, and data parallelism: more than one process starts torchrun from the notebook."""

    device: str = "auto"
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the rendezvous, needed when nnodes > 1
    strategy: str = "auto"  # auto | ddp | fsdp: DDP when model + optimizer state fit one device
    collective_timeout_s: int = 1800  # bounds every collective, rank 0's evaluation and saves included


@dataclass(frozen=True)
class Trackers:
    """Experiment trackers, named as transformers names them (cflib.train.trackers): rank 0 reports, never
    blocks."""

    # None or "none"; "tensorboard", "mlflow", "wandb", "all", or a list
    report_to: tuple[str, ...] | None = parsed_by(tracker_names)
    mlflow_tracking_uri: str | None = None  # None: an SQLite store in out_dir/mlruns


@dataclass(frozen=True)
class Curricula:
    """Curricula and their controls (cflib.train.curriculum, docs/curricula.md): stages in one run folder, each a
    run of these parameters with its own overrides; filters, parameter groups and early stopping serve any run."""

    curriculum: str | None = None  # a curriculum YAML file: its stages run in order in out_dir/stages/<name>/
    through_stage: str | None = None  # run the curriculum up to and including this stage
    dry_run: bool = False  # resolve every stage against the data, write the audit, train nothing
    filters: dict | None = None  # train examples kept: difficulties, tasks, domains, max_supervised_tokens, ...
    early_stopping_patience: int | None = None  # evaluations without a better best_metric before stopping
    # the token embedding's (and the tied head's; LoRA: lora_trainable_tokens' rows) learning rate: lr x this
    embedding_lr_multiplier: float = 1.0
    expert_lr_multiplier: float = 1.0  # the routed experts' learning rate: lr x this
    lora_lr_multiplier: float = 1.0  # the LoRA adapters' learning rate: lr x this


@dataclass(frozen=True)
class TrainParams(composed(Model, Data, Schedule, Optimisation, Loss, Lora, Freezing, Kernels, Evaluation, Checkpoints,
                          Distributed, Trackers, Curricula)):
    """The controls of one SFT run. Defaults: a CPU smoke run of a few seconds."""

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def grad_accum(self) -> int:
        """Micro-batches per rank in one optimizer step: global_batch = micro_batch_per_rank x world_size x this."""
        return gradient_accumulation(self.global_batch, self.micro_batch_per_rank, self.world_size)

    @property
    def overrides(self) -> KernelOverrides:
        """Every speed switch: auto, or as kernel_overrides names it."""
        return KernelOverrides(**(self.kernel_overrides or {}))

    def validate(self) -> None:
        # Before any range check: `x <= 0` is False for NaN, and inf passes every lower bound.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ParamError(f"{field.name} must be a finite number, got {value}")
        if not 0 <= self.seed < 2**32:  # numpy's and torch's generators both take it as given
            raise ParamError(f"seed must be an integer in [0, 2**32), got {self.seed}")
        positive = ("seq_len", "micro_batch_per_rank", "global_batch", "epochs", "loss_chunk_tokens",
                    "nproc_per_node", "nnodes", "collective_timeout_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ParamError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_steps", "exact_match_limit", "nan_patience"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ParamError(f"{name} must be None or >= 0, got {getattr(self, name)}")
        for name in ("examples_per_epoch", "eval_every_steps", "eval_micro_batch", "save_every_steps",
                     "save_total_limit"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ParamError(f"{name} must be None or positive, got {getattr(self, name)}")
        if self.examples_per_epoch is not None and self.examples_per_epoch > MAX_EXAMPLES_PER_EPOCH:
            raise ParamError(f"examples_per_epoch {self.examples_per_epoch:,} is more than the "
                             f"{MAX_EXAMPLES_PER_EPOCH:,} an epoch may draw (each epoch's order is held in memory)")
        self._validate_optimisation()
        self._validate_positions()
        if self.device not in DEVICES:
            raise ParamError(f"device must be one of {DEVICES}, got {self.device!r}")
        self._validate_lora()
        self._validate_freezing()
        self._validate_distillation()
        if self.overlong_examples not in OVERLONG:
            raise ParamError(f"overlong_examples must be one of {', '.join(OVERLONG)} (examples longer than seq_len "
                             "stop the run, or are left out of it; never truncated), got "
                             f"{shown(self.overlong_examples)}")
        if self.train_tasks is not None and not self.train_tasks:
            raise ParamError("train_tasks must name at least one task, or be None for every example")
        self._validate_evaluation()
        if self.use_custom_kernels not in KERNEL_CHOICES:
            raise ParamError(f"use_custom_kernels must be one of {KERNEL_CHOICES} (or a boolean), got "
                             f"{self.use_custom_kernels!r}")
        if self.attention_backend not in backend_names():
            raise ParamError(f"attention_backend must be one of {backend_names()}, got {self.attention_backend!r}")
        if self.pack_sequences and (problem := packed_problem(self.attention_backend)):
            raise ParamError(f"{problem} (pack_sequences: true)")
        if self.strategy not in STRATEGIES:
            raise ParamError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ParamError(f"node_rank {self.node_rank} is not in [0, nnodes={self.nnodes})")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ParamError(f"nnodes {self.nnodes} needs rdzv_endpoint (host:port of the rendezvous on node 0)")
        if not self.max_task_loss_weight > 0:
            raise ParamError(f"max_task_loss_weight must be positive, got {self.max_task_loss_weight}")
        self._validate_curriculum_controls()
        check_report_to(self.report_to, self.mlflow_tracking_uri)
        if self.push_to_hub is not None and (problem := repo_id_problem(self.push_to_hub)):
            raise ParamError(f"push_to_hub: {problem}")
        if self.resume == "latest" and self.out_dir is None:
            raise ParamError("resume: latest needs the out_dir of the run to continue")
        self.grad_accum  # noqa: B018 - a global batch the ranks cannot split stops here, with the options

    def _validate_positions(self) -> None:
        """RoPE's base and the positions, as far as they are known without the model (cflib.train.positions checks
        them against it)."""
        if self.rope_theta is not None and not self.rope_theta >= 1:
            raise ParamError(f"rope_theta must be None (the starting model's) or at least 1, got {self.rope_theta}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_len:
            raise ParamError(f"max_position_embeddings {self.max_position_embeddings:,} is below seq_len "
                             f"{self.seq_len:,}: the model would train on positions past its own")

    def _validate_evaluation(self) -> None:
        """lm-eval's tasks, when they run, and the metric that chooses the best checkpoint."""
        if self.eval_tasks is not None and not self.eval_task_names():
            raise ParamError(f"eval_tasks must name at least one lm-eval task, or be None (off), got {self.eval_tasks!r}")
        if self.eval_tasks_every is not None and self.eval_tasks is None:
            raise ParamError(f"eval_tasks_every is {self.eval_tasks_every!r} but eval_tasks names no task: name "
                             "some (e.g. embedded_exact), or remove eval_tasks_every")
        if self.eval_tasks_every is not None and not self.save_checkpoints:
            raise ParamError("eval_tasks_every scores saved checkpoints, but save_checkpoints is false")
        if not self.save_checkpoints:
            ignored = [name for name, value in (("save_every_steps", self.save_every_steps),
                                                ("save_total_limit", self.save_total_limit),
                                                ("save_optimizer_state", self.save_optimizer_state)) if value]
            if ignored:
                raise ParamError(f"{ignored[0]} is set, but save_checkpoints is false: no checkpoint is written, so "
                                 "it would do nothing; remove one of the two")
        for name in ("eval_tasks_limit",):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ParamError(f"{name} must be None or positive, got {getattr(self, name)}")
        if self.log_samples < 0:
            raise ParamError(f"log_samples must be >= 0, got {self.log_samples}")
        metric = self.best()
        if metric.lm_eval_task is not None and self.eval_tasks_every is None:
            raise ParamError(f"best_metric {metric.name!r} is an lm-eval score: set eval_tasks_every (epoch or N)")
        if metric.needs_answers and self.exact_match_limit == 0:
            raise ParamError(f"best_metric {metric.name!r} scores generated answers, but exact_match_limit is 0")

    def eval_task_names(self) -> tuple[str, ...]:
        return tuple(name.strip() for name in (self.eval_tasks or "").split(",") if name.strip())

    def best(self) -> BestMetric:
        """best_metric resolved (cflib.train.best_metric)."""
        return resolve_best_metric(self.best_metric, self.greater_is_better, self.eval_task_names())

    def _validate_optimisation(self) -> None:
        """The optimizer, its schedule, the loss and the step's precision."""
        # An AdamW step moves each weight by about its group's learning rate: past MAX_LR one step wipes out the
        # model, and far past it the update overflows float32 inside the optimizer, after the run has started.
        if not 0 < self.lr <= MAX_LR:
            raise ParamError(f"lr must be positive and at most {MAX_LR:g}, got {self.lr}")
        if not self.weight_decay >= 0:  # written so that NaN fails too
            raise ParamError(f"weight_decay must be >= 0, got {self.weight_decay}")
        experts, adapters = self.expert_lr_multiplier, self.lora_lr_multiplier
        plus = 1.0 if self.full_parameter else max(self.lora_plus_ratio or 1.0, 1.0)  # _validate_lora checks it
        # An adapter on an expert: both multipliers; its B matrix under LoRA+ the ratio too. The embedding (or LoRA's
        # trainable rows of it) is neither an expert nor an adapter: its own multiplier alone.
        highest = self.lr * max(1.0, experts, adapters * plus, experts * adapters * plus, self.embedding_lr_multiplier)
        if highest > MAX_LR:
            ratio = f" x lora_plus_ratio {plus:g}" if plus != 1.0 else ""
            embedding = (f" (embedding_lr_multiplier {self.embedding_lr_multiplier})"
                         if self.embedding_lr_multiplier != 1.0 else "")
            raise ParamError(f"lr {self.lr} x expert_lr_multiplier {experts} x lora_lr_multiplier {adapters}{ratio}"
                             f"{embedding} gives a group the learning rate {highest:g}, above {MAX_LR:g}")
        if highest * self.weight_decay >= 1:  # each step scales the weights by 1 - lr x weight_decay
            raise ParamError(f"lr x weight_decay must be below 1 in every group (each step scales its decayed weights "
                             f"by 1 - lr x weight_decay), got {highest:g} x {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ParamError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not MIN_ADAM_EPSILON <= self.adam_epsilon <= MAX_ADAM_EPSILON:
            raise ParamError(f"adam_epsilon must be in [{MIN_ADAM_EPSILON:g}, {MAX_ADAM_EPSILON:g}] (it keeps AdamW's "
                             "update finite where a gradient's second moment is near 0; past the upper bound it "
                             f"outweighs the moment and AdamW turns into momentum SGD), got {self.adam_epsilon}")
        self._validate_schedule()
        self._validate_optimizer()
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ParamError(f"max_grad_norm must be None or positive, got {self.max_grad_norm}")
        if self.loss_type not in LOSSES:
            raise ParamError(f"loss_type must be one of {tuple(LOSSES)}, got {self.loss_type!r}")
        alpha = self.neftune_noise_alpha
        if alpha is not None and not 0 <= alpha <= MAX_NEFTUNE_ALPHA:
            raise ParamError(f"neftune_noise_alpha must be None (off), 0 (off) or a positive number up to "
                             f"{MAX_NEFTUNE_ALPHA:g} (NEFTune's paper uses 5 to 15), got {alpha}")

    def _validate_optimizer(self) -> None:
        """The optimizer's choice and its own settings; what it steps of the model is checked once the model is built
        (cflib.train.optimizer_choice.optimizer_plan)."""
        if self.optimizer not in OPTIMIZERS:
            raise ParamError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {shown(self.optimizer)}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ParamError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        # A setting the chosen optimizer does not read would do nothing: refused, as min_lr_ratio is without decay.
        unread = (("muon_momentum",) if self.optimizer != "muon" else ()) + (
            ("beta1", "beta2", "adam_epsilon") if self.optimizer == "adafactor" else ())
        for name in unread:
            if getattr(self, name) != Optimisation.__dataclass_fields__[name].default:
                reads, other = ((f"only optimizer: muon reads it (this run's is {self.optimizer})", "set optimizer: "
                                 "muon") if name.startswith("muon") else
                                ("optimizer: adafactor keeps no first moment, decays its second moment's average by "
                                 "the step (torch's beta2_decay) and adds no epsilon", "choose adamw or muon"))
                raise ParamError(f"{name} {getattr(self, name)} is set, but {reads}: it would do nothing; remove it, "
                                 f"or {other}")
        if self.optimizer == "muon" and not self.full_parameter:
            raise ParamError("optimizer: muon steps whole weight matrices, but full_parameter is false: LoRA trains "
                             "low-rank factors, which Muon's orthogonalised update was neither designed nor measured "
                             "for; choose optimizer: adamw (or adafactor) for LoRA")

    def _validate_schedule(self) -> None:
        """The learning-rate schedule's own settings; how they fit the run's steps is checked once those are known
        (cflib.train.run.resolve_schedule)."""
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ParamError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ParamError(f"warmup_steps must be None or >= 0, got {self.warmup_steps}")
        # warmup_steps, where set, wins over warmup_ratio whatever its value (a params file's, a stage's base's): the
        # run's description and record say the ratio is unused (cflib.train.run.resolve_schedule).
        if self.lr_schedule not in SCHEDULES:
            raise ParamError(f"lr_schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if not 0.0 <= self.min_lr_ratio < 1.0:
            raise ParamError(f"min_lr_ratio must be in [0, 1) (a fraction of lr), got {self.min_lr_ratio}")
        if self.min_lr_ratio and self.lr_schedule == "constant":
            raise ParamError(f"min_lr_ratio {self.min_lr_ratio} is set, but lr_schedule constant never decays: it "
                             "would do nothing; remove it, or choose cosine, linear or wsd")
        if self.lr_decay_ratio is not None:
            if self.lr_schedule != "wsd":
                raise ParamError(f"lr_decay_ratio {self.lr_decay_ratio} is set, but only lr_schedule wsd reads it "
                                 f"(this run's is {self.lr_schedule}): it would do nothing; remove it, or set "
                                 "lr_schedule: wsd")
            if not 0.0 < self.lr_decay_ratio <= 1.0:
                raise ParamError(f"lr_decay_ratio must be in (0, 1], got {self.lr_decay_ratio}")

    def _validate_curriculum_controls(self) -> None:
        """What selects and weights the train examples, and the curriculum's own controls."""
        if self.loss_groups is not None:
            parse_loss_groups(self.loss_groups)
        if self.filters is not None:
            parse_filters(self.filters, "filters")
        if self.early_stopping_patience is not None and self.early_stopping_patience <= 0:
            raise ParamError(f"early_stopping_patience must be None or positive, got {self.early_stopping_patience}")
        for name in ("expert_lr_multiplier", "lora_lr_multiplier", "embedding_lr_multiplier"):
            if not getattr(self, name) > 0:
                raise ParamError(f"{name} must be positive, got {getattr(self, name)}")
        if self.embedding_lr_multiplier != 1.0 and "embeddings" in (self.frozen_modules or ()):
            raise ParamError(f"embedding_lr_multiplier {self.embedding_lr_multiplier:g} is set, but frozen_modules "
                             "freezes the embeddings: it would do nothing; remove one of the two")
        if self.through_stage is not None and self.curriculum is None:
            raise ParamError(f"through_stage {self.through_stage!r} names a stage, but no curriculum is set")

    def _validate_lora(self) -> None:
        from cflib.model.lora import BASE_DTYPES, SCALINGS, TARGETS  # the model layer owns what can be adapted

        given = [name for name in LORA_PARAMETERS if getattr(self, name) is not None]
        if self.full_parameter:
            if given:
                raise ParamError(f"{given[0]} is a LoRA setting, but full_parameter is true (every weight trains); "
                                 "set full_parameter: false for LoRA, or remove " + ", ".join(given))
            return
        if self.init_checkpoint is None and self.resume is None:
            raise ParamError("full_parameter: false trains LoRA adapters on a frozen base model: set "
                             "init_checkpoint to the trained checkpoint to adapt")
        if self.lora_rank is not None and self.lora_rank <= 0:
            raise ParamError(f"lora_rank must be a positive integer, got {self.lora_rank}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ParamError(f"lora_alpha must be positive, got {self.lora_alpha}")
        if self.lora_scaling is not None and self.lora_scaling not in SCALINGS:
            raise ParamError(f"lora_scaling must be one of {', '.join(SCALINGS)} (standard: the update is scaled by "
                             f"alpha / rank; rslora: by alpha / sqrt(rank)), got {shown(self.lora_scaling)}")
        if self.lora_scaling == "rslora" and self.lora_alpha is None:
            # The default alpha (the rank) keeps the standard scale at 1 for every rank; under rslora it would be
            # sqrt(rank), 3 to 16 times the update, growing with the rank rslora is meant to free.
            rank = self.lora_rank or 8
            raise ParamError(f"lora_scaling: rslora scales the update by lora_alpha / sqrt(lora_rank): set lora_alpha "
                             f"with it (left unset it would be the rank, a scale of sqrt({rank}) = {rank ** 0.5:.3g}); "
                             f"lora_alpha: {rank ** 0.5:.3g} starts at the standard scale of 1")
        if self.lora_plus_ratio is not None and not self.lora_plus_ratio >= 1.0:  # its top: _validate_optimisation
            raise ParamError(f"lora_plus_ratio is LoRA+'s B matrices' learning rate over the A matrices': at least 1 "
                             f"(None or 1: off; LoRA+'s authors start from 16), got {self.lora_plus_ratio}")
        if self.lora_dropout is not None and not 0.0 <= self.lora_dropout < 1.0:
            raise ParamError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        self._validate_dora()
        if self.lora_targets is not None:
            unknown = [name for name in self.lora_targets if name not in TARGETS]
            if unknown or not self.lora_targets:
                what = f"{unknown[0]!r} is not an adaptable weight" if unknown else "names no weight"
                raise ParamError(f"lora_targets: {what}; choose from {', '.join(TARGETS)} (embeddings and norms "
                                 "stay frozen)")
            if len(set(self.lora_targets)) != len(self.lora_targets):
                raise ParamError(f"lora_targets repeats a name: {list(self.lora_targets)}")
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise ParamError(f"base_dtype must be one of {tuple(BASE_DTYPES)}, got {self.base_dtype!r}")
        if self.base_dtype == "bfloat16" and not self.bf16:
            raise ParamError("base_dtype: bfloat16 holds the frozen weights in BF16 for BF16 autocast GEMMs; "
                             "set bf16: true, or keep base_dtype float32")


    def _validate_freezing(self) -> None:
        """frozen_modules names families of cflib's modules, in a full-parameter run, and leaves some weight to train;
        frozen_layers narrows the layer families to some layers (checked against the model by cflib.train.freezing)."""
        families, layers = self.frozen_modules, self.frozen_layers
        if families is not None:
            unknown = [name for name in families if name not in FROZEN_FAMILIES]
            if unknown or not families:
                what = f"{unknown[0]!r} is not a module family" if unknown else "names no module family"
                raise ParamError(f"frozen_modules: {what}; choose from {', '.join(FROZEN_FAMILIES)} (None: every "
                                 "weight trains)")
            if len(set(families)) != len(families):
                raise ParamError(f"frozen_modules repeats a name: {list(families)}")
            if not self.full_parameter:
                raise ParamError("frozen_modules chooses the weights a full-parameter run trains, but full_parameter "
                                 "is false (LoRA trains adapters on a base that is frozen whole): remove "
                                 "frozen_modules, or set full_parameter: true")
            if set(families) == set(FROZEN_FAMILIES) and layers is None:
                raise ParamError(f"frozen_modules names every module family ({', '.join(FROZEN_FAMILIES)}) in every "
                                 "layer: nothing would train; leave one out, or narrow them with frozen_layers")
        if layers is not None and not layers:
            raise ParamError("frozen_layers names no layer (None: every layer)")
        if layers is not None and not set(families or ()) & set(LAYER_FAMILIES):
            raise ParamError(f"frozen_layers {shown(self.frozen_layers)} narrows the layer families of frozen_modules "
                             f"({', '.join(LAYER_FAMILIES)}), but frozen_modules names none of them: add them, or "
                             "remove frozen_layers")

    def _validate_distillation(self) -> None:
        """A teacher, the KL term's share and temperature (cflib.train.teacher); the teacher's checkpoint itself is
        checked against the model when the run is prepared."""
        if self.teacher_checkpoint is None:
            unused = [name for name in ("distill_ratio", "distill_temperature") if getattr(self, name) != getattr(
                Loss, name)]
            if unused:
                raise ParamError(f"{unused[0]} is set, but teacher_checkpoint is not: nothing is distilled; set "
                                 f"teacher_checkpoint (a checkpoint, hub:ORG/NAME or init), or remove {unused[0]}")
            return
        if not self.teacher_checkpoint.strip():
            raise ParamError("teacher_checkpoint names no checkpoint (None: no teacher)")
        if not 0.0 <= self.distill_ratio <= 1.0:
            raise ParamError(f"distill_ratio is the KL term's share of the loss, in [0, 1] (0: the cross-entropy "
                             f"alone, the KL still measured; 1: the KL alone), got {self.distill_ratio}")
        if not 0.0 < self.distill_temperature <= MAX_DISTILL_TEMPERATURE:
            raise ParamError(f"distill_temperature must be positive and at most {MAX_DISTILL_TEMPERATURE:g} (1 "
                             f"compares the models' own distributions; 2 to 4 softens them), got "
                             f"{self.distill_temperature}")
        if self.teacher_checkpoint == TEACHER_INIT and self.init_checkpoint is None:
            raise ParamError("teacher_checkpoint: init distils from init_checkpoint, which is not set (a preset's "
                             "random weights teach nothing): set init_checkpoint, or name the teacher's checkpoint")
        builder = LOSSES[self.loss_type]
        if not (isinstance(builder, type) and issubclass(builder, SFTLoss)):
            raise ParamError(f"teacher_checkpoint: distillation adds its KL term to the built-in loss "
                             f"(sft_cross_entropy or dft) in one pass over the head, but loss_type is "
                             f"{self.loss_type!r}, a registered loss; use a built-in loss_type, or no teacher")

    def _validate_dora(self) -> None:
        """DoRA on the linear targets only: PEFT refuses use_dora on the expert tensors (3-D parameters), so adapters
        of them could not be exported in a form PEFT loads."""
        from cflib.model.lora import DORA_TARGETS, TARGETS  # the model layer owns what can be adapted

        if not self.lora_dora or self.lora_targets is None:  # unset: the linear targets (lora_settings)
            return
        experts = [name for name in self.lora_targets if name in TARGETS and name not in DORA_TARGETS]
        if experts:
            raise ParamError(f"lora_dora: DoRA adapts linear weights only (PEFT refuses use_dora on the expert tensors,"
                             f" 3-D parameters), but lora_targets names {', '.join(experts)}: set lora_targets to "
                             f"linear ones among {','.join(DORA_TARGETS)}, or leave it unset for all of them")

    def lora_settings(self) -> LoraSettings | None:
        """The LoRA settings this run asks for (defaults filled in), or None for full-parameter training."""
        from cflib.model.lora import DORA_TARGETS, LoraSettings  # the model layer owns what can be adapted

        if self.full_parameter:
            return None
        defaults = LoraSettings()
        rank = self.lora_rank or defaults.rank
        return LoraSettings(rank=rank, alpha=float(self.lora_alpha or rank),
                            scaling=self.lora_scaling or defaults.scaling, dora=bool(self.lora_dora),
                            dropout=self.lora_dropout if self.lora_dropout is not None else defaults.dropout,
                            targets=self.lora_targets or (DORA_TARGETS if self.lora_dora else defaults.targets),
                            base_dtype=self.base_dtype or defaults.base_dtype,
                            trainable_tokens=self.lora_trainable_tokens or ())


MAX_LR = 10.0  # far above any SFT learning rate; see _validate_optimisation
# AdamW's epsilon: 1e-8 is torch's and transformers' default, 1e-6 to 1e-5 common for BF16 or large models. Below
# MIN it no longer bounds the update where the second moment underflows float32; above MAX it outweighs the root of
# the second moment of any LLM gradient, and lr no longer sets the step's size.
MIN_ADAM_EPSILON, MAX_ADAM_EPSILON = 1e-20, 1e-2
# NEFTune's paper tries 5, 10 and 15: at 1,000 the noise of a 100-token example on a 1,024-wide embedding is about 3
# per coordinate, far above any trained embedding's entries, and the run would learn from noise alone.
MAX_NEFTUNE_ALPHA = 1000.0
# Far past the temperatures distillation uses (1 to 20): at 100 a language model's softmax is nearly flat, and the
# KL term nearly 0.
MAX_DISTILL_TEMPERATURE = 100.0
TEACHER_INIT = "init"  # teacher_checkpoint: init_checkpoint itself (cflib.train.teacher)

# What `full_parameter: false` reads; any of them with full_parameter: true is a mistake.
LORA_PARAMETERS = tuple(field.name for field in dataclasses.fields(Lora) if field.name != "full_parameter")


def gradient_accumulation(global_batch: int, micro_batch_per_rank: int, world_size: int) -> int:
    """global_batch = micro_batch_per_rank x world_size x grad_accum, or a clear error with options."""
    per_step = micro_batch_per_rank * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    lower, upper = global_batch // per_step * per_step, (global_batch // per_step + 1) * per_step
    batch_options = " or ".join(str(b) for b in (lower, upper) if b > 0)
    near = _nearest_micro_batches(global_batch, micro_batch_per_rank, world_size)
    micro = f", or micro_batch_per_rank in {near}" if near else (
        f"; no micro_batch_per_rank within {SUGGESTION_WINDOW} of {micro_batch_per_rank} divides it" if
        global_batch % world_size == 0 else f"; global_batch is not a multiple of world_size {world_size}")
    raise ParamError(
        f"global_batch {global_batch} is not a multiple of micro_batch_per_rank {micro_batch_per_rank} x "
        f"world_size {world_size} = {per_step}; nearest valid: global_batch {batch_options}{micro}")


# The micro-batches a refusal suggests are looked for this far either side of the one given: the search costs the
# same whatever the numbers (a global batch of 10**12 has no list of divisors to walk).
SUGGESTION_WINDOW = 4096


def _nearest_micro_batches(global_batch: int, micro_batch_per_rank: int, world_size: int) -> list[int]:
    """Up to three micro-batches near the one given for which global_batch is a whole number of steps."""
    if global_batch % world_size:
        return []
    per_rank = global_batch // world_size
    low = max(1, micro_batch_per_rank - SUGGESTION_WINDOW)
    high = min(per_rank, micro_batch_per_rank + SUGGESTION_WINDOW)
    found = [m for m in range(low, high + 1) if per_rank % m == 0]
    return sorted(sorted(found, key=lambda m: abs(m - micro_batch_per_rank))[:3])


def load_params_file(path: str | Path) -> dict[str, Any]:
    """A params/*.yaml file as a dict (validated when handed to TrainParams.from_dict)."""
    raw = read_yaml(path, ParamError, "parameter file")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ParamError(f"{path}: a parameter file holds a mapping of name: value")
    return raw
