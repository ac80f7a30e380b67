"""Whether a kernel choice trains as the baseline does: the same steps' losses, within the baseline's own noise.

A fast path that computes the same function in BF16 does not give the same bits: FlashAttention's backward
adds into dQ atomically, in an order that varies, so even two runs of the baseline differ after a few steps.
This job trains the same parameter set from the same seed N steps as given (the baseline), a second time (its
noise), and once per variant (the baseline with some parameters changed), and compares each step's loss:

    deviation(run) = max over steps |loss_run - loss_baseline| / loss_baseline

A variant is within the noise when its deviation is at most NOISE_FACTOR x the repeat's, or under
BF16_FLOOR (a relative difference one BF16 rounding of the loss makes), whichever is larger: on a CPU the
repeat is exact, and a variant that rounds one operation differently still differs by about that much.

    python benchmarks/loss_parity.py -f params/sft_200m_release.yaml --steps 50 \\
        --set "init_checkpoint=null,data=embedded,require_release_ready=false,lr=1e-3" \\
        --variant "kernel_overrides={cflib_adamw: false}" --variant lr=2e-3 --out FILE
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import yaml

from cflib.atomic import write_json_atomic
from cflib.jobs import record_header
from cflib.train.params import ParamError, TrainParams, load_params_file
from cflib.train.records import read_metrics
from cflib.train.start import train

NOISE_FACTOR = 2.0
BF16_FLOOR = 2.0 ** -8
QUIET = {"eval_at_start": False, "eval_every_steps": None, "exact_match_limit": 0, "save_checkpoints": False}


def _value(text: str) -> Any:
    """A YAML scalar; a number YAML 1.1 reads as a string (1e-3, no dot) as the number."""
    value = yaml.safe_load(text)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def parse_variant(text: str) -> dict[str, Any]:
    """"name=value,name=value" as parameter overrides, each value read as YAML (true, 1e-4, fa4)."""
    overrides = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ParamError(f"variant {text!r}: {item!r} is not name=value")
        overrides[name.strip()] = _value(value)
    if not overrides:
        raise ParamError(f"variant {text!r} changes nothing")
    return overrides


def _losses(params: dict[str, Any], out_dir: Path) -> tuple[list[float], dict]:
    record = train({**params, "out_dir": str(out_dir)}, progress=False)
    losses = [row["loss"] for row in read_metrics(out_dir / "metrics.jsonl") if row["event"] == "train"]
    return losses, record["kernel_path"]


def deviation(losses: list[float], baseline: list[float]) -> float:
    """The largest relative difference of one step's loss from the baseline's."""
    if len(losses) != len(baseline):
        raise ValueError(f"{len(losses)} steps against the baseline's {len(baseline)}")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, baseline))


def compare(params: dict[str, Any], variants: list[dict[str, Any]], steps: int, work: Path) -> dict:
    """Every run's per-step losses, kernel path and deviation from the baseline; the verdict per variant."""
    base = {**params, **QUIET, "max_steps": steps, "epochs": max(int(params.get("epochs") or 1), steps)}
    TrainParams.from_dict({**base, "out_dir": str(work / "check")})  # a bad set stops before the first run
    for overrides in variants:
        TrainParams.from_dict({**base, **overrides, "out_dir": str(work / "check")})
    baseline, kernels = _losses(base, work / "baseline")
    repeat, _ = _losses(base, work / "repeat")
    noise = deviation(repeat, baseline)
    allowed = max(NOISE_FACTOR * noise, BF16_FLOOR)
    runs = [{"name": "baseline", "overrides": {}, "losses": baseline, "kernel_path": kernels},
            {"name": "repeat", "overrides": {}, "losses": repeat, "deviation": noise}]
    for index, overrides in enumerate(variants):
        losses, kernels = _losses({**base, **overrides}, work / f"variant_{index}")
        off = deviation(losses, baseline)
        runs.append({"name": ",".join(f"{k}={v}" for k, v in overrides.items()), "overrides": overrides,
                     "losses": losses, "kernel_path": kernels, "deviation": off, "within_noise": off <= allowed})
    return {"steps": steps, "noise": noise, "allowed": allowed, "noise_factor": NOISE_FACTOR,
            "bf16_floor": BF16_FLOOR, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/loss_parity.py", description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--params", required=True, help="the baseline's parameter file (params/*.yaml)")
    parser.add_argument("--set", default="", help='overrides of the file for every run, "name=value,..."')
    parser.add_argument("--variant", action="append", default=[], help='overrides "name=value,...", repeatable')
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", required=True, help="the record's path (JSON)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    try:
        params = {**load_params_file(args.params), **(parse_variant(args.set) if args.set else {})}
        variants = [parse_variant(text) for text in args.variant]
        with tempfile.TemporaryDirectory(prefix="loss_parity_") as work:
            result = compare(params, variants, args.steps, Path(work))
    except (ParamError, ValueError) as err:
        parser.error(str(err))
    write_json_atomic(Path(args.out), {**record_header("loss_parity", params=params), **result})
    print(f"repeat of the baseline: {result['noise']:.2e}; allowed {result['allowed']:.2e}")
    for run in result["runs"][2:]:
        print(f"{run['name']}: {run['deviation']:.2e} {'within' if run['within_noise'] else 'OUTSIDE'} the noise")


if __name__ == "__main__":
    main()
