"""What a notebook shows of a run: loss curves, the exact-match table, a summary."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from .plan import format_arithmetic, run_arithmetic
from .records import read_metrics


def _elsewhere(record: dict) -> str | None:
    """Nodes other than node 0 hold no record: say so instead of failing."""
    if "eval" in record:
        return None
    return (f"node {record.get('node_rank')}: its ranks trained; rank 0 writes the record, metrics and "
            "checkpoints on node 0")


def plot_loss_curves(metrics_path: str | Path, save_to: str | Path | None = None) -> plt.Figure | None:
    """Training loss per optimizer step and held-out loss at each evaluation."""
    if not Path(metrics_path).is_file():
        print(f"no metrics at {metrics_path} (rank 0 writes them, on node 0)")
        return None
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r["event"] == "train"]
    evals = [r for r in rows if r["event"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.8, label="train (per step)")
    ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("SFT loss (nats / supervised token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if save_to is not None:
        fig.savefig(save_to, dpi=120)
    return fig


def exact_match_table(record: dict) -> str:
    """Markdown: exact match per task at the start and at the end of the run."""
    if _elsewhere(record):
        return _elsewhere(record)
    start = record["eval"].get("at_start", {}).get("exact_match", {})
    final = record["eval"]["final"].get("exact_match")
    if not final:
        return "_exact match was not computed (exact_match_limit: 0)_"
    lines = ["| task | at start | final |", "| --- | ---: | ---: |"]
    for task, rate in final.items():
        before = f"{start[task]:.3f}" if task in start else "-"
        lines.append(f"| {task} | {before} | {rate:.3f} |")
    return "\n".join(lines)


def show_exact_match(record: dict) -> None:
    """The exact-match table, as markdown in JupyterLab and as text under papermill."""
    from IPython.display import display

    table = exact_match_table(record)
    display({"text/markdown": table, "text/plain": table}, raw=True)


def headline(record: dict) -> str:
    """One deterministic line for a run (what nbval compares for the default parameters)."""
    return _elsewhere(record) or (
        f"{record['params_trainable']:,} trainable parameters, {record['schedule']['steps_done']} steps, "
        f"grad_accum {record['grad_accum']}, kernel path {record['kernel_path']}")


def summary(record: dict) -> str:
    if _elsewhere(record):
        return _elsewhere(record)
    final, start = record["eval"]["final"], record["eval"].get("at_start")
    throughput = record["throughput"]["steady_state_tokens_per_s"]
    lines = [
        f"out_dir            {record['out_dir']}",
        f"parameters         {record['params_total']:,} total, {record['params_trainable']:,} trainable",
        f"steps              {record['schedule']['steps_done']} of {record['schedule']['total_steps']}",
        f"eval loss          {start['loss']:.4f} -> {final['loss']:.4f}" if start
        else f"eval loss          {final['loss']:.4f}",
    ]
    if "exact_match" in final:
        lines.append(f"exact match        {final['exact_match']['overall']:.3f} overall")
    if throughput:
        lines.append(f"steady tokens/s    {throughput:,.0f} on {record['device']['name']} ({record['precision']})")
    lines.append(f"kernel path        {record['kernel_path']}")
    return "\n".join(lines)


def plan_like_this_run(record: dict, gpus: int = 8, epochs: int = 3) -> str:
    """The planner's arithmetic for `epochs` passes over this run's data on `gpus` data-parallel
    ranks, at this run's measured steady throughput per rank."""
    measured = record.get("throughput", {}).get("steady_state_tokens_per_s")
    if not measured:
        return "_no steady-state throughput was measured (no optimizer step ran)_"
    train_tokens = record["data"]["train_examples"] * record["seq_len"]
    report = run_arithmetic(target_tokens=train_tokens * epochs, gpus=gpus,
                            micro_batch_per_rank=record["micro_batch_per_rank"], seq_len=record["seq_len"],
                            tokens_per_s_per_gpu=measured / record["world_size"], checkpoints=epochs)
    return format_arithmetic(report)


# --- throughput: the side-by-side record of cflib.throughput -----------------------------

