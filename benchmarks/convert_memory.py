"""Peak memory of chat JSONL conversion against the number of rows: it should stay flat.

    python benchmarks/convert_memory.py                    # 10K and 1M rows
    python benchmarks/convert_memory.py --rows 1000 20000
    python benchmarks/convert_memory.py --source parquet --rows 10000 100000 \
        --record outputs/records/convert_memory_parquet_cpu.json   # read through datasets

For each size it writes a synthetic chat JSONL (distinct multi-turn
conversations, with a few duplicates, empty answers and over-long ones mixed
in), converts it in a fresh process, and reads that process's peak resident
set size (getrusage ru_maxrss) after its imports and after the conversion.
With `--source parquet` the same rows are written as Parquet first (by a
process of their own) and the conversion reads them through `datasets`. The figures go to
outputs/records/convert_memory_cpu.json, or `--record`.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from cflib.jobs import record_header
from cflib.paths import project_root

ROOT = project_root()

CHILD = r"""
import json, resource, sys, time
from cflib.data.convert import ConvertSpec, convert
after_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
indexes = convert(ConvertSpec(train=sys.argv[1], eval=sys.argv[2], out=sys.argv[3], max_seq_len=512,
                              supervise="all_assistant_turns"))
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_rss_after_imports_kib": after_imports, "peak_rss_kib": peak, "convert_s": seconds,
                  "train": {k: indexes["train"][k] for k in ("examples", "num_tokens", "supervised_tokens")},
                  "rejected": indexes["train"]["conversion"]["stats"]["rejected"]}))
"""


def synthetic_chats(path: Path, rows: int, seed: int = 0) -> None:
    """Distinct conversations (a counter in each), every 1000th a duplicate, empty or over-long."""
    rng = random.Random(seed)
    words = "the a river model answer question light small large because water city north time".split()
    with open(path, "w") as handle:
        previous = None
        for index in range(rows):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))
            row = {"task": f"task{index % 7}", "group": f"g{index % 3}", "source": "synthetic",
                   "messages": [{"role": "system", "content": "Be helpful."},
                                {"role": "user", "content": f"#{index}: {text}?"},
                                {"role": "assistant", "content": text.capitalize() + "."},
                                {"role": "user", "content": "And then?"},
                                {"role": "assistant", "content": f"Then {index}."}]}
            if index % 1000 == 1 and previous is not None:
                row = previous  # exact duplicate
            elif index % 1000 == 2:
                row["messages"][-1]["content"] = " "  # empty answer
            elif index % 1000 == 3:
                row["messages"][1]["content"] = "x" * 600  # over the 512-token cap
            handle.write(json.dumps(row) + "\n")
            previous = row


PARQUET_CHILD = r"""
import sys
import datasets
datasets.Dataset.from_json(sys.argv[1], cache_dir=sys.argv[3]).to_parquet(sys.argv[2])
"""


def as_parquet(jsonl: Path, work: Path) -> Path:
    """The rows of `jsonl` as a Parquet file beside it, written by a process of its own: Linux keeps a process's
    peak resident size across exec, so the measuring child must come from a parent that stayed small."""
    parquet = jsonl.with_suffix(".parquet")
    subprocess.run([sys.executable, "-c", PARQUET_CHILD, str(jsonl), str(parquet), str(work / "cache")],
                   capture_output=True, text=True, cwd=ROOT, check=True)
    return parquet


def measure(rows: int, work: Path, source: str = "jsonl") -> dict:
    train, eval_ = work / f"train-{rows}.jsonl", work / f"eval-{rows}.jsonl"
    synthetic_chats(train, rows)
    synthetic_chats(eval_, 200, seed=1)
    if source == "parquet":
        train = as_parquet(train, work)
    out = work / f"shard-{rows}"
    done = subprocess.run([sys.executable, "-c", CHILD, str(train), str(eval_), str(out)], capture_output=True,
                          text=True, cwd=ROOT, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(rows=rows, source=source, source_bytes=train.stat().st_size,
                  shard_bytes=sum(p.stat().st_size for p in (out / "train").iterdir()))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks/convert_memory.py", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--source", choices=("jsonl", "parquet"), default="jsonl", help="the train rows' file")
    parser.add_argument("--record", default=str(ROOT / "outputs" / "records" / "convert_memory_cpu.json"))
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="cflib-convert-memory-") as work:
        for rows in args.rows:
            result = measure(rows, Path(work), args.source)
            results.append(result)
            print(f"{rows:>9,} rows  {result['source_bytes'] / 2**20:8.1f} MiB {args.source}  "
                  f"peak RSS {result['peak_rss_kib'] / 1024:6.1f} MiB (after imports "
                  f"{result['peak_rss_after_imports_kib'] / 1024:.1f})  {result['convert_s']:7.1f} s  "
                  f"{result['train']['examples']:,} examples, rejected {result['rejected']}", flush=True)
    record = {**record_header("convert_memory"),
              "method": "getrusage(RUSAGE_SELF).ru_maxrss of a fresh process running cflib.data.convert.convert "
                        f"on {args.source} train rows (byte tokenizer, supervise all_assistant_turns, max_seq_len 512)",
              "results": results}
    Path(args.record).parent.mkdir(parents=True, exist_ok=True)
    Path(args.record).write_text(json.dumps(record, indent=2) + "\n")
    print(f"record: {args.record}")
    return record


if __name__ == "__main__":
    main()
