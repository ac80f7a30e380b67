"""Training parameters: the notebook's parameters cell, papermill `-p`/`-f`, params/*.yaml.

Every value is checked here, before anything is built or written: unknown
names, wrong types, impossible ranges and impossible batch arithmetic.
Papermill delivers `-p` values as strings ("true", "None", "1e-3") and YAML
as typed values; both are accepted.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cflib.data.filters import parse_filters
from cflib.data.weighting import parse_loss_groups
from cflib.errors import ParamError
from cflib.ops.attention import backend_names, packed_problem
from cflib.ops.sft_loss import LOSSES
from cflib.train.trackers import check_report_to, with_report_to
from cflib.yamlio import read_yaml

DEVICES = ("auto", "cpu", "cuda")
KERNEL_CHOICES = ("auto", "true", "false")
STRATEGIES = ("auto", "ddp", "fsdp")


class ParamSet:
    """What every parameter set (TrainParams, TuneParams, ThroughputParams) shares: its names, to refuse others."""

    @classmethod
    def names(cls) -> list[str]:
        return [field.name for field in dataclasses.fields(cls)]


@dataclass(frozen=True)
class TrainParams(ParamSet):
    """The controls of one SFT run. Defaults: a CPU smoke run of a few seconds."""

    model: str = "smoke"  # a preset of cflib.model.config.PRESETS; ignored when init_checkpoint is set
    init_checkpoint: str | None = None  # checkpoint dir; its config.json gives the architecture
    data: str = "embedded"  # "embedded" or a shard root with train/ and eval/
    out_dir: str | None = None  # None: a new outputs/runs/<time>-<model> folder
    seed: int = 0
    seq_len: int = 64
    micro_batch_per_rank: int = 16
    global_batch: int = 32
    epochs: int = 1
    max_steps: int | None = 30  # None: whole epochs; 0: evaluation only
    lr: float = 1e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_ratio: float = 0.03
    max_grad_norm: float | None = 1.0
    nan_patience: int = 0  # non-finite steps skipped in a row before the run stops
    bf16: bool = False
    loss_type: str = "sft_cross_entropy"  # a loss of cflib.ops.sft_loss.LOSSES (register_loss adds one)
    loss_chunk_tokens: int = 1024
    fp32_loss: bool = True
    full_parameter: bool = True  # false: LoRA adapters on a frozen init_checkpoint (cflib.model.lora)
    lora_rank: int | None = None  # None: 8 when full_parameter is false
    lora_alpha: float | None = None  # None: lora_rank (scale alpha / rank = 1)
    lora_dropout: float | None = None  # None: 0.0 (the fused paths then run on the effective weights)
    lora_targets: tuple[str, ...] | None = None  # "q_proj,v_proj" or a list; None: all ten (cflib.model.lora)
    base_dtype: str | None = None  # float32 | bfloat16 (frozen weights held in BF16; needs bf16); None: float32
    lora_trainable_tokens: tuple[int, ...] | None = None  # embedding rows that train too: "69-94,101-126" or a list
    train_tasks: tuple[str, ...] | None = None  # train only on examples of these `task`s; eval stays whole
    grad_ckpt: bool = False
    use_custom_kernels: str = "auto"  # auto: fast paths where every check passes; true: require them; false: PyTorch
    # The shared SwiGLU's activation in quack's GEMM epilogues, inside cflib's TR-MoE block (Hopper): false until
    # measured end to end (docs/kernels.md); auto/true as above.
    epilogue_swiglu: str = "false"
    require_liger: bool = False  # fail before training unless Liger's kernels run
    # auto: FlashAttention-4 where it runs (Hopper+, bf16), else the next fastest; or one of ATTENTION_BACKENDS,
    # required (fa4 and cudnn_sdpa compute in bf16 even in an fp32 run; cudnn_sdpa cannot attend packed windows)
    attention_backend: str = "auto"
    eval_at_start: bool = True
    eval_every_steps: int | None = None
    eval_micro_batch: int | None = None  # None: micro_batch_per_rank
    exact_match_limit: int | None = None  # None: every eval prompt; 0: skip exact match
    save_checkpoints: bool = True
    save_optimizer_state: bool = False  # beside epoch checkpoints, so a run can resume from them
    save_every_steps: int | None = None  # resumable step-N checkpoints in between
    save_total_limit: int | None = None  # keep the newest N epoch/step checkpoints, plus the best
    resume: str | None = None  # None; "latest" (or true): out_dir's newest resumable checkpoint; or its path
    allow_world_size_change: bool = False  # resume on another number of processes
    allow_resume_changes: tuple[str, ...] | None = None  # changed on purpose by a resume: "data,max_grad_norm"
    device: str = "auto"
    # Data parallelism: more than one process starts torchrun from the notebook.
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # host:port of the rendezvous, needed when nnodes > 1
    strategy: str = "auto"  # auto | ddp | fsdp: DDP when model + optimizer state fit one device
    collective_timeout_s: int = 1800  # bounds every collective, rank 0's evaluation and saves included
    # The data path: packing, 2-D loss weighting (cflib.data.weighting), shard preflight (cflib.data.preflight).
    pack_sequences: bool = False  # whole examples in seq_len windows, each attending only to itself
    loss_groups: dict | None = None  # group -> {target_share, tasks, task_target_shares}; None: unweighted
    max_task_loss_weight: float = 30.0  # a larger loss coefficient stops the run before training
    require_release_ready: bool = False  # any shard/manifest mismatch is fatal, not a warning
    # Experiment trackers, named as transformers names them (cflib.train.trackers): rank 0 reports, never blocks.
    report_to: tuple[str, ...] | None = None  # None or "none"; "tensorboard", "mlflow", "all", or a list
    mlflow_tracking_uri: str | None = None  # None: an SQLite store in out_dir/mlruns
    # After training: lm-evaluation-harness on the run's Hub bundle (cflib.lab.evaluate, train_sft's last cell),
    # task names as "embedded_choice,embedded_exact" (shipped) or "piqa,arc_easy" (lm-eval's, needs network)
    eval_tasks: str | None = None
    # Curricula and their controls (cflib.train.curriculum, docs/curricula.md): stages in one run folder, each a
    # run of these parameters with its own overrides; filters, parameter groups and early stopping serve any run.
    curriculum: str | None = None  # a curriculum YAML file: its stages run in order in out_dir/stages/<name>/
    through_stage: str | None = None  # run the curriculum up to and including this stage
    dry_run: bool = False  # resolve every stage against the data, write the audit, train nothing
    filters: dict | None = None  # train examples kept: difficulties, tasks, domains, max_supervised_tokens, ...
    early_stopping_patience: int | None = None  # evaluations without a lower held-out loss before stopping
    expert_lr_multiplier: float = 1.0  # the routed experts' learning rate: lr x this
    lora_lr_multiplier: float = 1.0  # the LoRA adapters' learning rate: lr x this

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "parameters") -> "TrainParams":
        reject_unknown(raw, cls.names(), source)
        hints = typing.get_type_hints(cls)
        raw = with_report_to(with_token_ids(with_name_lists(raw)))
        if isinstance(raw.get("resume"), bool) or str(raw.get("resume")).lower() in ("true", "false"):
            raw = {**raw, "resume": "latest" if str(raw["resume"]).lower() == "true" else None}
        values = {name: _coerce(name, value, hints[name]) for name, value in with_kernel_choice(raw).items()}
        params = cls(**values)
        params.validate()
        return params

    @classmethod
    def from_namespace(cls, namespace: dict[str, Any]) -> "TrainParams":
        """The parameters a notebook defined (its parameters and injected-parameters cells)."""
        hints = typing.get_type_hints(cls)
        # Mappings are parameters only under a mapping-typed name: a later cell's `record` dict is not one.
        mappings = {name for name in cls.names() if _target_type(hints[name]) is dict}
        return cls.from_dict({name: value for name, value in namespace.items()
                              if _is_user_variable(name, value) or (name in mappings and isinstance(value, dict))
                              or (name in (*NAME_LISTS, "lora_trainable_tokens") and isinstance(value, (list, tuple)))},
                             source="notebook parameters")

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
        for name in ("eval_every_steps", "eval_micro_batch", "save_every_steps", "save_total_limit"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ParamError(f"{name} must be None or positive, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ParamError(f"lr must be positive, got {self.lr}")
        if not self.weight_decay >= 0:  # written so that NaN fails too
            raise ParamError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ParamError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ParamError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ParamError(f"max_grad_norm must be None or positive, got {self.max_grad_norm}")
        if self.loss_type not in LOSSES:
            raise ParamError(f"loss_type must be one of {tuple(LOSSES)}, got {self.loss_type!r}")
        if self.device not in DEVICES:
            raise ParamError(f"device must be one of {DEVICES}, got {self.device!r}")
        self._validate_lora()
        if self.train_tasks is not None and not self.train_tasks:
            raise ParamError("train_tasks must name at least one task, or be None for every example")
        if self.eval_tasks is not None and not [name for name in self.eval_tasks.split(",") if name.strip()]:
            raise ParamError(f"eval_tasks must name at least one lm-eval task, or be None (off), got {self.eval_tasks!r}")
        for name in ("use_custom_kernels", "epilogue_swiglu"):
            if getattr(self, name) not in KERNEL_CHOICES:
                raise ParamError(f"{name} must be one of {KERNEL_CHOICES} (or a boolean), got {getattr(self, name)!r}")
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
        if self.resume == "latest" and self.out_dir is None:
            raise ParamError("resume: latest needs the out_dir of the run to continue")
        gradient_accumulation(self.global_batch, self.micro_batch_per_rank, self.world_size)

    def _validate_curriculum_controls(self) -> None:
        """What selects and weights the train examples, and the curriculum's own controls."""
        if self.loss_groups is not None:
            parse_loss_groups(self.loss_groups)
        if self.filters is not None:
            parse_filters(self.filters, "filters")
        if self.early_stopping_patience is not None and self.early_stopping_patience <= 0:
            raise ParamError(f"early_stopping_patience must be None or positive, got {self.early_stopping_patience}")
        for name in ("expert_lr_multiplier", "lora_lr_multiplier"):
            if not getattr(self, name) > 0:
                raise ParamError(f"{name} must be positive, got {getattr(self, name)}")
        if self.through_stage is not None and self.curriculum is None:
            raise ParamError(f"through_stage {self.through_stage!r} names a stage, but no curriculum is set")

    def _validate_lora(self) -> None:
        from cflib.model.lora import BASE_DTYPES, TARGETS  # the model layer owns what can be adapted

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
        if self.lora_dropout is not None and not 0.0 <= self.lora_dropout < 1.0:
            raise ParamError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
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


