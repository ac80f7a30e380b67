"""The model card of a published model: README.md with YAML metadata, as the Hugging Face Hub reads it.

The metadata says what the Hub's model page uses (`library_name`,
`pipeline_tag`, `tags`) and, under `cflib`, where the weights came from: the
checkpoint exported and the SHA-256 of its weights, the base it was trained
from and that base's SHA-256, the data's manifest hashes, the training
parameters, the evaluation, the kernel path and the measured throughput.
The body says the same for a reader, and how to load the model. The licence
is left for the user: a commented `license:` line in the metadata.

A card goes public with its model, so it names files by their folder's name,
never by a path of the machine that wrote it; its loading lines name the Hub
repository it was written for (`cflib.repo_id`), else the folder by its name.

The card reads the run the checkpoint belongs to (its `record.json`, the
shard manifests it names, and `eval/record.json` where lm-evaluation-harness
scored the run's bundle); a checkpoint outside a run gets a card without
them. The evaluation table takes every metric the run's evaluation of that
checkpoint holds, whatever its name, so new metrics appear without a change
here.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from cflib.data.shards import sha256_file
from cflib.data.sources import HUB
from cflib.export.peft import MERGE_FORMAT, MERGE_MANIFEST
from cflib.jsonio import read_bounded, read_json
from cflib.yamlio import load_yaml

CARD_FILE = "README.md"
# The most of a README.md read to find cflib's card: the card cflib writes is a few kB, and a body a user adds
# stays far below this (as much as cflib reads of any YAML document).
CARD_BYTES = 4 * 2**20
# An evaluation's bookkeeping, not a metric.
NOT_METRICS = ("tag", "step", "epoch", "supervised_tokens", "examples", "seconds", "exact_match_samples")
LICENCE_LINE = ("# license: set the licence these weights are released under (an id from "
                "https://hf.co/docs/hub/repositories-licenses); the base model's terms apply to what it passes on\n")


def _json(path: Path) -> dict | None:
    """A JSON document cflib wrote, or None where it is absent, unreadable, too large, too deep or not an object."""
    if not path.is_file():
        return None
    try:
        document = read_json(path, ValueError)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def run_of(checkpoint: Path) -> tuple[Path | None, dict | None]:
    """(the run folder, its record) of a checkpoint saved by a run (`<run>/checkpoints/<name>`); (None, None) for
    a checkpoint outside a run. A run still going, or killed, has no record yet."""
    if checkpoint.parent.name != "checkpoints":
        return None, None
    run_dir = checkpoint.parent.parent
    if not (run_dir / "params.json").is_file():
        return None, None
    return run_dir, _json(run_dir / "record.json")


def _numbers(prefix: str, value: Any) -> dict[str, float]:
    """Every number under value, named by its path."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, (int, float)):
        return {prefix: float(value)}
    if isinstance(value, dict):
        return {name: number for key, item in value.items() for name, number in _numbers(f"{prefix}/{key}", item).items()}
    return {}


def lm_eval_metrics(scores: Any) -> dict[str, float]:
    """lm-evaluation-harness scores (a list of {task, metric, filter, value}, as cflib.lab.evaluate records them,
    or a mapping task -> metric -> value) as lm_eval/<task>/<metric>."""
    if isinstance(scores, dict):
        return _numbers("lm_eval", scores)
    found = {}
    for score in scores if isinstance(scores, list) else []:
        if isinstance(score, dict) and isinstance(score.get("value"), (int, float)):
            kept = score.get("filter") in (None, "none")
            metric = score["metric"] if kept else f"{score['metric']},{score['filter']}"
            found[f"lm_eval/{score['task']}/{metric}"] = float(score["value"])
    return found


def checkpoint_evaluation(record: dict, name: str) -> dict | None:
    """The run's evaluation of the checkpoint `name` (best, last, epoch-N, step-N)."""
    if name == "last":
        return record.get("eval", {}).get("final")
    evals = record.get("eval", {}).get("history", [])
    tagged = [e for e in evals if e.get("tag") == name]  # epoch-N
    if tagged:
        return tagged[-1]
    numbered = re.fullmatch(r"step-(\d+)", name)
    step = record.get("checkpoints", {}).get("best_step") if name == "best" else numbered and numbered.group(1)
    at_step = [e for e in evals if step is not None and str(e.get("step")) == str(step)]
    # Several evaluations at one step (a periodic one and the epoch's): the one with the most metrics.
    return max(at_step, key=lambda e: len(_numbers("", e))) if at_step else None


