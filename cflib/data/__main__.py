"""`python -m cflib.data convert ...`: chat JSONL to a shard (see cflib.data.convert)."""
from __future__ import annotations

import sys
from collections.abc import Sequence

from cflib.data.convert import main as convert_main

COMMANDS = {"convert": "chat JSONL to a shard root (train/ and eval/)"}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        listing = "\n".join(f"  {name:10s} {what}" for name, what in COMMANDS.items())
        raise SystemExit(f"usage: python -m cflib.data COMMAND ...\ncommands:\n{listing}")
    convert_main(argv[1:])


if __name__ == "__main__":
    main()