# What `full_parameter: false` reads; any of them with full_parameter: true is a mistake.
LORA_PARAMETERS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "base_dtype",
                   "lora_trainable_tokens")
# Parameters holding a list of names: a YAML list, or one string "a,b" (papermill -p, a notebook scalar).
NAME_LISTS = ("lora_targets", "train_tasks", "report_to", "allow_resume_changes")


def with_name_lists(raw: dict[str, Any]) -> dict[str, Any]:
    """Every NAME_LISTS value as a tuple of stripped names (None stays None)."""
    out = dict(raw)
    for name in NAME_LISTS:
        value = raw.get(name)
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            continue
        if isinstance(value, str):
            value = value.strip().strip("[]()").split(",")
        if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
            raise ParamError(f"{name} must be a list of names or one comma-separated string, got {value!r}")
        out[name] = tuple(item.strip().strip("'\"") for item in value if item.strip())
    return out


def with_token_ids(raw: dict[str, Any]) -> dict[str, Any]:
    """lora_trainable_tokens as a tuple of ints: a YAML list of ids and "a-b" ranges, or one such string."""
    value = raw.get("lora_trainable_tokens")
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
        return raw
    items = value.strip().strip("[]()").split(",") if isinstance(value, str) else value
    ids: list[int] = []
    for item in items if isinstance(items, (list, tuple)) else [items]:
        text = str(item).strip()
        low, _, high = text.partition("-") if "-" in text[1:] else (text, "", text)
        try:
            ids.extend(range(int(low), int(high) + 1))
        except ValueError:
            raise ParamError(f"lora_trainable_tokens: {text!r} is not a token id or an a-b range of them") from None
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ParamError(f"lora_trainable_tokens: token ids must be distinct and >= 0, got {value!r}")
    return {**raw, "lora_trainable_tokens": tuple(ids)}


