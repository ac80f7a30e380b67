"""A curriculum file: stages of SFT, each one run's parameters with a few of its own (docs/curricula.md).

    version: 1
    seed: 0                    # optional: every stage's seed
    shared: &common {lr: 3e-3} # optional: anything, for YAML anchors the stages merge (<<: *common)
    stages:
      - name: warmup
        <<: *common
        filters: {difficulties: [easy], max_supervised_tokens: 64}
        seq_len: 192
      - name: all
        batch_size: 64
        loss_task_targets: {addition: 0.6, uppercase: 0.4}

A stage sets any training parameter (a key it does not set takes the run's),
`batch_size` (global_batch), `max_examples` (filters' max_examples),
`loss_task_targets` (per-task shares: one loss_groups group), `filters`, and
its own data: a mixture (`data` as a list of sources, `examples_per_epoch`).
`compare_one_stage: true` also trains the run's parameters alone for the
stages' total steps (out_dir/one_stage/), so the record holds both results.
What a run folder holds once (the model, out_dir, resume, processes) is the
run's alone. Every problem is a ParamError naming the file, the stage
and the key, raised before anything trains.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cflib.errors import ParamError, shown
from cflib.paths import resolve_path
from cflib.schema import reject_unknown
from cflib.train.params import TrainParams
from cflib.yamlio import read_yaml

VERSION = 1
TOP_KEYS = ["version", "seed", "shared", "stages", "compare_one_stage"]
# The names curriculum files give some parameters, and the training parameter each one sets.
ALIASES = {"batch_size": "global_batch"}
STAGE_KEYS = ["name", "loss_task_targets", "max_examples", *ALIASES]
# One run folder, one model, one set of processes: a stage cannot change them (it may set its own data or mixture).
RUN_ONLY = ("model", "init_checkpoint", "out_dir", "resume", "curriculum", "through_stage", "dry_run",
            "device", "nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "strategy", "allow_world_size_change",
            "allow_resume_changes", "full_parameter", "save_checkpoints", "report_to", "mlflow_tracking_uri",
            "eval_tasks", "push_to_hub")
# A stage's name is its folder's (stages/NAME/, whose checkpoints nest deeper): matched whole (fullmatch: `$` would
# let a trailing newline through) and short enough for any file system's name limit.
STAGE_NAME_MAX_CHARS = 100
STAGE_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{STAGE_NAME_MAX_CHARS - 1}}}")


@dataclass(frozen=True)
class Stage:
    name: str
    params: TrainParams  # the run's parameters with the stage's; out_dir is the stage's folder
    overrides: dict  # what the stage set, as training parameters


@dataclass(frozen=True)
class Curriculum:
    path: Path | None  # None: a dry run of one run's parameters, as a one-stage curriculum
    stages: list[Stage]  # those that run: through through_stage
    skipped: list[str]  # the stages after through_stage, checked but not run
    run: TrainParams  # the run's parameters (with the file's seed): what a stage does not set
    compare_one_stage: bool = False  # also train one stage of the same total steps, for the record


def _stage_overrides(raw: Any, where: str) -> dict:
    """A stage's keys as training parameters."""
    if not isinstance(raw, dict):
        raise ParamError(f"{where}: a stage is a mapping with a name, got {shown(raw)}")
    run_only = [key for key in raw if key in RUN_ONLY]
    if run_only:
        raise ParamError(f"{where}: {run_only[0]!r} is the run's, the same for every stage; set it as a parameter "
                         "of the run, not of a stage")
    known = [*STAGE_KEYS, *(name for name in TrainParams.names() if name not in RUN_ONLY)]
    reject_unknown(raw, known, where)
    overrides = {ALIASES.get(key, key): value for key, value in raw.items() if key != "name"}
    if "max_examples" in overrides:
        filters = dict(overrides.get("filters") or {})
        if "max_examples" in filters:
            raise ParamError(f"{where}: max_examples is set twice, in the stage and in its filters")
        overrides["filters"] = {**filters, "max_examples": overrides.pop("max_examples")}
    if "loss_task_targets" in overrides:
        overrides["loss_groups"] = _task_targets(overrides.pop("loss_task_targets"), overrides, where)
    return overrides


def _task_targets(targets: Any, overrides: dict, where: str) -> dict:
    """loss_task_targets (task -> share) as the one loss_groups group they are."""
    if "loss_groups" in overrides:
        raise ParamError(f"{where}: loss_task_targets and loss_groups both set the loss policy; keep one")
    if not isinstance(targets, dict) or not targets:
        raise ParamError(f"{where}: loss_task_targets must map each task to its share of the loss, got {shown(targets)}")
    shares = [share for share in targets.values() if isinstance(share, (int, float)) and not isinstance(share, bool)]
    if len(shares) == len(targets) and abs(sum(shares) - 1.0) > 1e-6:
        raise ParamError(f"{where}: loss_task_targets sum to {sum(shares):g}, not 1")
    return {"tasks": {"target_share": 1.0, "tasks": list(targets), "task_target_shares": dict(targets)}}