def evaluation(record: dict, run_dir: Path, name: str) -> dict[str, float]:
    """Every metric of the checkpoint `name`: the run's held-out evaluation (eval/...), lm-eval results the record
    holds, and those lm-evaluation-harness gave the run's bundle (out_dir/eval, the best checkpoint's)."""
    found = {}
    evaluated = checkpoint_evaluation(record, name)
    if evaluated is not None:
        found.update(_numbers("eval", {key: value for key, value in evaluated.items() if key not in NOT_METRICS}))
    found.update(lm_eval_metrics(record.get("lm_eval")))
    scored = _json(run_dir / "eval" / "record.json")
    if name == "best" and scored is not None:
        found.update(lm_eval_metrics(scored.get("scores")))
    return found


def data_manifests(record: dict) -> dict:
    """The data's manifest hashes, partition by partition, as the shard's sft.idx.json records them; a mixture's
    under `sources`, one entry per source with its weight (0: held out only, evaluated and never trained on, its
    eval partition alone named)."""
    data = record.get("data", {})
    plan = (data.get("mixture") or {}).get("sources")
    if isinstance(plan, list):
        # A source held out only is not trained on and may have no train/: only its eval/ is named.
        return {"sources": [{"name": source.get("name"), "weight": source.get("weight"),
                             **_root_manifests(Path(source.get("root", "")),
                                               ("eval",) if source.get("weight") == 0 else ("train", "eval"))}
                            for source in plan]}
    return _root_manifests(Path(data.get("root", "")))


def _root_manifests(root: Path, partitions: tuple[str, ...] = ("train", "eval")) -> dict:
    manifests = {"root": root.name}
    for partition in partitions:
        index = _json(root / partition / "sft.idx.json") or {}
        manifests[partition] = {"examples": index.get("examples"), "sha256": index.get("sha256")}
    return manifests


def base_checkpoint(record: dict) -> dict:
    """What the run trained from: a LoRA run's frozen base, a checkpoint (a Hub bundle by its repository and
    commit), or a preset from scratch; with the SHA-256 of its weights where they are on disk."""
    hub = record.get("hub_start")
    if record.get("lora"):  # its base's Hub bundle, also where the run started from adapters on it (a later stage)
        base = record["lora"]["base"]
        hub = base.get("hub") if isinstance(base.get("hub"), dict) else hub
    on_hub = f"Hub bundle {hub.get('repo_id')} at commit {hub.get('commit')}" if isinstance(hub, dict) else None
    if record.get("lora"):
        return {"source": on_hub or f"checkpoint {Path(base.get('path', '')).name}", "sha256": base.get("sha256")}
    start = record.get("params", {}).get("init_checkpoint")
    if start is None:
        return {"source": f"preset {record.get('params', {}).get('model')} (trained from scratch)", "sha256": None}
    if on_hub is not None:  # its weights are in this machine's Hugging Face cache: the commit names them
        return {"source": on_hub, "sha256": None}
    found = Path(start) / "model.safetensors"
    return {"source": f"checkpoint {Path(start).name}", "sha256": sha256_file(found) if found.is_file() else None}


# The parameters that hold paths: the card keeps their last part.
PATH_PARAMETERS = ("init_checkpoint", "teacher_checkpoint", "data", "out_dir", "resume", "curriculum")


def portable(params: dict) -> dict:
    """The run's parameters with every path reduced to its last part (a mixture's sources' too)."""
    def last_part(name: str, value: Any) -> Any:
        if name not in PATH_PARAMETERS:
            return value
        if isinstance(value, str):  # a Hub start (hub:ORG/NAME@COMMIT) is no path of this machine: kept whole
            return value if value.startswith(HUB) else Path(value).name
        if isinstance(value, list):  # a mixture: {path, weight, name} each
            return [{**entry, "path": Path(entry["path"]).name} if isinstance(entry, dict) and
                    isinstance(entry.get("path"), str) else entry for entry in value]
        return value

    return {name: last_part(name, value) for name, value in params.items()}


WEIGHT_FILES = {"bundle": "model.safetensors", "adapters": "adapter_model.safetensors"}