PERF_TABLE_BEGIN = "<!-- perf-table {} -->"
PERF_TABLE_END = "<!-- /perf-table -->"


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def perf_table(record: dict) -> str:
    """Markdown: every path's steady-state figures, the ratios against issue 4's targets, the kernels read back."""
    device, framework = record["device"], record["framework"]
    ceiling = record["matmul_ceiling"]
    lines = [
        f"{device['name']} x {device['count']}, torch {framework['torch']}, {record['precision']}, "
        f"seq {record['seq_len']:,}, {record['timing_protocol']['timed_steps']} timed steps after "
        f"{record['timing_protocol']['warmup_steps_excluded']} warm-up; {ceiling['dtype']} matmul "
        f"{ceiling['size']}^3 ceiling {ceiling['tflops_per_s']:,.1f} TFLOP/s in the same run; "
        f"cflib {(framework.get('cflib_commit') or 'unknown')[:7]}",
        "",
        "| path | micro-batch | tokens/s | model TFLOP/s | MFU | peak GiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for entry in record["paths"]:
        if entry["status"] == "ok":
            lines.append(f"| {entry['path']} | {entry['micro_batch']} | {_number(entry['tokens_per_s'])} | "
                         f"{_number(entry['model_tflops_per_s'], 1)} | {entry['mfu']:.1%} | "
                         f"{_number(entry['peak_memory_gib'], 1)} |")
        else:
            lines.append(f"| {entry['path']} | {entry['micro_batch']} | {entry['status']} | - | - | "
                         f"{_number(entry.get('peak_memory_gib'), 1)} |")
    lines += ["", "| ratio | micro-batch | measured | target | met |", "| --- | ---: | ---: | ---: | :---: |"]
    for row in record["comparison"]:
        quantity = {"tokens_per_s": "tokens/s", "peak_memory_gib": "peak memory"}[row["quantity"]]
        label = f"{quantity}: {row['numerator']} / {row['denominator']}"
        if row["value"] is None:
            lines.append(f"| {label} | {row['micro_batch']} | - | {row['target']} | not measured |")
        else:
            label += f" ({row['denominator_entry']})" if row["denominator"] == "best_peer" else ""
            lines.append(f"| {label} | {row['micro_batch']} | {row['value']:.2f} | {row['target']} | "
                         f"{'yes' if row['met'] else 'no'} |")
    lines += ["", "| path | kernels read back | compiled |", "| --- | --- | --- |"]
    seen = set()
    for entry in record["paths"]:
        if entry["status"] == "ok" and entry["path"] not in seen:
            seen.add(entry["path"])
            kernels = ", ".join(f"{name} {value}" for name, value in entry["kernel_path"].items())
            lines.append(f"| {entry['path']} | {kernels} | {entry['compiled'] or 'no'} |")
    skipped = {e["path"]: e for e in record["paths"] if e["status"] != "ok" and e["path"] not in seen}
    for name, entry in skipped.items():
        lines.append(f"| {name} | {entry['status']}: {entry['reason'].replace('|', '/')} | - |")
    timed = [e for e in record["paths"] if e.get("evaluation_and_checkpoint", {}).get("status") == "ok"]
    for entry in timed:
        io = entry["evaluation_and_checkpoint"]
        lines.append("")
        lines.append(f"{entry['path']}, outside the figures above: one full evaluation ({io['eval_examples']} "
                     f"examples) {io['eval_s']:.2f} s; one checkpoint save ({io['checkpoint_bytes'] / 2**20:,.0f} "
                     f"MiB) {io['checkpoint_save_s']:.2f} s.")
    return "\n".join(lines)


def update_readme_perf_table(readme: str, record_name: str, table: str) -> str:
    """README text with the block between the record's perf-table markers replaced by `table`."""
    begin = PERF_TABLE_BEGIN.format(record_name)
    if begin not in readme:
        raise ValueError(f"README has no line {begin!r} (followed later by {PERF_TABLE_END!r}) to fill")
    head, rest = readme.split(begin, 1)
    if PERF_TABLE_END not in rest:
        raise ValueError(f"README's {begin!r} block has no closing {PERF_TABLE_END!r}")
    tail = rest.split(PERF_TABLE_END, 1)[1]
    return f"{head}{begin}\n{table}\n{PERF_TABLE_END}{tail}"


def plot_throughput(record: dict, save_to: str | Path | None = None) -> plt.Figure:
    """Bars of steady-state tokens/s and peak memory for every path, one bar per micro-batch."""
    paths = list(dict.fromkeys(e["path"] for e in record["paths"]))
    micros = list(dict.fromkeys(e["micro_batch"] for e in record["paths"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(micros)
    for ax, field, label, fmt in ((axes[0], "tokens_per_s", "steady-state tokens/s", "{:,.0f}"),
                                  (axes[1], "peak_memory_gib", "peak memory (GiB)", "{:.1f}")):
        for k, micro in enumerate(micros):
            for i, name in enumerate(paths):
                entry = next((e for e in record["paths"] if e["path"] == name and e["micro_batch"] == micro), None)
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
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend()
    fig.suptitle(f"{record['model']}, seq {record['seq_len']}, {record['precision']}, {record['device']['name']}")
    fig.tight_layout()
    if save_to is not None:
        fig.savefig(save_to, dpi=120)
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
        fig.savefig(save_to, dpi=120)
    return fig


def plot_loss_weighting(cells: list[dict], save_to: str | Path | None = None) -> plt.Figure:
    """Per cell: raw token share, target share, and the share actually trained when known."""
    names = [cell["cell"] for cell in cells]
    series = [("raw share", "raw_share"), ("target share", "target_share")]
    if all("trained_share" in cell for cell in cells):
        series.append(("trained share", "trained_share"))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(series)
    for offset, (label, key) in enumerate(series):
        ax.bar([i + offset * width for i in range(len(cells))], [cell[key] for cell in cells], width, label=label)
    for i, cell in enumerate(cells):
        ax.annotate(f"x{cell['coefficient']:.2f}", (i + width * (len(series) - 1) / 2, max(
            cell["raw_share"], cell["target_share"])), ha="center", va="bottom", fontsize=8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(cells))], names, rotation=15, fontsize=8)
    ax.set_ylabel("share of the supervised-token loss")
    ax.set_title("loss weighting: coefficient = target / raw share")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if save_to is not None:
        fig.savefig(save_to, dpi=120)
    return fig


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m cflib.report", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("perf-table", help="markdown table of a measure_throughput record")
    table.add_argument("record", help="a record.json written by cflib.throughput (e.g. outputs/records/...json)")
    table.add_argument("--readme", help="replace that file's perf-table block for this record instead of printing")
    args = parser.parse_args(argv)
    try:
        record = json.loads(Path(args.record).read_text())
        markdown = perf_table(record)
        if args.readme:
            readme = Path(args.readme)
            readme.write_text(update_readme_perf_table(readme.read_text(), args.record, markdown))
        else:
            print(markdown)
    except (OSError, ValueError, KeyError) as err:
        parser.error(f"{args.record}: {type(err).__name__}: {err}")


if __name__ == "__main__":
    main()


def tuning_summary(record: dict) -> str:
    """The outcome of a tuning run, in a few lines."""
    batch, search = record["batch"], record["search"]
    lines = [
        f"tuned microbatch   {record['tuned_micro_batch_per_rank']} per rank, verified peak "
        f"{record['verification']['peak_gib']:.4g} GiB of {record['budget']['usable_gib']:.4g} usable "
        f"({record['memory_measure'].split(' (')[0]})",
        f"search             {search['probes_used']} of {search['max_probes']} probes "
        f"({', '.join(str(p['micro']) for p in search['probes'])}); stopped: {search['stopped_because']}",
    ]
    if record["fit"] is not None:
        fit = record["fit"]
        lines.append(f"memory line        {fit['intercept_bytes'] / 2**30:.4g} GiB + "
                     f"{fit['slope_bytes_per_example'] / 2**20:.4g} MiB per example (through micro "
                     f"{tuple(fit['through_micro'])})")
    lines.append(f"batch              global {batch['global_batch']} = micro {batch['micro_batch_per_rank']} x world "
                 f"{batch['world_size']} x accumulation {batch['grad_accum']}")
    if batch["note"]:
        lines.append(f"note               {batch['note']}")
    if "sweep" in record:
        sweep = record["sweep"]
        lines.append(f"exhaustive sweep   largest under the usable budget {sweep['largest_fitting']}, under the "
                     f"budget itself {sweep['largest_under_budget']}; tuned within one of the first: "
                     f"{sweep['tuned_within_one']}")
    lines.append(f"params file        {Path(record['out_dir']) / record['outputs']['params_file']}")
    return "\n".join(lines)


def show_data_plan(run) -> None:
    """Before training: the shard preflight, the packing plan and the loss-weighting plot
    (its table is part of run.describe())."""
    for partition, report in (run.preflight or {}).items():
        state = "release-ready" if report["release_ready"] else f"{len(report['findings'])} finding(s)"
        print(f"preflight {partition}: {report['examples']:,} examples, {report['supervised_tokens']:,} supervised "
              f"tokens, sha256 verified for {len(report['sha256_verified'])} files, {state}")
        for finding in report["findings"]:
            print(f"  - {finding}")
    packing = run.packing_efficiency()
    print(f"packing: {packing['windows']:,} windows, {packing['real_tokens_per_window']:.1f} real and "
          f"{packing['supervised_tokens_per_window']:.1f} supervised tokens per {packing['seq_len']}-token window"
          if packing else "packing: off (one example per row, right-padded)")
    if run.loss_weights is None:
        print("loss weighting: off (loss_groups: None), every supervised token weighs 1")
        return
    plot_loss_weighting(run.loss_weights.audit())
    plt.show()