# What shapes a LoRA run's adapters: every stage continues the first stage's, so none may set other ones.
ADAPTER_KEYS = ("lora_rank", "lora_alpha", "lora_scaling", "lora_dora", "lora_dropout", "lora_targets",
                "base_dtype", "lora_trainable_tokens")


def _refuse_other_adapters(first: Stage, stage: Stage, where: str) -> None:
    """ParamError, before any stage trains, when a later stage of a LoRA run sets adapters unlike the first's: it
    starts from the adapters the stage before it saved, which it could not load."""
    if first.params.full_parameter or stage is first:
        return
    for key in ADAPTER_KEYS:
        if getattr(stage.params, key) != getattr(first.params, key):
            raise ParamError(f"{where}: {key} {getattr(stage.params, key)!r} differs from the first stage's "
                             f"{getattr(first.params, key)!r}; every stage of a LoRA run trains the same adapters, "
                             "so their settings are the first stage's (set them for the run, or in the first stage)")


def stage_params(run: TrainParams, overrides: dict, out_dir: Path, where: str) -> TrainParams:
    """The run's parameters with the stage's, checked; the stage trains into its own folder."""
    values = {name: getattr(run, name) for name in TrainParams.names()}
    # Where a stage starts (and whether it resumes) is decided when it runs (cflib.train.curriculum_run).
    # The curriculum pushes its last stage's model once, at its end (cflib.train.launch.fit), not each stage's.
    values.update(overrides, out_dir=str(out_dir), curriculum=None, through_stage=None, dry_run=False, resume=None,
                  push_to_hub=None)
    try:
        return TrainParams.from_dict(values, source=where)
    except ParamError as err:
        message = str(err)
        raise ParamError(message if message.startswith(where) else f"{where}: {message}") from None


def load_curriculum(params: TrainParams, out_dir: Path) -> Curriculum:
    """params.curriculum's stages, each checked as a run's parameters (the data is checked by the audit)."""
    path = resolve_path(params.curriculum)
    raw = read_yaml(path, ParamError, "curriculum file")
    if not isinstance(raw, dict):
        raise ParamError(f"{path}: a curriculum file is a mapping with version and stages")
    reject_unknown(raw, TOP_KEYS, str(path))
    if raw.get("version") != VERSION:
        raise ParamError(f"{path}: version must be {VERSION}, got {shown(raw.get('version'))}")
    stages_raw = raw.get("stages")
    if not isinstance(stages_raw, list) or not stages_raw:
        raise ParamError(f"{path}: stages must be a non-empty list of stages")
    run = params if raw.get("seed") is None else stage_params(params, {"seed": raw["seed"]}, out_dir, str(path))
    stages: list[Stage] = []
    for index, stage_raw in enumerate(stages_raw):
        name = stage_raw.get("name") if isinstance(stage_raw, dict) else None
        if not isinstance(name, str) or not STAGE_NAME.fullmatch(name):
            raise ParamError(f"{path}: stage {index + 1} needs a name of 1 to {STAGE_NAME_MAX_CHARS} letters, digits, "
                             f"'_', '.' or '-' (its folder's name), got {shown(name)}")
        where = f"{path}: stage {name!r}"
        if any(stage.name == name for stage in stages):
            raise ParamError(f"{where}: the name is used by an earlier stage; every stage has its own name")
        overrides = _stage_overrides(stage_raw, where)
        stages.append(Stage(name, stage_params(run, overrides, out_dir / "stages" / name, where), overrides))
        _refuse_other_adapters(stages[0], stages[-1], where)
    names = [stage.name for stage in stages]
    through = params.through_stage
    if through is not None and through not in names:
        raise ParamError(f"through_stage {through!r} names no stage of {path}; its stages: {', '.join(names)}")
    end = names.index(through) + 1 if through is not None else len(stages)
    compare = raw.get("compare_one_stage", False)
    if not isinstance(compare, bool):
        raise ParamError(f"{path}: compare_one_stage must be true or false, got {shown(compare)}")
    return Curriculum(path, stages[:end], names[end:], run, compare)


def one_stage(params: TrainParams, out_dir: Path) -> Curriculum:
    """A run without a curriculum as a curriculum of one stage, `run` (for its dry run)."""
    return Curriculum(None, [Stage("run", stage_params(params, {}, out_dir, "parameters"), {})], [], params)