def trained_checkpoint(checkpoint: Path) -> Path:
    """The checkpoint a run trained that `checkpoint` holds: itself, or the LoRA adapters' checkpoint that a merge
    (its manifest beside the weights) folded into their base."""
    manifest = _json(checkpoint / MERGE_MANIFEST) or {}
    adapters = manifest.get("adapter") if manifest.get("format") == MERGE_FORMAT else None
    return Path(adapters) if isinstance(adapters, str) else checkpoint


def card_metadata(checkpoint: Path, kind: str, repo_id: str | None) -> dict:
    """The `cflib` block of the card's metadata: the checkpoint, the repository it is for, and what its run says
    of it (for merged adapters, the run that trained them)."""
    trained = trained_checkpoint(checkpoint)
    run_dir, record = run_of(trained)
    meta: dict[str, Any] = {"kind": kind, "repo_id": repo_id, "checkpoint": {
        "name": trained.name, "run": run_dir.name if run_dir else None,
        "sha256": sha256_file(checkpoint / WEIGHT_FILES[kind])}}
    if trained != checkpoint:
        meta["checkpoint"]["merged_adapters"] = True
    if record is None:
        return meta
    meta.update(base=base_checkpoint(record), data=data_manifests(record),
                evaluation=evaluation(record, run_dir, trained.name), kernel_path=record.get("kernel_path"),
                throughput={**(record.get("throughput") or {}), "device": record.get("device"),
                            "world_size": record.get("world_size"), "precision": record.get("precision")},
                framework=record.get("framework"), training_parameters=portable(record.get("params") or {}))
    return meta


def published(folder: Path) -> dict:
    """The `cflib` block of a folder's card; empty without a card or one cflib wrote."""
    path = folder / CARD_FILE
    if not path.is_file():
        return {}
    # A README.md of another writer (another encoding, gigabytes, YAML nested past PyYAML's recursion) is no card
    # cflib wrote: read bounded, like every document cflib reads, and any failure is the "no card" answer.
    try:
        text = read_bounded(path, CARD_BYTES, ValueError, "model card").decode("utf-8")
        match = re.match(r"---\n(.*?)\n---\n", text, re.S)
        metadata = load_yaml(match.group(1), str(path), ValueError) if match else None
    except ValueError:  # UnicodeDecodeError is one
        return {}
    block = metadata.get("cflib") if isinstance(metadata, dict) else None
    return block if isinstance(block, dict) else {}


def published_checkpoint(folder: Path) -> dict | None:
    """The checkpoint a folder's card says it was exported from ({name, run, sha256}); None without a card."""
    return published(folder).get("checkpoint")


def model_card(checkpoint: Path, kind: str, out: Path, config: dict, repo_id: str | None = None,
               base_model: str | None = None, base_revision: str | None = None) -> str:
    """README.md for the bundle of `checkpoint` (kind "bundle") or for its LoRA adapters ("adapters"), written to
    the folder `out` for the Hub repository `repo_id`. The loading lines hand from_pretrained the repository, else
    the folder by its name: never a path of this machine. Adapters name `base_model` (the base's Hub bundle) where
    given, in the metadata and the loading lines, at `base_revision` (the commit they were trained on) where
    given."""
    meta = card_metadata(checkpoint, kind, repo_id)
    where = repo_id or out.name
    tags = ["cflib", "tr-moe", "mixture-of-experts", "custom_code"] + (["lora"] if kind == "adapters" else [])
    header = {"library_name": "peft" if kind == "adapters" else "transformers", "pipeline_tag": "text-generation",
              "tags": tags, **({"base_model": base_model} if base_model else {}), "cflib": meta}
    front = yaml.safe_dump(header, sort_keys=False, allow_unicode=True, width=1000)
    sections = [_introduction(meta, kind, where, config), _loading(meta, kind, where, base_model, base_revision),
                _evaluation(meta),
                _training(meta), LICENCE_SECTION]
    return f"---\n{front}{LICENCE_LINE}---\n\n" + "\n\n".join(sections) + "\n"


LICENCE_SECTION = ("## Licence\n\nNot set: add `license:` to the metadata at the top of this file (the commented "
                   "line) for the licence these weights are released under. The base model's and the data's terms "
                   "apply to what they pass on.")


