"""`python -m cflib.export hub CHECKPOINT OUT [--tokenizer PATH] [--push ORG/NAME]`: a Hugging Face Hub bundle of a
trained model, with its model card, and optionally on the Hub.

`python -m cflib.export adapters ADAPTER OUT [--push ORG/NAME]`: a LoRA checkpoint's adapters with their card.
`python -m cflib.export merge ADAPTER OUT [--base BASE]`: a LoRA checkpoint merged into its base.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from cflib.export.hub import ExportError, export_hub, resolve_checkpoint
from cflib.export.peft import MergeError, merge
from cflib.export.publish import export_adapters, publish, resolve_adapters
from cflib.export.push import PushError
from cflib.export.tokenizer_files import TokenizerExportError
from cflib.jobs import one_line_errors
from cflib.model import CheckpointError, ConfigError


def _hub(args: argparse.Namespace) -> None:
    source = resolve_checkpoint(args.checkpoint)[0] if args.push else None
    publish(source, Path(args.out), "bundle", lambda folder, echo: export_hub(args.checkpoint, folder, args.tokenizer,
                                                                              echo=echo, repo_id=args.push),
            args.push, private=args.private or None, revision=args.revision)


def _adapters(args: argparse.Namespace) -> None:
    source = resolve_adapters(args.checkpoint)
    publish(source, Path(args.out), "adapters",
            lambda folder, echo: export_adapters(source, folder, repo_id=args.push, echo=echo,
                                                 base_model=args.base_model),
            args.push, private=args.private or None, revision=args.revision)


def _push_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--push", metavar="ORG/NAME", help="then upload OUT to this Hugging Face Hub repository "
                                                            "(created when missing; an OUT already written from the "
                                                            "same checkpoint is uploaded as it is, its model card "
                                                            "naming ORG/NAME: the same command resumes an "
                                                            "interrupted push)")
    command.add_argument("--private", action="store_true", help="with --push: create the repository private")
    command.add_argument("--revision", help="with --push: the branch to commit to (created from main when missing)")


def _check_push_options(args: argparse.Namespace, command: argparse.ArgumentParser) -> None:
    """--private and --revision say how to push: without --push nothing is pushed, so they are refused, not
    ignored."""
    given = [flag for flag, value in (("--private", args.private), ("--revision", args.revision)) if value]
    if given and args.push is None:
        command.error(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --push ORG/NAME: without it "
                      "nothing is uploaded")


def _merge(args: argparse.Namespace) -> None:
    summary = merge(resolve_adapters(args.adapter), args.out, base_dir=args.base)
    print(json.dumps(summary))
    if not summary["base_matches_training"]:
        print(f"note: {summary['base']} is not the base these adapters were trained on (its weights differ); "
              "the merged model is that base plus the adapters", file=sys.stderr)


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
    _push_options(hub)
    hub.set_defaults(run=_hub)
    adapters = commands.add_parser("adapters", help="a LoRA checkpoint's adapters in PEFT's format with their "
                                                    "model card, for peft.PeftModel.from_pretrained")
    adapters.add_argument("checkpoint", help="a LoRA checkpoint folder, or a LoRA run's out_dir (its best "
                                             "checkpoint, else its last, else its newest epoch-N or step-N)")
    adapters.add_argument("out", help="the folder to create (must not exist)")
    adapters.add_argument("--base-model", metavar="ORG/NAME", help="the base's Hub bundle (a repository id, or a "
                                                                  "folder its users have): the adapters' "
                                                                  "base_model_name_or_path, which "
                                                                  "peft.AutoPeftModelForCausalLM loads; default: none")
    _push_options(adapters)
    adapters.set_defaults(run=_adapters)
    merging = commands.add_parser("merge", help="a LoRA checkpoint's base + scale * B @ A, written (fp32) as an "
                                                "ordinary checkpoint")
    merging.add_argument("adapter", help="a LoRA checkpoint folder (adapter_config.json, adapter_model.safetensors), "
                                         "or a LoRA run's out_dir (its best checkpoint, else its last, else its newest "
                                         "epoch-N or step-N)")
    merging.add_argument("out", help="the merged checkpoint folder to write (config.json + model.safetensors)")
    merging.add_argument("--base", default=None, help="the base checkpoint; default: the one the adapters name")
    merging.set_defaults(run=_merge)
    args = parser.parse_args(argv)
    if args.command in ("hub", "adapters"):
        _check_push_options(args, commands.choices[args.command])
    with one_line_errors("export", ExportError, MergeError, TokenizerExportError, CheckpointError, ConfigError,
                         PushError):
        args.run(args)


if __name__ == "__main__":
    main()
