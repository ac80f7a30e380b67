"""`python -m cflib.bench KIND RECORD [--into FILE]`: a throughput record as markdown (KIND: perf-table, every
path and target; headline-table, the targets), printed or written into FILE's generated block for the record."""
from __future__ import annotations

import argparse
from pathlib import Path

from cflib.atomic import write_text_atomic
from cflib.bench.tables import TABLES, update_block
from cflib.errors import ParamError
from cflib.jsonio import read_bounded, read_json

DOC_BYTES = 4 * 2**20  # a Markdown page of the manual is some 100 KB


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cflib.bench", description=__doc__)
    parser.add_argument("kind", choices=sorted(TABLES))
    parser.add_argument("record", help="a record.json written by cflib.bench.throughput (e.g. outputs/records/...json)")
    parser.add_argument("--into", help="rewrite this file's generated block for the record instead of printing")
    args = parser.parse_args(argv)
    try:  # bounded: size and nesting (cflib.jsonio), the error naming the file
        record = read_json(args.record, ParamError, "throughput record")
    except ParamError as err:
        parser.error(str(err))
    try:
        if not isinstance(record, dict):
            raise ValueError(f"a record is a JSON object, not a {type(record).__name__}")
        markdown = TABLES[args.kind](record)
    except (ValueError, KeyError, TypeError) as err:  # TypeError: a field of another shape
        parser.error(f"{args.record}: {type(err).__name__}: {err}")
    if not args.into:
        print(markdown)
        return
    target = Path(args.into)
    try:
        page = read_bounded(target, DOC_BYTES, ParamError, "Markdown page")
    except ParamError as err:
        parser.error(str(err))
    try:
        write_text_atomic(target, update_block(page.decode(), args.kind, args.record, markdown))  # replaced whole
    except (OSError, ValueError) as err:
        parser.error(f"{args.into}: {type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