def _introduction(meta: dict, kind: str, where: str, config: dict) -> str:
    shape = (f"{config.get('num_hidden_layers')} layers, hidden size {config.get('hidden_size')}, "
             f"{config.get('num_experts')} experts with {config.get('num_experts_per_tok')} per token, a "
             f"{config.get('vocab_size')}-token vocabulary")
    what = ("LoRA adapters, in PEFT's format, for a TR-MoE language model" if kind == "adapters"
            else "A TR-MoE language model")
    return (f"# {Path(where).name}\n\n{what} ({shape}), fine-tuned with cflib. TR-MoE is a decoder whose "
            "feed-forward block is a deterministic token-routed mixture of experts: a shared SwiGLU plus experts "
            f"chosen by a fixed table of token ids, with no router and no auxiliary loss.{_context(config)}")


def _context(config: dict) -> str:
    """A scaled RoPE's extended context, as the card's introduction names it; nothing for plain RoPE."""
    scaling = config.get("rope_scaling")
    if not isinstance(scaling, dict):
        return ""
    return (f" Its context is extended to {config.get('max_position_embeddings'):,} positions by RoPE scaling "
            f"({scaling.get('rope_type')}, factor {scaling.get('factor'):g}: `rope_scaling` in config.json, which the "
            "model's code applies as it loads).")


def _loading(meta: dict, kind: str, where: str, base_model: str | None = None, revision: str | None = None) -> str:
    if kind == "adapters":
        base = meta.get("base", {}).get("source", "the base checkpoint")
        at = f' at commit `{revision}`' if revision else ""
        named = (f"`{base_model}`{at} is the Hub bundle of the base these adapters were trained on ({base}); "
                 "their adapter_config.json names it too, so `peft.AutoPeftModelForCausalLM.from_pretrained("
                 f'"{where}", trust_remote_code=True)` loads base and adapters in one call'
                 if base_model else f"`BASE` is the Hub bundle of the base these adapters were trained on ({base}; "
                                    "`python -m cflib.export hub BASE_CHECKPOINT OUT` makes one)")
        pinned = f', revision="{revision}"' if revision else ""
        return ("## How to load it\n\n```python\nimport peft\nfrom transformers import AutoModelForCausalLM\n\n"
                f'base = AutoModelForCausalLM.from_pretrained("{base_model or "BASE"}"{pinned}, '
                "trust_remote_code=True)  # the base's Hub bundle\n"
                f'model = peft.PeftModel.from_pretrained(base, "{where}")\n```\n\n'
                f"{named}. PEFT 0.17 to 0.21 reads the experts' adapters (PEFT 0.22.0 cannot load adapters of both "
                "the shared and the expert tensors of a layer).")
    return ("## How to load it\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f'model = AutoModelForCausalLM.from_pretrained("{where}", trust_remote_code=True)\n'
            f'tokenizer = AutoTokenizer.from_pretrained("{where}", trust_remote_code=True)\n'
            'messages = [{"role": "user", "content": "123+456="}]\n'
            "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
            "return_dict=True)\n"
            "out = model.generate(**inputs, max_new_tokens=32, do_sample=False)\n"
            'print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))\n```\n\n'
            "The model's code is in this repository (`configuration_tr_hash_moe.py`, `modeling_tr_hash_moe.py`), "
            "hence `trust_remote_code=True`; it imports only torch and transformers.")


def _evaluation(meta: dict) -> str:
    metrics = meta.get("evaluation") or {}
    if not metrics:
        return "## Evaluation\n\nNo evaluation of this checkpoint was recorded."
    rows = "\n".join(f"| `{name}` | {value:.4g} |" for name, value in metrics.items())
    return ("## Evaluation\n\nThe run's evaluation of this checkpoint: held-out loss and greedy exact match "
            "(`eval/...`), and lm-evaluation-harness (`lm_eval/<task>/<metric>`) where it scored it.\n\n"
            f"| metric | value |\n| --- | ---: |\n{rows}")


