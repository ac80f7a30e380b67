"""Markdown tables of benchmark records, and the blocks of README.md and docs/ generated from them.

A generated block sits between `<!-- KIND RECORD -->` and `<!-- /KIND -->`, KIND one of TABLES;
`python -m cflib.bench KIND RECORD --into FILE` rewrites it, and a test keeps every block current.
"""
from __future__ import annotations

import statistics
from pathlib import Path


def _number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


QUANTITIES = {"tokens_per_s": "tokens/s", "supervised_tokens_per_s": "supervised tokens/s",
              "peak_memory_gib": "peak memory", "model_tflops_per_s": "model TFLOP/s"}


def _kind(entry: dict) -> str:
    return entry.get("batches", "random_rows")  # records from before realistic lengths hold random rows only


def _label(path: str, batches: str) -> str:
    return f"{path} (realistic)" if batches == "realistic" else path


def _median(values: list | None) -> float | None:
    known = [value for value in values or () if value is not None]
    return statistics.median(known) if known else None


def _clocks_and_energy(entry: dict, per: str = "tokens_per_s") -> str:
    """The timed steps' median SM clock and board power (cflib.bench.timing.gpu_clock_and_power), and the energy
    a token costs at that power (millijoules per token of `per`): under the power limit the clocks say what a
    step's energy left it, and two paths' tokens/s stand in the inverse ratio of their energy per token."""
    watts = _median(entry.get("gpu_power_w"))
    energy = None if watts is None or not entry.get(per) else 1e3 * watts / entry[per]
    return f"{_number(_median(entry.get('gpu_clock_mhz')))} | {_number(watts)} | {_number(energy, 2)}"


