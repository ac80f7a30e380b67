"""What a notebook shows of a run: loss curves, the exact-match table, a summary."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch

from cflib.atomic import save_figure
from cflib.data import ShardPartition, load_tokenizer
from cflib.data.mixture import MixedPartition, recorded_held_out
from cflib.export import export_hub
from cflib.export.publish import data_tokenizer, holds_publication
from cflib.export.peft import is_adapter_checkpoint, load_merged, merge
from cflib.model import load_checkpoint
from cflib.model.generate import Decoder
from cflib.train import Run
from cflib.train.curriculum_run import CurriculumRun
from cflib.train.held_out import final_turn
from cflib.train.records import read_metrics
from cflib.train.run_data import describe_overlong
from cflib.train.sizing import format_arithmetic, run_arithmetic
from cflib.train.trackers import samples_markdown


def _elsewhere(record: dict) -> str | None:
    """Nodes other than node 0 hold no record, a dry run trains nothing: say so instead of failing."""
    if "eval" in record:
        return None
    if record.get("dry_run"):
        return f"dry run: nothing was trained; the audit of every stage is {record['out_dir']}/dry_run.json"
    return (f"node {record.get('node_rank')}: its ranks trained; rank 0 writes the record, metrics and "
            "checkpoints on node 0")


def plot_loss_curves(metrics_path: str | Path, save_to: str | Path | None = None) -> plt.Figure | None:
    """Training loss per optimizer step (with a teacher, its cross-entropy term too) and held-out loss at each
    evaluation."""
    if not Path(metrics_path).is_file():
        print(f"no metrics at {metrics_path} (rank 0 writes them, on node 0)")
        return None
    rows = read_metrics(metrics_path)
    train = [r for r in rows if r["event"] == "train"]
    evals = [r for r in rows if r["event"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.8, label="train (per step)")
    # A teacher's steps: their loss mixes in the KL; the cross-entropy compares. A resume may drop or add the teacher.
    distilled = [r for r in train if "ce_loss" in r]
    if distilled:
        ax.plot([r["step"] for r in distilled], [r["ce_loss"] for r in distilled], "--", lw=1, alpha=0.8,
                label="train cross-entropy (beside the KL to the teacher)")
    ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out eval")
    return finish_loss_plot(fig, ax, "optimizer step", save_to)


def finish_loss_plot(fig: plt.Figure, ax: plt.Axes, xlabel: str, save_to: str | Path | None,
                     legend_size: float | None = None) -> plt.Figure:
    """A loss plot's axes (log SFT loss per supervised token), legend, layout and file."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("SFT loss (nats / supervised token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    if save_to is not None:
        save_figure(fig, save_to)
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


def samples_table(record: dict) -> str:
    """Markdown: the prompts and greedy answers log_samples wrote at the run's last evaluation."""
    if _elsewhere(record):
        return _elsewhere(record)
    final = record["eval"]["final"]
    if not final.get("samples_file"):
        return "_no samples were written (log_samples: N writes N prompts with their answers at each evaluation)_"
    return (f"{final['tag']}, step {final['step']} ({final['samples_file']}):\n\n"
            + samples_markdown(Path(record["out_dir"]) / final["samples_file"]))


def show_samples(record: dict) -> None:
    """The last evaluation's samples, as markdown in JupyterLab and as text under papermill."""
    from IPython.display import display

    table = samples_table(record)
    display({"text/markdown": table, "text/plain": table}, raw=True)