def _training(meta: dict) -> str:
    checkpoint = meta["checkpoint"]
    of_run = f" of the run {checkpoint['run']}" if checkpoint.get("run") else ""
    merged = ", its LoRA adapters merged into their base" if checkpoint.get("merged_adapters") else ""
    lines = [f"| checkpoint | `{checkpoint['name']}`{of_run}{merged}, weights SHA-256 `{checkpoint['sha256']}` |"]
    if "base" not in meta:
        return ("## Training\n\n| | |\n| --- | --- |\n" + lines[0] + "\n\nExported from a checkpoint outside a run "
                "folder: no run record describes its training.")
    base, data, params = meta["base"], meta["data"], meta.get("training_parameters") or {}
    lines.append(f"| base | {base['source']}" + (f", weights SHA-256 `{base['sha256']}`" if base["sha256"] else "") + " |")
    for source in data.get("sources", [data]):  # a mixture: each source, with its weight
        weight = source.get("weight")
        role = "" if weight is None else (" (held out only: weight 0)" if weight == 0 else f" (weight {weight:g})")
        for partition in [name for name in ("train", "eval") if name in source]:  # held out only: eval alone
            hashes = ", ".join(f"{name} `{digest}`" for name, digest in (source[partition]["sha256"] or {}).items())
            examples = source[partition]["examples"]
            count = f"{examples:,} examples" if isinstance(examples, int) else "examples"
            lines.append(f"| {partition} data | {count} of {source['root']}{role}; manifest SHA-256: "
                         f"{hashes or 'not found'} |")
    # warmup_steps, where set, wins over warmup_ratio (cflib.train.run.resolve_schedule): the unused ratio is left out
    unused = {"warmup_ratio"} if params.get("warmup_steps") is not None else set()
    if params.get("teacher_checkpoint") is None:  # what distils, where a run distilled
        unused |= {"distill_ratio", "distill_temperature"}
    recipe = ", ".join(f"{name} {params[name]}" for name in RECIPE
                       if params.get(name) != RECIPE_DEFAULTS.get(name) and name in params and name not in unused)
    lines.append(f"| recipe | {recipe} |")
    lines.append("| kernel path | " + ", ".join(f"{k}: {v}" for k, v in (meta.get("kernel_path") or {}).items()
                                                if not isinstance(v, dict)) + " |")
    lines.append(f"| throughput | {_throughput(meta['throughput'])} |")
    framework = meta.get("framework") or {}
    lines.append(f"| software | cflib {framework.get('cflib')} (commit {framework.get('cflib_commit')}), "
                 f"torch {framework.get('torch')} |")
    return ("## Training\n\n| | |\n| --- | --- |\n" + "\n".join(lines) + "\n\nEvery training parameter is in this "
            "card's metadata (`cflib.training_parameters`).")


# The parameters the card's recipe line names, where set (not None, nor the default RECIPE_DEFAULTS gives: a card
# names DFT, frozen experts or a teacher, and a plain run's card reads as before); the metadata holds them all.
RECIPE = ("full_parameter", "frozen_modules", "frozen_layers", "lora_rank", "lora_alpha", "lora_scaling", "lora_dora",
          "lora_plus_ratio", "loss_type", "teacher_checkpoint", "distill_ratio", "distill_temperature", "epochs",
          "max_steps", "global_batch", "seq_len", "rope_scaling", "rope_theta", "max_position_embeddings",
          "overlong_examples", "optimizer", "muon_momentum", "lr", "embedding_lr_multiplier",
          "weight_decay", "adam_epsilon", "warmup_ratio", "warmup_steps", "lr_schedule", "min_lr_ratio",
          "lr_decay_ratio", "max_grad_norm", "bf16", "pack_sequences", "neftune_noise_alpha", "seed")
RECIPE_DEFAULTS = {"loss_type": "sft_cross_entropy", "overlong_examples": "error", "adam_epsilon": 1e-8,
                   "optimizer": "adamw", "muon_momentum": 0.95, "embedding_lr_multiplier": 1.0}


def _throughput(throughput: dict) -> str:
    device = throughput.get("device") or {}
    rate = throughput.get("steady_state_tokens_per_s")
    parts = [f"{rate:,.0f} tokens/s in the steady state" if rate else "not measured (too few steps)"]
    if throughput.get("model_tflops_per_s"):
        parts.append(f"{throughput['model_tflops_per_s']:.3g} model TFLOP/s")
    if throughput.get("peak_memory_gib"):
        parts.append(f"peak {throughput['peak_memory_gib']:.3g} GiB")
    return (", ".join(parts) + f" on {device.get('name')} ({device.get('type')}) x {throughput.get('world_size')}, "
            f"{throughput.get('precision')}")