def _random_rows_table(entries: list[dict]) -> list[str]:
    lines = ["| path | micro-batch | tokens/s | model TFLOP/s | MFU | peak GiB | MHz | W | mJ/token |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for entry in entries:
        if entry["status"] == "ok":
            lines.append(f"| {entry['path']} | {entry['micro_batch']} | {_number(entry['tokens_per_s'])} | "
                         f"{_number(entry['model_tflops_per_s'], 1)} | {entry['mfu']:.1%} | "
                         f"{_number(entry['peak_memory_gib'], 1)} | {_clocks_and_energy(entry)} |")
        else:
            lines.append(f"| {entry['path']} | {entry['micro_batch']} | {entry['status']} | - | - | "
                         f"{_number(entry.get('peak_memory_gib'), 1)} | - | - | - |")
    return lines


def _realistic_table(record: dict, entries: list[dict]) -> list[str]:
    source = record["realistic"]
    origin = (f"shard {source['shard']}" if "shard" in source else
              f"generated, log-normal median {source['median']:,}, capped at {record['seq_len']:,}")
    lines = [f"Realistic lengths ({origin}; {source['timed_examples']:,} timed examples, mean "
             f"{source['timed_length_mean']:,.0f} tokens): the project trains packed windows, each example attending "
             "only to itself; a micro-batch counts windows (peer_padded's, examples); model TFLOP/s counts each "
             "example's work alone."]
    fed = {e["path"]: e["feed"] for e in entries if e.get("feed")}
    if fed:
        lines[0] += " The peer fed " + "; ".join(f"{path}: {feed}" for path, feed in fed.items()) + "."
    lines += ["", "| path | micro-batch | supervised tokens/s | example tokens/s | tokens fed/s | model TFLOP/s | MFU | "
              "peak GiB | MHz | W | mJ/supervised token |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for entry in entries:
        if entry["status"] == "ok":
            lines.append(f"| {entry['path']} | {entry['micro_batch']} | {_number(entry['supervised_tokens_per_s'])} | "
                         f"{_number(entry.get('real_tokens_per_s'))} | {_number(entry['tokens_per_s'])} | "
                         f"{_number(entry['model_tflops_per_s'], 1)} | {entry['mfu']:.1%} | "
                         f"{_number(entry['peak_memory_gib'], 1)} | "
                         f"{_clocks_and_energy(entry, 'supervised_tokens_per_s')} |")
        else:
            lines.append(f"| {entry['path']} | {entry['micro_batch']} | {entry['status']} | - | - | - | - | "
                         f"{_number(entry.get('peak_memory_gib'), 1)} | - | - | - |")
    return lines


def _ratio_rows(record: dict) -> list[str]:
    lines = ["The product's targets, each a ratio taken in this run:", "",
             "| ratio | micro-batch | measured | target | met |", "| --- | ---: | ---: | ---: | :---: |"]
    for row in record["comparison"]:
        top = _label(row["numerator"], row.get("numerator_batches", "random_rows"))
        bottom = ("bf16 matmul ceiling" if row["denominator"] == "ceiling"
                  else _label(row["denominator"], row.get("denominator_batches", "random_rows")))
        label = f"{QUANTITIES[row['quantity']]}: {top} / {bottom}"
        if row["value"] is None:
            lines.append(f"| {label} | {row['micro_batch']} | - | {row['target']} | not measured |")
            continue
        if row["micro_batch"] == "best" or row["denominator"] == "best_peer":
            sides = [row["numerator_entry"]] + ([] if row["denominator"] == "ceiling" else [row["denominator_entry"]])
            label += f" ({' / '.join(sides)})"
        lines.append(f"| {label} | {row['micro_batch']} | {row['value']:.2f} | {row['target']} | "
                     f"{'yes' if row['met'] else 'no'} |")
    return lines


def _best_at_edge(record: dict) -> list[str]:
    """A line for each side of a best-micro-batch ratio whose fastest entry is the largest micro-batch the run
    tried for that path (none larger ran, ran out of memory or was skipped): a larger one might be faster still."""
    notes = []
    for row in record["comparison"]:
        if row["micro_batch"] != "best" or row["value"] is None:
            continue
        for side, batches in ((row["numerator_entry"], row.get("numerator_batches", "random_rows")),
                              (row["denominator_entry"], row.get("denominator_batches", "random_rows"))):
            path, _, micro = side.rpartition(" mb")
            tried = [e["micro_batch"] for e in record["paths"] if e["path"] == path and _kind(e) == batches]
            if micro.isdigit() and tried and int(micro) == max(tried):
                note = (f"{path} was fastest at micro-batch {micro}, the largest this run measured for it: a larger "
                        "one might be faster still.")
                if note not in notes:
                    notes.append(note)
    return notes


def _kernel_rows(record: dict) -> list[str]:
    """One row per distinct kernel path read back, naming every path that ran it; a path on realistic lengths
    that also ran on random rows shows only what differs."""
    lines = ["| path | kernels read back | compiled |", "| --- | --- | --- |"]
    dense = {e["path"]: e["kernel_path"] for e in record["paths"] if e["status"] == "ok" and _kind(e) == "random_rows"}
    groups: dict[tuple[str, str], list[str]] = {}
    ran = set()
    for entry in record["paths"]:
        label = _label(entry["path"], _kind(entry))
        if entry["status"] != "ok" or label in ran:
            continue
        ran.add(label)
        kernels, same = entry["kernel_path"], dense.get(entry["path"]) if _kind(entry) == "realistic" else None
        shown = ", ".join(f"{name} {value}" for name, value in kernels.items() if same is None or same.get(name) != value)
        if same is not None:
            shown = f"as {entry['path']}" + (f", but {shown}" if shown else "")
        groups.setdefault((shown, str(entry["compiled"] or "no")), []).append(label)
    lines += [f"| {', '.join(labels)} | {kernels} | {compiled} |" for (kernels, compiled), labels in groups.items()]
    skipped = {_label(e["path"], _kind(e)): e for e in record["paths"] if e["status"] != "ok"}
    for label, entry in skipped.items():
        if label not in ran:
            lines.append(f"| {label} | {entry['status']}: {entry['reason'].replace('|', '/')} | - |")
    return lines


def _startup_rows(record: dict) -> list[str]:
    """Each path's cost before its steady state, apart from the figures above (cflib.bench.throughput.startup):
    empty for a record from before it was measured."""
    measured = [e for e in record["paths"] if e["status"] == "ok" and "startup" in e]
    if not measured:
        return []
    lines = ["Before the steady state, outside the figures above: building the path, its first step, the warm-up's "
             "time beyond as many steady-state steps (compiling, CUDA-graph capture, autotuning, JIT), and "
             "torch.compile's own seconds within it, with the graphs it made and the graph breaks it met:", "",
             "| path | micro-batch | set-up s | first step s | warm-up beyond steady s | torch.compile s | graphs | "
             "graph breaks |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for entry in measured:
        start = entry["startup"]
        timed = start["compile_s_in_timed_steps"]
        compiling = _number(start["compile_s"], 1) + (f" ({timed:.1f} in timed steps)" if timed else "")
        lines.append(f"| {_label(entry['path'], _kind(entry))} | {entry['micro_batch']} | "
                     f"{_number(start['setup_s'], 1)} | {_number(start['first_step_s'], 1)} | "
                     f"{_number(start['warmup_beyond_steady_s'], 1)} | {compiling} | {start['graphs']} | "
                     f"{start['graph_breaks']} |")
    return lines


def _setting(record: dict) -> str:
    device, framework, ceiling = record["device"], record["framework"], record["matmul_ceiling"]
    return (f"{device['name']} x {device['count']}, torch {framework['torch']}, {record['precision']}, "
            f"seq {record['seq_len']:,}, {record['timing_protocol']['timed_steps']} timed steps after "
            f"{record['timing_protocol']['warmup_steps_excluded']} warm-up; {ceiling['dtype']} matmul "
            f"{ceiling['size']}^3 ceiling {ceiling['tflops_per_s']:,.1f} TFLOP/s in the same run{_sustained(record)}; "
            f"cflib {(framework.get('cflib_commit') or 'unknown')[:7]}")


def _sustained(record: dict) -> str:
    held = record.get("matmul_ceiling_sustained")
    if not held:
        return ""
    clock = f" at {held['gpu_clock_mhz']:,} MHz" if held.get("gpu_clock_mhz") else ""
    return f" ({held['tflops_per_s']:,.1f} sustained for {held['seconds']:.0f} s{clock})"


def headline_table(record: dict) -> str:
    """Markdown: the setting and the product's targets with what this run measured against each."""
    return "\n".join([_setting(record), ""] + _ratio_rows(record)[2:])


def perf_table(record: dict) -> str:
    """Markdown: every path's steady-state figures on each kind of batches, the product's targets, the kernels."""
    lines = [_setting(record)]
    dense = [e for e in record["paths"] if _kind(e) == "random_rows"]
    if dense:
        lines += ["", f"Random rows ({record['seq_len']:,} random tokens each, the first third unsupervised):", ""]
        lines += _random_rows_table(dense)
    realistic = [e for e in record["paths"] if _kind(e) == "realistic"]
    if realistic:
        lines += [""] + _realistic_table(record, realistic)
    lines += [""] + _ratio_rows(record)
    edge = _best_at_edge(record)
    if edge:
        lines += [""] + edge
    lines += [""] + _kernel_rows(record)
    startup = _startup_rows(record)
    if startup:
        lines += [""] + startup
    timed = [e for e in record["paths"] if e.get("evaluation_and_checkpoint", {}).get("status") == "ok"]
    for entry in timed:
        io = entry["evaluation_and_checkpoint"]
        lines.append("")
        first = f" (the first, with its first calls, {io['first_eval_s']:.2f} s)" if "first_eval_s" in io else ""
        lines.append(f"{entry['path']}, outside the figures above: one full evaluation ({io['eval_examples']} "
                     f"examples) {io['eval_s']:.2f} s{first}; one checkpoint save "
                     f"({io['checkpoint_bytes'] / 2**20:,.0f} MiB) {io['checkpoint_save_s']:.2f} s.")
    return "\n".join(lines)


TABLES = {"perf-table": perf_table, "headline-table": headline_table}


def update_block(text: str, kind: str, record_name: str, table: str) -> str:
    """`text` with its generated `kind` block of record_name (cflib.bench.tables) replaced by `table`."""
    begin, end = f"<!-- {kind} {record_name} -->", f"<!-- /{kind} -->"
    if begin not in text:
        raise ValueError(f"no line {begin!r} (followed later by {end!r}) to fill")
    head, rest = text.split(begin, 1)
    if end not in rest:
        raise ValueError(f"the {begin!r} block has no closing {end!r}")
    return f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}"


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
