"""Plots of benchmark records: throughput and memory per path, memory against micro-batch, kernel error heat maps."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from cflib.atomic import save_figure
from cflib.bench.validate import error_grid


def _bars(ax: plt.Axes, entries: list[dict], field: str, label: str, fmt: str) -> None:
    """One group of bars per path, one bar per micro-batch; a path that did not run says why."""
    paths = list(dict.fromkeys(e["label"] for e in entries))
    micros = list(dict.fromkeys(e["micro_batch"] for e in entries))
    width = 0.8 / len(micros)
    for k, micro in enumerate(micros):
        for i, name in enumerate(paths):
            entry = next((e for e in entries if e["label"] == name and e["micro_batch"] == micro), None)
            x = i + (k - (len(micros) - 1) / 2) * width
            value = entry.get(field) if entry and entry["status"] == "ok" else None
            if value is None:
                why = entry["status"] if entry and entry["status"] != "ok" else "not measured"
                ax.text(x, 0, why, rotation=90, ha="center", va="bottom", fontsize=7, color="grey")
            else:
                bars = ax.bar(x, value, width, color=f"C{k}", label=f"micro-batch {micro}" if i == 0 else None)
                ax.bar_label(bars, labels=[fmt.format(value)], fontsize=6, rotation=90, padding=2)
    ax.set_xlim(-0.6, len(paths) - 0.4)
    ax.margins(y=0.15)  # room for the value labels above the tallest bar
    ax.set_xticks(range(len(paths)), paths, rotation=25, ha="right")
    ax.set_ylabel(label)
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot_throughput(record: dict, save_to: str | Path | None = None) -> plt.Figure:
    """Bars of steady-state throughput on each kind of batches, and of peak memory, for every path."""
    entries = [{**e, "label": e["path"] if e.get("batches", "random_rows") == "random_rows"
                else f"{e['path']} (realistic)"} for e in record["paths"]]
    dense = [e for e in entries if e.get("batches", "random_rows") == "random_rows"]
    realistic = [e for e in entries if e.get("batches") == "realistic"]
    panels = ([(dense, "tokens_per_s", "random rows: tokens/s", "{:,.0f}")] if dense else []) + (
        [(realistic, "supervised_tokens_per_s", "realistic lengths: supervised tokens/s", "{:,.0f}")]
        if realistic else []) + [(entries, "peak_memory_gib", "peak memory (GiB)", "{:.1f}")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        _bars(ax, *panel)
    fig.suptitle(f"{record['model']}, seq {record['seq_len']}, {record['precision']}, {record['device']['name']}")
    fig.tight_layout()
    if save_to is not None:
        save_figure(fig, save_to)
    return fig


def plot_microbatch_memory(record: dict, save_to: str | Path | None = None) -> plt.Figure:
    """A tuning record: measured peaks against microbatch, the fitted line, the budget and the choice."""
    budget, search = record["budget"], record["search"]
    unit, scale = ("GiB", 2**30) if budget["budget_gib"] >= 1 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(7, 4))
    sweep = record.get("sweep")
    if sweep:
        measured = [p for p in sweep["probes"] if p["peak_bytes"] is not None]
        ax.plot([p["micro"] for p in measured], [p["peak_bytes"] / scale for p in measured], ".", color="0.6",
                label="exhaustive sweep (measured)")
        for probe in (p for p in sweep["probes"] if p["outcome"] == "out_of_memory"):
            ax.plot(probe["micro"], budget["budget_bytes"] / scale, "v", color="tab:red",
                    label=f"sweep: out of memory at {probe['micro']}")
    for outcome, style, label in (("fits", "o", "search probe: fits"), ("over_budget", "x", "search probe: over")):
        probes = [p for p in search["probes"] if p["outcome"] == outcome]
        if probes:
            ax.plot([p["micro"] for p in probes], [p["peak_bytes"] / scale for p in probes], style, ms=8, label=label)
    for probe in (p for p in search["probes"] if p["outcome"] == "out_of_memory"):
        ax.axvline(probe["micro"], color="tab:red", ls=":", label=f"out of memory at {probe['micro']}")
    top = max([p["micro"] for p in search["probes"]] + ([p["micro"] for p in sweep["probes"]] if sweep else []))
    fit = record["fit"]
    if fit is not None:
        xs = [1, top + 1]
        ax.plot(xs, [(fit["intercept_bytes"] + fit["slope_bytes_per_example"] * x) / scale for x in xs], "-",
                lw=1, color="tab:blue", label=f"predicted (line through {tuple(fit['through_micro'])})")
    usable, cap = budget["usable_bytes"] / scale, budget["budget_bytes"] / scale
    ax.axhline(usable, color="tab:orange", ls="--", label=f"usable {usable:.4g} {unit} (headroom {budget['headroom']:.0%})")
    ax.axhline(cap, color="tab:red", ls="--", label=f"budget {cap:.4g} {unit} (the cap)")
    ax.axvline(record["tuned_micro_batch_per_rank"], color="tab:green", lw=1,
               label=f"tuned: {record['tuned_micro_batch_per_rank']}")
    ax.set_xlabel("microbatch per rank (examples)")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title(f"{record['memory_measure'].split(' (')[0]}, seq_len {record['params']['seq_len']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    if save_to is not None:
        save_figure(fig, save_to)
    return fig


def plot_error_heatmap(rows: list[dict], save_to: str | Path | None = None) -> plt.Figure:
    """log10(error / tolerance) per tensor and shape/dtype: below 0 passes."""
    row_keys, col_keys, cells = error_grid(rows)
    fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(col_keys), 0.8 + 0.28 * len(row_keys)))
    image = ax.imshow(cells, cmap="RdYlGn_r", vmin=-4, vmax=1, aspect="auto")
    ax.set_xticks(range(len(col_keys)), col_keys, rotation=30, ha="right")
    ax.set_yticks(range(len(row_keys)), row_keys, fontsize=8)
    fig.colorbar(image, ax=ax, label="log10(error / tolerance)")
    ax.set_title("fast paths vs float64 truth (> 0 fails)")
    fig.tight_layout()
    if save_to is not None:
        save_figure(fig, save_to, dpi=110)
    return fig
