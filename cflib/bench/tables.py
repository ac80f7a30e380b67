"""Markdown tables of benchmark records, and the README blocks generated from them."""
from __future__ import annotations

from pathlib import Path

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
