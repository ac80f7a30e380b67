"""Sizing a run: steps, overshoot, wall time and checkpoint cadence, before any GPU is booked.

Pure arithmetic: nothing is launched or built. Two entry points:

    python -m cflib.train.sizing arithmetic --target-tokens 2e9 --gpus 8 --micro-batch-per-rank 16 \\
        --seq-len 2048 --tokens-per-s-per-gpu 140000 [--grad-accum N] [--checkpoints N]
    python -m cflib.train.sizing check path/to/cluster.yaml

A cluster layout (the 200M release recipe on one 8-GPU node, 2B tokens):

    model:
      preset: tr_hash_200m          # or params: 201194368 (exactly one of the two)
      rope_scaling: {rope_type: linear, factor: 4}   # optional: the preset's positions extended, as a run would
    parallel:
      tp: 1
      pp: 1
      dp: 8
      micro_batch_per_rank: 16
      global_batch: 128             # sequences per optimizer step; grad_accum = 128 / (16 x 8) = 1
    run:
      seq_len: 2048
      target_tokens: 2.0e9
      world_size: 8                 # optional: defaults to tp x pp x dp
      tokens_per_s_per_gpu: 140000  # optional: gives the wall time

A bad layout stops with a SizingError naming the `section.key` at fault; the CLI
prints it on stderr and exits 2.
"""
from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from pathlib import Path
from typing import Any

from cflib.errors import ParamError
from cflib.model.config import PRESETS, ConfigError, ModelConfig, canonical_rope_scaling
from cflib.train.positions import covered, run_scaling
from cflib.yamlio import read_yaml

SECTIONS = ("model", "parallel", "run")
REQUIRED_KEYS = {
    "model": (),  # preset or params, checked on their own
    "parallel": ("tp", "pp", "dp", "micro_batch_per_rank", "global_batch"),
    "run": ("seq_len", "target_tokens"),
}
OPTIONAL_KEYS = {
    "model": ("preset", "params", "rope_scaling"),
    "parallel": (),
    "run": ("world_size", "tokens_per_s_per_gpu"),
}
# PyYAML reads YAML 1.1, where 2e9 and 2.0e9 (no exponent sign) are strings, not
# numbers; a layout author writing target_tokens: 2.0e9 means a number.
_EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


class SizingError(ValueError):
    """A run or cluster layout that cannot be carried out; the message names the field at fault."""


def _unquote_exponent(value: Any) -> Any:
    return float(value) if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()) else value


# Past these a layout describes no cluster, and the float arithmetic of wall time would overflow.
LARGEST = 10**15
LONGEST_SECONDS = 1e12  # about 31,700 years


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _number(value: Any, name: str) -> float:
    """A positive finite number (int or float) up to LARGEST, else a SizingError naming `name`."""
    number = _unquote_exponent(value)
    if isinstance(number, bool) or not isinstance(number, (int, float)) or number != number or number <= 0:
        raise SizingError(f"{name} must be a positive number, got {_shown(value)}")
    if number > LARGEST:  # before any float arithmetic: an int past 1e308 has no float
        raise SizingError(f"{name} {_shown(value)} is past {LARGEST:.0e}: no run needs it; check the units")
    return number


def _integer(value: Any, name: str) -> int:
    """A positive integer; 2e9 and 8.0 count (scientific notation is how token budgets are written)."""
    number = _unquote_exponent(value)
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int) or number <= 0:
        raise SizingError(f"{name} must be a positive integer, got {_shown(value)}")
    if number > LARGEST:
        raise SizingError(f"{name} {_shown(value)} is past {LARGEST:.0e}: no run needs it; check the units")
    return number


