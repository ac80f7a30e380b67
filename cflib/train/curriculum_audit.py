"""Every stage of a curriculum resolved against the actual shard, before anything trains.

Per stage: the filters' counts (and the examples overlong_examples: drop
leaves out), the supervised tokens kept, a mixture's plan (each
source's share of the first epoch's examples and supervised tokens), the loss weighting
(every cell's visible supervised tokens at the stage's seq_len, its
coefficient, whether the achieved shares match the targets and which cells
exceed max_task_loss_weight), the batch arithmetic and the memory estimate,
and `passed`. A run checks every stage this way and stops at the first that
fails; `dry_run: true` writes the audit (dry_run.json) and shows it instead.
Nothing here builds a model or touches a GPU.
"""
from __future__ import annotations

import sys

from cflib.data.mixture import MixturePlan, mixture_table
from cflib.data.shards import ShardError
from cflib.data.weighting import SHARE_TOLERANCE, audit_table, derive_loss_weights
from cflib.errors import ParamError
from cflib.model.config import ModelConfig
from cflib.train.curriculum import Curriculum, Stage
from cflib.train.positions import run_config
from cflib.train.run import (
    memory_figures,
    plan_units,
    resolve_device,
    schedule_steps,
    visible_supervised,
)
from cflib.train.run_data import Partition, RunData, kept_data, open_data
from cflib.train.teacher import teacher_config


def _weighting(stage: Stage, kept: Partition, mixture: MixturePlan | None) -> dict:
    """The loss policy's audit; an over-cap cell is reported here and is an error of the stage's run."""
    p = stage.params
    if p.loss_groups is None:
        return {"loss_weighting": None, "shares_match_targets": None, "overweight_tasks": [],
                "weights_within_cap": True}
    # Derived without the cap, so that the audit can show the cells that exceed it.
    weights = derive_loss_weights(p.loss_groups, kept.rows, visible_supervised(kept, mixture), sys.float_info.max,
                                  kept_data(p))
    cells = weights.audit()
    over = [row["cell"] for row in cells if row["coefficient"] > p.max_task_loss_weight]
    return {"loss_weighting": cells, "overweight_tasks": over, "weights_within_cap": not over,
            "shares_match_targets": all(abs(row["achieved_share"] - row["target_share"]) <= SHARE_TOLERANCE
                                        for row in cells)}


def _mixture(mixture: MixturePlan | None, kept: Partition) -> dict | None:
    """A mixture's plan and the shares of examples and supervised tokens its first epoch draws from each source."""
    if mixture is None:
        return None
    return {**mixture.record(), "first_epoch": mixture.realised(mixture.epoch(1), kept.supervised_counts)}


def _examples(data: RunData) -> dict:
    """The stage's train examples and those it keeps (each filter's count between, where filters ran): counted from
    before overlong_examples: drop, so the row's "kept N of M" shows what the drop left out too."""
    counts = dict(data.filter_counts or {"examples": len(data.train), "kept": len(data.train)})
    if data.overlong:
        counts["examples"] = sum(count["examples"] for partition, count in data.overlong["partitions"].items()
                                 if partition.startswith("train"))
    return counts


def audit_stage(stage: Stage, config: ModelConfig) -> dict:
    """One stage against its data, `config` the model it trains (its seq_len checked against its positions);
    ParamError or ShardError for what stops it before training."""
    p = stage.params
    data = open_data(p, config.vocab_size, check="tokens")
    kept, mixture = data.train, data.mixture
    _, units = plan_units(p, kept, mixture)
    steps_per_epoch, schedule = schedule_steps(units, p)
    weighting = _weighting(stage, kept, mixture)
    return {"stage": stage.name, "passed": weighting["weights_within_cap"], "overrides": stage.overrides,
            "examples": _examples(data),
            "overlong": data.overlong,
            "mixture": _mixture(mixture, kept),
            "supervised_tokens": kept.supervised_tokens(), "eval_examples": len(data.eval), "seq_len": p.seq_len,
            "max_position_embeddings": config.max_position_embeddings, "rope_scaling": config.rope_scaling,
            "global_batch": p.global_batch, "micro_batch_per_rank": p.micro_batch_per_rank,
            "grad_accum": p.grad_accum,
            "steps_per_epoch": steps_per_epoch, "total_steps": schedule.total_steps,
            **schedule.record(),
            "lr": p.lr, "max_task_loss_weight": p.max_task_loss_weight,
            "memory_estimate": memory_figures(config, p, resolve_device(p.device), teacher=teacher_config(p, config)),
            **weighting}


def audit(curriculum: Curriculum, config: ModelConfig, stop_at_first: bool) -> list[dict]:
    """Every stage that runs, audited, `config` the model the first starts from (each later one starts from the
    one before it, its positions included). stop_at_first: raise the first failure as a ParamError naming the
    stage (a run); otherwise report it in its row (a dry run)."""
    where = f"{curriculum.path}: " if curriculum.path is not None else ""
    rows = []
    for stage in curriculum.stages:
        row: dict = {}
        try:
            config = run_config(config, stage.params)  # the positions this stage trains
            row = audit_stage(stage, config)
            if not row["passed"]:
                raise ParamError(f"loss_groups: cell(s) {row['overweight_tasks']} would get a loss coefficient "
                                 f"above max_task_loss_weight {row['max_task_loss_weight']:g}; lower their targets "
                                 "or raise the cap")
        except (ParamError, ShardError) as err:
            message = f"{where}stage {stage.name!r}: {err}"
            if stop_at_first:
                raise ParamError(message) from None
            row = {**row, "stage": stage.name, "passed": False, "error": message}
        rows.append(row)
    return rows


def stages_table(rows: list[dict]) -> str:
    """The audit as a markdown table, then each weighted stage's cells."""
    lines = ["| stage | passed | examples kept | supervised tokens | seq_len | batch (accum) | steps (warm-up) "
             "| lr, schedule | memory / rank | shares match | over cap |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for row in rows:
        if "total_steps" not in row:
            lines.append(f"| {row['stage']} | no | | | | | | | | | |")
            continue
        memory = row["memory_estimate"]["total_bytes"] / 2**20
        lines.append(f"| {row['stage']} | {'yes' if row['passed'] else 'no'} | {row['examples']['kept']:,} of "
                     f"{row['examples']['examples']:,} | {row['supervised_tokens']:,} | {row['seq_len']} | "
                     f"{row['global_batch']} ({row['grad_accum']}) | {row['total_steps']} ({row['warmup_steps']}) | "
                     f"{row['lr']:g}, {row['lr_schedule']} | {memory:,.1f} MiB | "
                     f"{_yes_no(row['shares_match_targets'])} | {', '.join(row['overweight_tasks']) or 'none'} |")
    lines += [f"\n{row['error']}" for row in rows if "error" in row]
    for row in rows:
        if row.get("mixture"):
            lines += ["", f"stage {row['stage']}: mixture of {len(row['mixture']['sources'])} source(s), "
                          f"{row['mixture']['examples_per_epoch']:,} examples an epoch; shares of the first epoch's "
                          "draw", mixture_table(row["mixture"], row["mixture"]["first_epoch"])]
        if row.get("loss_weighting"):
            lines += ["", f"stage {row['stage']}: loss weighting (max_task_loss_weight "
                          f"{row['max_task_loss_weight']:g})", audit_table(row["loss_weighting"])]
    return "\n".join(lines)


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"
