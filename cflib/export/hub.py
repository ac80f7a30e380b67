"""A Hugging Face Hub bundle of a trained model: what `from_pretrained(..., trust_remote_code=True)` loads.

    python -m cflib.export hub CHECKPOINT OUT [--tokenizer PATH]

or `export_hub(checkpoint, out, tokenizer)` from Python. OUT holds config.json
(the model's keys plus the Hub's), model.safetensors (every published tensor,
derived buffers included), generation_config.json, the tokenizer files, the
two modules of cflib/export/hub_modules and the model card, README.md
(cflib.export.model_card). It is written atomically and never over an
existing folder.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Callable

from cflib.atomic import check_output_folder, live_path
from cflib.export.model_card import CARD_FILE, model_card
from cflib.export.peft import is_adapter_checkpoint
from cflib.export.tokenizer_files import tokenizer_files
from cflib.locks import exclusive_output
from cflib.model import TRMoEModel, fused_route_buffers, load_checkpoint, save_checkpoint
from cflib.model.checkpoint import CheckpointError, holds_model, run_checkpoint, trained_folder

MODEL_TYPE = "tr_hash_moe"
ARCHITECTURE = "TRHashForCausalLM"
HUB_MODULES = ("configuration_tr_hash_moe.py", "modeling_tr_hash_moe.py")
AUTO_MAP = {"AutoConfig": "configuration_tr_hash_moe.TRHashConfig",
            "AutoModelForCausalLM": "modeling_tr_hash_moe.TRHashForCausalLM"}


class ExportError(ValueError):
    """An export that cannot be made; the message names the input at fault. Nothing was written."""


def resolve_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoint folder, which one and why): a checkpoint itself, or a run folder's (a curriculum's: its last
    stage's) best checkpoint, else its newest of `last`, `epoch-N`, `step-N` (in that order of preference). A
    folder whose replacement a kill cut between its two renames is found under its retired name
    (cflib.atomic.live_path)."""
    path = live_path(Path(path))
    if holds_model(path):
        return path, f"checkpoint {path}"
    try:
        checkpoints = trained_folder(path) / "checkpoints"  # a curriculum's: its last stage's
    except CheckpointError as err:
        raise ExportError(str(err)) from None
    for adapters in (path, live_path(checkpoints / "best")):
        if is_adapter_checkpoint(adapters):
            raise ExportError(f"{adapters} holds LoRA adapters, not a model: merge them into their base first "
                              f"(python -m cflib.export merge {adapters} MERGED), then export MERGED")
    if not checkpoints.is_dir():
        raise ExportError(f"{path}: neither a checkpoint (config.json and model.safetensors) nor a run folder "
                          "(one with checkpoints/)")
    chosen = run_checkpoint(checkpoints)
    if chosen is not None:
        return chosen[0], f"{chosen[0]}: {chosen[1]}"
    raise ExportError(f"{checkpoints}: no checkpoint in it (best, last, epoch-N or step-N with config.json and "
                      "model.safetensors)")


def hub_config_keys(special_ids: dict[str, int | None]) -> dict:
    """What config.json carries beyond the model's keys, for transformers."""
    return {"model_type": MODEL_TYPE, "architectures": [ARCHITECTURE], "auto_map": AUTO_MAP, "is_decoder": True,
            "is_encoder_decoder": False, "use_cache": True, "attention_dropout": 0.0,
            **{f"{role}_token_id": special_ids[role] for role in ("bos", "eos", "pad", "unk")}}


def check_fused_buffers_defined(model: TRMoEModel) -> None:
    """The Hub modules give top-2 models over 2..8 experts fused buffers of full size: every route table of
    such a model must route each token to two distinct experts."""
    config = model.config
    if config.num_experts_per_tok != 2 or not 2 <= config.num_experts <= 8:
        return
    for i, layer in enumerate(model.layers):
        table = layer.mlp["engine"].route_table
        if not fused_route_buffers(table, config.num_experts)[0].numel():
            token = int((table[0] == table[1]).nonzero()[0, 0])
            raise ExportError(f"layers.{i}.mlp.engine.route_table routes token {token} to expert "
                              f"{int(table[0, token])} twice; the Hub layout needs two distinct experts per token")


def export_hub(checkpoint: str | Path, out: str | Path, tokenizer: str | Path | None = None,
               echo: Callable[[str], None] | None = print, chat_template_sha256: str | None = None,
               repo_id: str | None = None) -> Path:
    """Write the Hub bundle of `checkpoint` (a checkpoint or a run folder) to the new folder `out`.

    `tokenizer`: "byte", a tokenizer.json, or a folder holding one; None takes
    the byte tokenizer for a model of its vocabulary size. `chat_template_sha256`:
    the template the training data was rendered through (its shard's
    manifest), which the bundle's must be. `repo_id`: the Hub repository the
    model card's loading lines name (default: `out` by its folder's name,
    never a path of this machine). Every check runs before anything is
    written; `out` must not exist.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} already exists; export to a new folder (nothing was changed)")
    source, choice = resolve_checkpoint(checkpoint)
    tokenizer_path = tokenizer if tokenizer not in (None, "byte") else None
    def check() -> None:
        check_output_folder(out, {"checkpoint": source, "tokenizer": tokenizer_path}, ExportError)

    check()
    model = load_checkpoint(source)  # also checks any derived buffers it carries against its route tables
    check_fused_buffers_defined(model)
    config = model.config
    tok = tokenizer_files(tokenizer, config.vocab_size, config.max_position_embeddings)
    if chat_template_sha256 is not None and tok.chat_template_sha256 != chat_template_sha256:
        raise ExportError(f"{tok.description}: its chat template (sha256 {tok.chat_template_sha256}) is not the one "
                          f"the training data was rendered through (sha256 {chat_template_sha256})")
    modules = resources.files("cflib.export.hub_modules")
    with exclusive_output(out, check, ExportError) as staging:  # `out` checked again under its lock
        # save_checkpoint publishes a folder of its own atomically: it takes the empty staging folder's place.
        save_checkpoint(model, staging, config_extra=hub_config_keys(tok.ids))
        generation = {key: value for key, value in (("bos_token_id", tok.ids["bos"]), ("eos_token_id", tok.ids["eos"]),
                                                    ("pad_token_id", tok.ids["pad"])) if value is not None}
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for name, content in tok.files.items():
            (staging / name).write_bytes(content)
        for name in HUB_MODULES:
            (staging / name).write_bytes(modules.joinpath(name).read_bytes())
        (staging / CARD_FILE).write_text(model_card(source, "bundle", out, config.to_dict(), repo_id))
    if echo is not None:
        echo(f"exported {choice}")
        echo(f"tokenizer: {tok.description} (eos id {tok.ids['eos']}, pad id {tok.ids['pad']})")
        if tok.chat_template_sha256 is not None:
            echo(f"chat template: sha256 {tok.chat_template_sha256}")
        for note in tok.notes:
            echo(f"note: {note}")
        echo(f"wrote {out}: load with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)")
    return out
