"""The views of a curriculum run: every stage's loss on one plot with its boundaries, and a row per stage."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from cflib.lab.report import _elsewhere, finish_loss_plot, plot_loss_curves
from cflib.train.records import read_metrics


def plot_stage_curves(curriculum: dict, save_to: str | Path | None = None) -> plt.Figure:
    """Train and held-out loss of each stage, end to end on one step axis; a dashed line where a stage begins. A
    stage with loss weights trains on their weighted token mean, which its legend says: its held-out loss, like
    every stage's, is the plain token mean."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    offset = 0
    for index, stage in enumerate(curriculum["stages"]):
        rows = read_metrics(Path(stage["out_dir"]) / "metrics.jsonl")
        train = [r for r in rows if r["event"] == "train"]
        evals = [r for r in rows if r["event"] == "eval"]
        color = f"C{index % 10}"
        weighted = ", weighted" if stage.get("loss_coefficients") else ""
        ax.plot([offset + r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.6, color=color,
                label=f"{stage['name']} (train{weighted})")
        ax.plot([offset + r["step"] for r in evals], [r["loss"] for r in evals], "o-", color=color,
                label=f"{stage['name']} (held-out)")
        if index:
            ax.axvline(offset, color="grey", ls="--", lw=0.8)
        offset += stage["steps"]
    return finish_loss_plot(fig, ax, "optimizer step, stages end to end", save_to, legend_size=8)


def stage_table(curriculum: dict) -> str:
    """Each stage's filters, examples kept, supervised tokens, loss weights and final held-out loss."""
    lines = ["| stage | filters | examples kept | supervised tokens | loss weights | steps | held-out loss | "
             "exact match |", "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for stage in curriculum["stages"]:
        filters = (stage["overrides"].get("filters") or {})
        weights = ", ".join(f"{cell} {weight:.2f}" for cell, weight in (stage["loss_coefficients"] or {}).items())
        exact = stage["final_eval"]["exact_match"]
        lines.append(f"| {stage['name']} | {', '.join(f'{k}: {v}' for k, v in filters.items()) or 'none'} | "
                     f"{stage['train_examples']:,} | {stage['supervised_tokens']:,} | {weights or 'unweighted'} | "
                     f"{stage['steps']} | {stage['final_eval']['loss']:.4f} | "
                     f"{'-' if exact is None else f'{exact:.3f}'} |")
    return "\n".join(lines)


def plot_run_curves(out_dir: Path, record: dict, save_to: str | Path | None = None) -> plt.Figure | None:
    """train_sft's loss plot: a curriculum's stages with their table, or one run's curves."""
    if record.get("dry_run"):
        print(_elsewhere(record))
        return None
    if not record.get("curriculum"):
        return plot_loss_curves(Path(out_dir) / "metrics.jsonl", save_to=save_to)
    figure = plot_stage_curves(record["curriculum"], save_to=save_to)
    print(stage_table(record["curriculum"]))
    return figure
