"""`python -m cflib.bench perf-table RECORD [--readme README.md]`: a throughput record as a markdown table."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from cflib.bench.tables import perf_table, update_readme_perf_table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cflib.bench", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("perf-table", help="markdown table of a measure_throughput record")
    table.add_argument("record", help="a record.json written by cflib.bench.throughput (e.g. outputs/records/...json)")
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