def _token_steps(target_tokens: int, tokens_per_step: int) -> dict[str, Any]:
    # Whole optimizer steps only: the last one finishes its batch, so the run overshoots.
    steps = -(-target_tokens // tokens_per_step)
    processed = steps * tokens_per_step
    overshoot = processed - target_tokens
    return {
        "steps": steps,
        "tokens_processed": processed,
        "overshoot_tokens": overshoot,
        "overshoot_pct": 100.0 * overshoot / target_tokens,
    }


def _timing(tokens_processed: int, tokens_per_step: int, tokens_per_s: float, name: str) -> dict[str, Any]:
    wall = tokens_processed / tokens_per_s
    if not wall <= LONGEST_SECONDS:
        raise SizingError(f"{name} gives a wall time of {wall:.3g} s (over {LONGEST_SECONDS / 3.156e7:,.0f} years): "
                        "check the units (tokens per second per GPU)")
    return {
        "tokens_per_s": tokens_per_s,
        "step_seconds": tokens_per_step / tokens_per_s,
        "wall_seconds": wall,
        "wall_hours": wall / 3600.0,
    }


def run_arithmetic(target_tokens: int, gpus: int, micro_batch_per_rank: int, seq_len: int,
                   tokens_per_s_per_gpu: float, grad_accum: int = 1, checkpoints: int | None = None,
                   checkpoint_every_minutes: float | None = None) -> dict[str, Any]:
    """Steps, tokens, wall time and checkpoint cadence of a data-parallel run over `gpus` ranks.

    Wall time assumes the steady per-GPU throughput for the whole run (no start-up,
    evaluation or checkpoint time). The checkpoint cadence comes from a count
    (`checkpoints` saves spread over the run, the last one at its end) or from
    minutes (no more than that many minutes between saves), not both.
    """
    target_tokens = _integer(target_tokens, "target_tokens")
    gpus = _integer(gpus, "gpus")
    micro_batch_per_rank = _integer(micro_batch_per_rank, "micro_batch_per_rank")
    seq_len = _integer(seq_len, "seq_len")
    tokens_per_s_per_gpu = _number(tokens_per_s_per_gpu, "tokens_per_s_per_gpu")
    grad_accum = _integer(grad_accum, "grad_accum")
    if checkpoints is not None and checkpoint_every_minutes is not None:
        raise SizingError("checkpoints and checkpoint_every_minutes both set: give the cadence one way")

    global_batch = micro_batch_per_rank * gpus * grad_accum
    tokens_per_step = global_batch * seq_len
    report: dict[str, Any] = {
        "target_tokens": target_tokens, "gpus": gpus, "micro_batch_per_rank": micro_batch_per_rank,
        "grad_accum": grad_accum, "seq_len": seq_len, "global_batch": global_batch,
        "tokens_per_step": tokens_per_step, "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
    }
    report.update(_token_steps(target_tokens, tokens_per_step))
    report.update(_timing(report["tokens_processed"], tokens_per_step, tokens_per_s_per_gpu * gpus,
                          "tokens_per_s_per_gpu"))

    steps = report["steps"]
    every: int | None = None
    if checkpoints is not None:
        # Ceil: never more than the asked-for number of saves, counting the one at the end.
        every = -(-steps // _integer(checkpoints, "checkpoints"))
    elif checkpoint_every_minutes is not None:
        # Floor: the gap between saves never exceeds the asked-for minutes (at least one step).
        seconds = 60.0 * _number(checkpoint_every_minutes, "checkpoint_every_minutes")
        every = max(1, math.floor(seconds / report["step_seconds"]))
    report["checkpoint_every_steps"] = every
    # A save every `every` steps plus one at the end when the run stops between two.
    report["checkpoints"] = -(-steps // every) if every else None
    report["checkpoint_interval_minutes"] = every * report["step_seconds"] / 60.0 if every else None
    return report


def _section(layout: dict[str, Any], name: str) -> dict[str, Any]:
    if name not in layout:
        raise SizingError(f"missing section {name!r} (a layout needs {', '.join(SECTIONS)})")
    section = layout[name]
    if not isinstance(section, dict):
        raise SizingError(f"section {name!r} must be a mapping of keys, got {section!r}")
    known = REQUIRED_KEYS[name] + OPTIONAL_KEYS[name]
    for key in section:
        if key not in known:
            raise SizingError(f"unknown key {name}.{key}{_did_you_mean(key, known)}; {name} takes {', '.join(known)}")
    for key in REQUIRED_KEYS[name]:
        if key not in section:
            raise SizingError(f"missing key {name}.{key}")
    return section


def _did_you_mean(name: Any, known: Any) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _model(section: dict[str, Any]) -> tuple[str | None, int, ModelConfig | None]:
    if ("preset" in section) == ("params" in section):
        raise SizingError(f"model needs exactly one of model.preset or model.params, got {sorted(section) or 'neither'}")
    if "params" in section:
        if "rope_scaling" in section:
            raise SizingError("model.rope_scaling extends a preset's positions; model.params names no preset")
        return None, _integer(section["params"], "model.params"), None
    name = section["preset"]
    if not isinstance(name, str) or name not in PRESETS:
        raise SizingError(f"model.preset {name!r} is not a preset{_did_you_mean(name, PRESETS)}; "
                        f"presets: {', '.join(PRESETS)}")
    return name, PRESETS[name].num_parameters(), PRESETS[name]


def _positions(config: ModelConfig, scaling: Any) -> int:
    """The positions a run of the preset trains: its own, or what model.rope_scaling covers."""
    try:
        scaling = run_scaling(config, canonical_rope_scaling(scaling, positions_optional=True))
    except (ConfigError, ParamError) as err:
        raise SizingError(f"model.{err}") from None
    return config.max_position_embeddings if scaling is None else covered(config, scaling)


def validate_cluster_layout(layout: dict[str, Any], source: str = "layout") -> dict[str, Any]:
    """Check a cluster layout (module docstring) and return its arithmetic.

    A layout that cannot run raises SizingError "<source>: <section.key> ..." naming the first fault.
    """
    try:
        return _validate(layout, source)
    except SizingError as err:
        raise SizingError(f"{source}: {err}") from None


def _validate(layout: dict[str, Any], source: str) -> dict[str, Any]:
    if not isinstance(layout, dict):
        raise SizingError(f"a layout is a mapping with sections {', '.join(SECTIONS)}, got {layout!r}")
    for name in layout:
        if name not in SECTIONS:
            raise SizingError(f"unknown section {name!r}{_did_you_mean(name, SECTIONS)}; "
                            f"a layout has {', '.join(SECTIONS)}")
    model, parallel, run = (_section(layout, name) for name in SECTIONS)

    preset_name, params, config = _model(model)
    tp, pp, dp, micro, global_batch = (_integer(parallel[key], f"parallel.{key}") for key in REQUIRED_KEYS["parallel"])
    seq_len = _integer(run["seq_len"], "run.seq_len")
    target_tokens = _integer(run["target_tokens"], "run.target_tokens")

    world_size = tp * pp * dp
    if "world_size" in run and _integer(run["world_size"], "run.world_size") != world_size:
        raise SizingError(f"run.world_size {run['world_size']} != parallel.tp {tp} x pp {pp} x dp {dp} = {world_size}")
    if global_batch % (micro * dp):
        raise SizingError(f"parallel.global_batch {global_batch} is not divisible by micro_batch_per_rank "
                        f"{micro} x dp {dp} = {micro * dp}")
    if config is not None:
        # Tensor parallelism splits attention by whole heads, query and key/value alike.
        for heads_key in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(config, heads_key)
            if heads % tp:
                raise SizingError(f"parallel.tp {tp} does not divide {heads_key} {heads} of preset {preset_name}")
        if pp > config.num_hidden_layers:
            raise SizingError(f"parallel.pp {pp} exceeds num_hidden_layers {config.num_hidden_layers} "
                            f"of preset {preset_name}: a pipeline stage needs at least one layer")
        # cflib.train refuses this too; better to learn it before booking the cluster.
        positions = _positions(config, model.get("rope_scaling"))
        if seq_len > positions:
            raise SizingError(f"run.seq_len {seq_len} exceeds max_position_embeddings {positions} of preset "
                              f"{preset_name}" + ("" if "rope_scaling" in model else
                                                  " (model.rope_scaling extends it, as a run's rope_scaling does)"))

    tokens_per_step = global_batch * seq_len
    report: dict[str, Any] = {
        "source": source, "preset": preset_name, "params": params,
        # An even split; real shards differ (embeddings sit on the first and last pipeline stages).
        "params_per_shard": -(-params // (tp * pp)),
        "tp": tp, "pp": pp, "dp": dp, "world_size": world_size,
        "micro_batch_per_rank": micro, "global_batch": global_batch, "grad_accum": global_batch // (micro * dp),
        "seq_len": seq_len, "target_tokens": target_tokens, "tokens_per_step": tokens_per_step,
    }
    report.update(_token_steps(target_tokens, tokens_per_step))
    if "tokens_per_s_per_gpu" in run:
        per_gpu = _number(run["tokens_per_s_per_gpu"], "run.tokens_per_s_per_gpu")
        report["tokens_per_s_per_gpu"] = per_gpu
        # Every GPU of the world counts: with tp/pp several GPUs share one sequence.
        report.update(_timing(report["tokens_processed"], tokens_per_step, per_gpu * world_size,
                              "run.tokens_per_s_per_gpu"))
    return report


def load_cluster_layout(path: str | Path) -> dict[str, Any]:
    """Read a cluster-layout YAML file and validate it (validate_cluster_layout's report)."""
    return validate_cluster_layout(read_yaml(path, SizingError, "layout file"), source=str(path))


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}h {rest // 60:02d}m {rest % 60:02d}s ({seconds / 3600:.2f} h)"


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _common_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("tokens per optimizer step", f"{report['tokens_per_step']:,}"),
        ("optimizer steps", f"{report['steps']:,}"),
        ("tokens processed", f"{report['tokens_processed']:,} (target {report['target_tokens']:,})"),
        ("overshoot", f"{report['overshoot_tokens']:,} tokens ({report['overshoot_pct']:.4f}%)"),
    ]
    if "wall_seconds" in report:
        rows.append(("step time", f"{report['step_seconds']:.3f} s"))
        rows.append(("wall time", _duration(report["wall_seconds"])))
    return rows


def format_arithmetic(report: dict[str, Any]) -> str:
    rows = [
        ("global batch", f"{report['global_batch']:,} sequences = {report['micro_batch_per_rank']} per rank "
                         f"x {report['gpus']} GPUs x accum {report['grad_accum']}"),
        ("seq_len", f"{report['seq_len']:,}"),
        ("throughput", f"{report['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, "
                       f"{report['tokens_per_s']:,.0f} in all"),
    ] + _common_rows(report)
    if report["checkpoint_every_steps"]:
        rows.append(("checkpoint every", f"{report['checkpoint_every_steps']:,} steps "
                                         f"(~{report['checkpoint_interval_minutes']:.1f} min, "
                                         f"{report['checkpoints']} checkpoints)"))
    return _table(rows)


def format_cluster_layout(report: dict[str, Any]) -> str:
    model = report["preset"] or "(by parameter count)"
    rows = [
        ("layout", report["source"]),
        ("model", f"{model}, {report['params']:,} parameters"),
        ("layout", f"tp {report['tp']} x pp {report['pp']} x dp {report['dp']} = world {report['world_size']}"),
        ("params per tp x pp shard", f"{report['params_per_shard']:,} (even split)"),
        ("global batch", f"{report['global_batch']:,} sequences = {report['micro_batch_per_rank']} per rank "
                         f"x dp {report['dp']} x accum {report['grad_accum']}"),
        ("seq_len", f"{report['seq_len']:,}"),
    ] + _common_rows(report)
    return _table(rows)


def _cli_number(text: str) -> int | float:
    # int where possible so run_arithmetic sees 8, not 8.0; "2e9" becomes a float it accepts.
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cflib.train.sizing", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    arith = commands.add_parser("arithmetic", help="steps, overshoot, wall time of a data-parallel run")
    for flag in ("--target-tokens", "--gpus", "--micro-batch-per-rank", "--seq-len", "--tokens-per-s-per-gpu"):
        arith.add_argument(flag, type=_cli_number, required=True)
    arith.add_argument("--grad-accum", type=_cli_number, default=1)
    cadence = arith.add_mutually_exclusive_group()
    cadence.add_argument("--checkpoints", type=_cli_number, help="number of checkpoints over the run")
    cadence.add_argument("--checkpoint-every-minutes", type=_cli_number)
    check = commands.add_parser("check", help="validate a cluster-layout YAML and print its arithmetic")
    check.add_argument("layout", help="path to the cluster layout YAML")
    args = parser.parse_args(argv)

    try:
        if args.command == "check":
            print(format_cluster_layout(load_cluster_layout(args.layout)))
        else:
            print(format_arithmetic(run_arithmetic(
                args.target_tokens, args.gpus, args.micro_batch_per_rank, args.seq_len,
                args.tokens_per_s_per_gpu, grad_accum=args.grad_accum, checkpoints=args.checkpoints,
                checkpoint_every_minutes=args.checkpoint_every_minutes)))
    except SizingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
