"""`python -m cflib.data convert ...`: conversations to an SFT token shard (see cflib.data.convert)."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cflib.data.convert import main as convert_main

COMMANDS = {"convert": "conversations (files, folders, saved datasets, the Hub; messages, ShareGPT, "
                       "prompt-completion or text rows) to a shard root (train/ and eval/)"}


def _parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:10s} {what}" for name, what in COMMANDS.items())
    parser = argparse.ArgumentParser(prog="python -m cflib.data", formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Data to train on.", epilog=f"commands:\n{listing}\n\n"
                                     "python -m cflib.data COMMAND --help: the command's options")
    parser.add_argument("command", choices=COMMANDS, help="the command to run")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, metavar="...", help="the command's own options")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    convert_main(args.arguments)


if __name__ == "__main__":
    main()