def reject_unknown(raw: dict[str, Any], known: list[str], source: str) -> None:
    """ParamError naming the first name of `raw` that is not in `known`, with the likeliest meant."""
    for name in raw:
        if name not in known:
            # A known name that extends the unknown one ("micro_batch") beats spelling distance.
            close = [k for k in known if k.startswith(name)] or difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ParamError(f"{source}: unknown parameter {name!r}{hint}; known: {', '.join(known)}")


def with_kernel_choice(raw: dict[str, Any]) -> dict[str, Any]:
    """use_custom_kernels and epilogue_swiglu as "auto"/"true"/"false": YAML gives booleans, papermill strings
    in any case."""
    found = dict(raw)
    for name in ("use_custom_kernels", "epilogue_swiglu"):
        if isinstance(value := raw.get(name), (bool, str)):
            found[name] = str(value).strip().lower()
    return found


def gradient_accumulation(global_batch: int, micro_batch_per_rank: int, world_size: int) -> int:
    """global_batch = micro_batch_per_rank x world_size x grad_accum, or a clear error with options."""
    per_step = micro_batch_per_rank * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    lower, upper = global_batch // per_step * per_step, (global_batch // per_step + 1) * per_step
    batch_options = " or ".join(str(b) for b in (lower, upper) if b > 0)
    micro_options = [m for m in range(1, global_batch + 1) if global_batch % (m * world_size) == 0]
    near = sorted(micro_options, key=lambda m: abs(m - micro_batch_per_rank))[:3]
    raise ParamError(
        f"global_batch {global_batch} is not a multiple of micro_batch_per_rank {micro_batch_per_rank} x "
        f"world_size {world_size} = {per_step}; nearest valid: global_batch {batch_options}, "
        f"or micro_batch_per_rank in {sorted(near)}")