def spread_prompts(held_out: ShardPartition | MixedPartition, n: int) -> list[int]:
    """At most n held-out examples: n dealt to the sources in turn (one root is one source), so that every source
    of a mixture shows, and each source's spread evenly over it (its tasks are often in blocks)."""
    starts = held_out.starts if isinstance(held_out, MixedPartition) else np.array([0, len(held_out)])
    sizes = np.diff(starts)
    counts, source = [0] * len(sizes), 0
    for _ in range(min(n, int(sizes.sum()))):
        while counts[source] == sizes[source]:  # a source shown whole: the next one with examples left
            source = (source + 1) % len(sizes)
        counts[source] += 1
        source = (source + 1) % len(sizes)
    return [int(start + i * size // count) for start, size, count in zip(starts, sizes, counts)
            for i in range(count)]


def export_run(record: dict, out: str | Path | None = None) -> Path | None:
    """The Hub bundle of the run's best (else last) checkpoint in out, by default out_dir/hub, with the tokenizer
    its data was converted with (where that is unknown, the command that names one) and, where the data was
    rendered through the tokenizer's own chat template, that same template. A LoRA run's adapters are
    merged into their base first, in out_dir/merged (cflib.export.peft.merge). A bundle push_to_hub wrote there at
    the end of the run is kept."""
    if _elsewhere(record):
        print(_elsewhere(record))
        return None
    run_dir = Path(record["out_dir"])
    out = Path(out) if out is not None else run_dir / "hub"
    spec, template_sha256 = data_tokenizer(record)
    if spec is None:
        print(f"the data's index names no tokenizer: python -m cflib.export hub {run_dir} {out} "
              "--tokenizer path/to/tokenizer.json")
        return None
    checkpoints = record.get("checkpoints", {})
    chosen = checkpoints.get("best") or checkpoints.get("last")
    if chosen is not None and not is_adapter_checkpoint(chosen) and holds_publication(out, Path(chosen), "bundle"):
        print(f"{out}: the bundle of {chosen}, pushed to the Hub at the end of the run")
        return out
    if chosen is not None and is_adapter_checkpoint(chosen):
        merged = run_dir / "merged"
        merge(chosen, merged)
        print(f"merged the adapters of {chosen} into their base: {merged}")
        chosen = merged
    return export_hub(chosen or run_dir, out, tokenizer=spec, chat_template_sha256=template_sha256)


def show_answers(record: dict, n: int = 5) -> None:
    """The run's best checkpoint on n prompts of its held-out set (a mixture's: every source's, each answer
    named by its source) spread over it (spread_prompts), greedy through the KV-cache decoder; each answer gets
    as many tokens as the expected one, as in exact match."""
    best = None if _elsewhere(record) else record.get("checkpoints", {}).get("best")
    if best is None:
        print(_elsewhere(record) or "no best checkpoint was saved (save_checkpoints: false, or no step ran)")
        return
    device = torch.device(record["device"]["type"])
    model = load_merged(best).to(device) if is_adapter_checkpoint(best) else load_checkpoint(best, device)
    held_out = recorded_held_out(record["data"], vocab_size=model.config.vocab_size)
    picks = spread_prompts(held_out, n)
    pairs = [final_turn(*held_out[i]) for i in picks]
    decoder = Decoder(model, autocast_dtype=torch.bfloat16 if record["precision"].startswith("bf16") else None)
    answers = decoder.generate([prompt for prompt, _ in pairs], [target.numel() for _, target in pairs],
                               eos_token_id=held_out.eos_token_id)
    spec, _ = data_tokenizer(record)
    tokenizer = None if spec is None else load_tokenizer(spec)
    # One root with examples_per_epoch is a mixture of one: its answers need no source named.
    mixed = isinstance(held_out, MixedPartition) and len(held_out.source_names) > 1

    def text(ids: list[int]) -> str:
        shown = tokenizer.decode_template(ids) if tokenizer else " ".join(map(str, ids))
        return shown if len(shown) <= 60 else "..." + shown[-57:]

    print(f"best checkpoint {best}, greedy, {len(pairs)} held-out prompts"
          + (f" of {len(held_out.source_names)} sources" if mixed else ""))
    for index, (prompt, target), answer in zip(picks, pairs, answers):
        mark = "hit " if answer == target.tolist() else "miss"
        source = f" [{held_out.source_names[held_out.source_of[index]]}]" if mixed else ""
        print(f"{mark}{source} {text(prompt.tolist())!r}\n       expected {text(target.tolist())!r}, "
              f"answered {text(answer)!r}")


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
    if overlong := (record.get("data") or {}).get("overlong"):  # overlong_examples: drop
        lines.append(f"overlong           {describe_overlong(overlong)}")
    if "loss_by_source" in final:  # a mixture (docs/data.md#mixing-sources)
        lines.append("per source         " + ", ".join(
            f"{name}: loss {loss:.4f}" + (f", exact match {rate:.3f}" if (rate := (final.get(
                "exact_match_by_source") or {}).get(name)) is not None else "")
            for name, loss in final["loss_by_source"].items()))
    best = record.get("best_metric") or {}
    if best.get("step") is not None:
        lines.append(f"best checkpoint    step {best['step']} by {best['name']} ({best['value']:.4g}, "
                     f"{'higher' if best['greater_is_better'] else 'lower'} is better)")
    if throughput:
        lines.append(f"steady tokens/s    {throughput:,.0f} on {record['device']['name']} ({record['precision']})")
    lines.append(f"kernel path        {record['kernel_path']}")
    return "\n".join(lines)


def size_like_this_run(record: dict, gpus: int = 8, epochs: int = 3) -> str:
    """The sizing arithmetic for `epochs` passes over this run's data on `gpus` data-parallel
    ranks, at this run's measured steady throughput per rank."""
    measured = record.get("throughput", {}).get("steady_state_tokens_per_s")
    if not measured:
        return "_no steady-state throughput was measured (no optimizer step ran)_"
    # An epoch of a mixture is its examples_per_epoch, drawn from the sources.
    epoch_examples = (record["data"].get("mixture") or {}).get("examples_per_epoch", record["data"]["train_examples"])
    train_tokens = epoch_examples * record["seq_len"]
    report = run_arithmetic(target_tokens=train_tokens * epochs, gpus=gpus,
                            micro_batch_per_rank=record["micro_batch_per_rank"], seq_len=record["seq_len"],
                            tokens_per_s_per_gpu=measured / record["world_size"], checkpoints=epochs)
    device = record["device"]
    basis = (f"A projection, not this run: {epochs} passes over its {epoch_examples:,} examples on {gpus} "
             f"data-parallel ranks, each at the tokens/s per process this run measured on {device['type']} "
             f"({device['name']})")
    return basis + "\n" + format_arithmetic(report)


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
        save_figure(fig, save_to)
    return fig


def show_data(run: Run | CurriculumRun) -> None:
    """Before training: the shard preflight, the packed windows and the loss-weighting plot
    (its table is part of run.describe()); a curriculum's audit of every stage is its describe()."""
    if isinstance(run, CurriculumRun):
        print("every stage's data, weights and batch arithmetic: the table above (dry_run: true writes it alone)")
        return
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
