"""What a run publishes on the Hugging Face Hub: its model as a Hub bundle, or a LoRA run's adapters.

    python -m cflib.export hub RUN OUT --push ORG/NAME [--private] [--revision BRANCH]
    python -m cflib.export adapters RUN OUT --push ORG/NAME [--private] [--revision BRANCH]

`export_adapters` writes a LoRA checkpoint's adapters in PEFT's format with
their model card (atomically, never over an existing folder); `export_hub`
(cflib.export.hub) writes a bundle with its card. Either folder then goes to
the Hub through cflib.export.push. A folder that already holds the
publication of the same checkpoint (its card names the same weights) is
pushed as it is, so the same command run again after an interrupted push
resumes it. `publish_run` does it all at the end of a run with
`push_to_hub`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

from cflib.atomic import check_output_folder, scratch_folder, write_text_atomic
from cflib.data import ShardPartition, shard_chat_template_sha256, shard_tokenizer_spec
from cflib.data.mixture import recorded_roots
from cflib.data.shards import sha256_file
from cflib.export.hub import ExportError, export_hub
from cflib.export.model_card import CARD_FILE, WEIGHT_FILES, model_card, published, published_checkpoint
from cflib.export.peft import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    CFLIB_ADAPTER_FILE,
    hub_base,
    is_adapter_checkpoint,
    read_adapter,
)
from cflib.export.push import PushError, check_push, push_folder
from cflib.jsonio import read_json
from cflib.locks import exclusive_output
from cflib.model.checkpoint import checkpoint_in

def resolve_adapters(path: str | Path) -> Path:
    """A LoRA checkpoint itself, or the one a LoRA run folder stands for (cflib.model.checkpoint.run_checkpoint)."""
    found = checkpoint_in(Path(path), is_adapter_checkpoint)
    if found is not None:
        return found
    raise ExportError(f"{path}: neither LoRA adapters (adapter_config.json) nor a LoRA run folder with a checkpoint "
                      "(best, last, epoch-N or step-N); a full model's bundle is `python -m cflib.export hub`")


def export_adapters(checkpoint: str | Path, out: str | Path, repo_id: str | None = None,
                    echo: Callable[[str], None] | None = print, base_model: str | None = None) -> Path:
    """Write the adapters of `checkpoint` (a LoRA checkpoint or run folder) with their model card to the new folder
    `out`: what `peft.PeftModel.from_pretrained(base, out)` loads, without the optimizer state. `base_model` (the
    base's Hub bundle: a repository id or folder) becomes the adapters' `base_model_name_or_path`, which
    `peft.AutoPeftModelForCausalLM` loads. Without it, adapters trained on a base pulled from the Hub
    (init_checkpoint hub:ORG/NAME) name that repository, with the commit the run trained on as their `revision`;
    others name none (a folder name of this machine would send AutoPeftModel to the Hub for a repository of that
    name). The provenance names the base by its folder's name."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ExportError(f"{out} already exists; export to a new folder (nothing was changed)")
    if base_model is not None and (not base_model.strip() or len(base_model) > 1000 or "\n" in base_model):
        raise ExportError(f"--base-model {base_model[:80]!r}: a repository id (ORG/NAME) or a folder, one line of at "
                          "most 1,000 characters")
    source = resolve_adapters(checkpoint)

    def check() -> None:
        check_output_folder(out, {"checkpoint": source}, ExportError)

    check()
    read_adapter(source)  # settings, base and tensors checked before anything is written
    peft_config = read_json(source / ADAPTER_CONFIG_FILE, ExportError, "PEFT adapter config")
    if not isinstance(peft_config, dict):
        raise ExportError(f"{source / ADAPTER_CONFIG_FILE}: must be a JSON object (PEFT's LoraConfig)")
    cflib_adapter = read_json(source / CFLIB_ADAPTER_FILE, ExportError, "adapter description")
    base = Path(cflib_adapter["base"]["path"]).name
    base_model, revision = named_base(cflib_adapter["base"], base_model)
    named = {"base_model_name_or_path": base_model, "revision": revision}
    with exclusive_output(out, check, ExportError) as staging:  # `out` checked again under its lock
        shutil.copyfile(source / ADAPTER_WEIGHTS_FILE, staging / ADAPTER_WEIGHTS_FILE)
        for name, document in ((ADAPTER_CONFIG_FILE, {**peft_config, **named}),
                               (CFLIB_ADAPTER_FILE, {**cflib_adapter, "base": {**cflib_adapter["base"], "path": base}})):
            (staging / name).write_text(json.dumps(document, indent=2) + "\n")
        (staging / CARD_FILE).write_text(model_card(source, "adapters", out, cflib_adapter["base"].get("config", {}),
                                                    repo_id, base_model, revision))
    if echo is not None:
        echo(f"wrote {out}: the adapters of {source}, for peft.PeftModel.from_pretrained(base, {str(out)!r})")
    return out


def named_base(base: dict, base_model: str | None) -> tuple[str | None, str | None]:
    """(base_model_name_or_path, revision) of exported adapters on `base` (their cflib_adapter.json's): `base_model`
    where given, at the commit the run trained on where it names the repository the base was pulled from; else
    that repository and commit; else none."""
    hub = hub_base(base)
    if base_model is None:
        return (hub["repo_id"], hub["commit"]) if hub is not None else (None, None)
    return base_model, hub["commit"] if hub is not None and base_model == hub["repo_id"] else None


def holds_publication(folder: Path, checkpoint: Path, kind: str) -> bool:
    """Whether `folder` already holds the publication of `checkpoint`: its card names a checkpoint of that name
    with the weights `checkpoint` has now."""
    named = published_checkpoint(folder) if folder.is_dir() else None
    return (named is not None and named.get("name") == checkpoint.name
            and named.get("sha256") == sha256_file(checkpoint / WEIGHT_FILES[kind]))


def retarget_card(out: Path, source: Path, kind: str, repo_id: str) -> None:
    """Write the card of the publication in `out` again for `repo_id`, whose readers load it by that name: a card
    written without --push names the folder in its loading lines, one pushed before names that repository."""
    base_model = revision = None
    if kind == "bundle":
        config = read_json(out / "config.json", ExportError, "bundle config")
    else:
        config = read_json(out / CFLIB_ADAPTER_FILE, ExportError, "adapter description")["base"].get("config", {})
        named = read_json(out / ADAPTER_CONFIG_FILE, ExportError, "PEFT adapter config")
        base_model, revision = named.get("base_model_name_or_path"), named.get("revision")
    write_text_atomic(out / CARD_FILE, model_card(source, kind, out, config, repo_id, base_model, revision))


Writer = Callable[[Path, Callable[[str], None] | None], object]  # (folder, echo): writes a publication there


def check_as_written(out: Path, kind: str, write: Writer) -> None:
    """ExportError unless `out` holds exactly what `write` writes, byte for byte, but for its model card (which
    may be written again for a repository, or edited): a push sends the whole folder, so a file put there since,
    or changed, would be published with it. Written again into a hidden scratch folder beside `out`."""
    with scratch_folder(out) as scratch:
        write(scratch / out.name, None)
        fresh = {entry.name: entry for entry in (scratch / out.name).iterdir() if entry.name != CARD_FILE}
        for entry in sorted(out.iterdir()):
            if entry.name == CARD_FILE and entry.is_file() and not entry.is_symlink():
                continue
            if entry.name not in fresh or entry.is_symlink() or not entry.is_file():
                raise ExportError(f"{entry}: the {kind} export does not write it, and a push would publish it; "
                                  f"move it out of {out}, or export to a new folder")
            if sha256_file(entry) != sha256_file(fresh[entry.name]):
                raise ExportError(f"{entry}: differs from what the {kind} export writes; export to a new folder "
                                  "(nothing was pushed)")
        missing = sorted(set(fresh) - {entry.name for entry in out.iterdir()})
        if missing:
            raise ExportError(f"{out / missing[0]}: missing from the {kind}; export to a new folder (nothing was "
                              "pushed)")


def publish(source: Path, out: Path, kind: str, write: Writer, repo_id: str | None,
            private: bool | None = None, revision: str | None = None,
            echo: Callable[[str], None] | None = print) -> Path:
    """`write(out, echo)` the publication of `source` (kind "bundle" or "adapters"), then push it to `repo_id`. An
    `out` that already holds it (an earlier push, interrupted or not), and nothing else (check_as_written), is
    pushed as it is, its card written again first where it names no repository or another."""
    if repo_id is not None:
        check_push(repo_id)  # before anything is written
    if repo_id is not None and holds_publication(out, source, kind):
        check_as_written(out, kind, write)
        retargeted = published(out).get("repo_id") != repo_id
        if retargeted:
            retarget_card(out, source, kind, repo_id)
        if echo is not None:
            echo(f"{out} already holds the {kind} of {source}: pushing it as it is"
                 + (f", its model card written again for {repo_id}" if retargeted else ""))
    else:
        write(out, echo)
    if repo_id is not None:
        push_folder(out, repo_id, private=private, revision=revision, echo=echo)
    return out


def data_tokenizer(record: dict) -> tuple[str | None, str | None]:
    """The tokenizer a run's data was converted with (shard_tokenizer_spec; None: unknown) and the SHA-256 of the
    tokenizer's chat template it was rendered through, as the eval/ manifests record them. A mixture's sources share
    both (cflib.data.mixture.check_agreement: the tokenizer by the SHA-256 of its files), but each manifest names
    the tokenizer where its own source was converted: the first source whose tokenizer is found here stands for all,
    the others' manifests read only while none is."""
    folders = [root / "eval" for _, root in recorded_roots(record["data"])]
    first = ShardPartition(folders[0])
    spec = shard_tokenizer_spec(first)
    for folder in folders[1:]:
        if spec is not None:
            break
        spec = shard_tokenizer_spec(ShardPartition(folder))
    return spec, shard_chat_template_sha256(first)


def publish_run(record: dict, repo_id: str | None, echo: Callable[[str], None] | None = print) -> dict:
    """push_to_hub at the end of a run: the best (else last) checkpoint's bundle in out_dir/hub, or a LoRA run's
    adapters in out_dir/adapters, pushed to `repo_id` (created private when it does not exist). The record,
    unchanged; nothing without repo_id, or where this process holds no record (a dry run, another node)."""
    if repo_id is None or "checkpoints" not in record:
        return record
    checkpoints = record["checkpoints"]
    chosen = checkpoints.get("best") or checkpoints.get("last")
    if chosen is None:
        raise PushError(f"push_to_hub {repo_id}: the run saved no checkpoint to push (save_checkpoints: false?)")
    chosen, run_dir = Path(chosen), Path(record["out_dir"])
    if is_adapter_checkpoint(chosen):
        publish(chosen, run_dir / "adapters", "adapters",
                lambda folder, said: export_adapters(chosen, folder, repo_id=repo_id, echo=said),
                repo_id, private=True, echo=echo)
        return record
    spec, template_sha256 = data_tokenizer(record)
    if spec is None:
        raise PushError(f"push_to_hub {repo_id}: the data's index names no tokenizer; push with python -m "
                        f"cflib.export hub {run_dir} {run_dir / 'hub'} --tokenizer TOKENIZER --push {repo_id}")
    publish(chosen, run_dir / "hub", "bundle",
            lambda folder, said: export_hub(chosen, folder, tokenizer=spec, repo_id=repo_id, echo=said,
                                            chat_template_sha256=template_sha256),
            repo_id, private=True, echo=echo)
    return record
