"""`python -m cflib.export hub CHECKPOINT OUT [--tokenizer PATH]`: a Hugging Face Hub bundle of a trained model."""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from cflib.export.hub import ExportError, export_hub
from cflib.export.tokenizer_files import TokenizerExportError
from cflib.model import CheckpointError, ConfigError


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cflib.export",
                                     description="Export a trained model for Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    hub = commands.add_parser("hub", help="a folder that AutoModelForCausalLM.from_pretrained(..., "
                                          "trust_remote_code=True) loads and generate() runs")
    hub.add_argument("checkpoint", help="a checkpoint folder, or a run's out_dir (its best checkpoint, else its "
                                        "newest)")
    hub.add_argument("out", help="the bundle folder to create (must not exist)")
    hub.add_argument("--tokenizer", help="'byte' (the default for a model of the byte vocabulary), a "
                                         "tokenizer.json, or a folder holding one")
    args = parser.parse_args(argv)
    try:
        export_hub(args.checkpoint, args.out, args.tokenizer)
    except (ExportError, TokenizerExportError, CheckpointError, ConfigError) as err:  # each names the input at fault
        raise SystemExit(f"export: {err}") from None


if __name__ == "__main__":
    main()