def load_params_file(path: str | Path) -> dict[str, Any]:
    """A params/*.yaml file as a dict (validated when handed to TrainParams.from_dict)."""
    raw = read_yaml(path, ParamError, "parameter file")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ParamError(f"{path}: a parameter file holds a mapping of name: value")
    return raw


_NOTEBOOK_BUILTINS = {"In", "Out", "exit", "quit", "get_ipython", "open"}


def _is_user_variable(name: str, value: Any) -> bool:
    # Parameters are scalars; the objects later cells make (params, run, record, imports)
    # are not, so re-running the notebook top to bottom in JupyterLab stays valid.
    if name.startswith("_") or name in _NOTEBOOK_BUILTINS:
        return False
    return value is None or isinstance(value, (bool, int, float, str, Path))


_TRUE, _FALSE, _NONE = {"true", "yes", "1", "on"}, {"false", "no", "0", "off"}, {"none", "null", "~", ""}


def _target_type(hint: Any) -> Any:
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return next(option for option in options if option is not type(None))


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Bring a value (possibly a papermill string) to the declared type, or fail naming it."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    nullable = type(None) in options
    target = _target_type(hint)
    if value is None or (nullable and isinstance(value, str) and value.strip().lower() in _NONE):
        if nullable:
            return None
        raise ParamError(f"{name} cannot be None")
    if target is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ParamError(f"{name} must be true or false, got {value!r}")
    if target is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ParamError(f"{name} must be an integer{' or None' if nullable else ''}, got {value!r}")
    if target is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ParamError(f"{name} must be a number, got {value!r}")
    if target is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ParamError(f"{name} must be a string, got {value!r}")
    if typing.get_origin(target) is tuple:  # a NAME_LISTS value, already a tuple of names (with_name_lists)
        return tuple(value)
    if target is dict:  # a nested mapping: from YAML (-f) or a notebook dict, or -p as a YAML/JSON string
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as err:
                raise ParamError(f"{name}: not a YAML/JSON mapping ({err})") from None
        if isinstance(value, dict):
            return value
        raise ParamError(f"{name} must be a mapping{' or None' if nullable else ''}, got {value!r}")
    raise TypeError(f"unsupported parameter type {hint} for {name}")
