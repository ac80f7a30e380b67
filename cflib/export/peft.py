"""LoRA adapter checkpoints in PEFT's format, and merging one into its base checkpoint.

A LoRA checkpoint folder holds what `peft.PeftModel.from_pretrained` reads:
`adapter_config.json` and `adapter_model.safetensors`, keyed
`base_model.model.<module>.lora_A.weight` / `lora_B.weight` (under DoRA also
`<module>.lora_magnitude_vector`, one entry per output feature, as PEFT saves it); and
`cflib_adapter.json`: the base checkpoint it adapts (path, SHA-256 of its weights,
config; for a base a run pulled from the Hub, its repository and commit too) and the
settings, so a resumed run or a merge finds its base and can tell when it has
changed. adapter_config.json names a Hub base by its repository and commit
(`base_model_name_or_path`, `revision`), which PEFT's AutoPeftModel loads; any
other base by its path. A resumable one also holds the optimizer state and progress
files of a full checkpoint (cflib.model.checkpoint).

These files are written here, not by PEFT: `PeftModel.save_pretrained` saves a
transformers model wrapped by PEFT, and training holds cflib's own model (its
fused kernels have no PEFT counterpart); PEFT stays a test-time dependency, and
the tests load these folders with PEFT itself. Expert adapters follow PEFT's
`target_parameters` layout for 3-D parameters (lora.ParamWrapper): on an
[E, in, out] tensor, PEFT's lora_A is [E * r, out] and lora_B [in, r * E], and the
wrappers of one module's parameters nest, the first registered (expert_gate)
deepest, each adding a `base_layer.` to the names below it.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cflib.atomic import atomic_directory, check_output_folder, follow_umask, live_path
from cflib.errors import shown
from cflib.export.push import names_hub_commit
from cflib.jsonio import read_json
from cflib.locks import exclusive_output
from cflib.model.checkpoint import (
    CONFIG_FILE,
    PROGRESS_FILE,
    TRAINER_STATE_FILE,
    WEIGHTS_FILE,
    WEIGHT_DTYPES,
    CheckpointError,
    holds_model,
    load_checkpoint,
    non_finite_tensor,
    save_checkpoint,
)
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import (
    BASE_DTYPES,
    EXPERT_TARGETS,
    LINEAR_TARGETS,
    SCALINGS,
    TARGETS,
    LoraSettings,
    merge_adapters,
)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
CFLIB_ADAPTER_FILE = "cflib_adapter.json"
ADAPTER_FORMAT = "cflib-lora-v1"
PEFT_PREFIX = "base_model.model."
_SHARED = "mlp.engine.shared_"


def is_adapter_checkpoint(path: str | Path) -> bool:
    return (live_path(path) / ADAPTER_CONFIG_FILE).is_file()


def holds_weights(folder: Path) -> bool:
    """Whether `folder` is a checkpoint of either kind: a full model's, or LoRA adapters'."""
    return holds_model(folder) or is_adapter_checkpoint(folder)


def weights_sha256(checkpoint_dir: str | Path) -> str:
    digest = hashlib.sha256()
    with open(Path(checkpoint_dir) / WEIGHTS_FILE, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_base(checkpoint_dir: str | Path, hub: dict | None = None) -> dict:
    """What identifies a LoRA run's base: where it is, its weights' hash and its config; `hub`: the Hub bundle it was
    downloaded from, as the run pinned it ({repo_id, revision, commit}), which adapters exported from it name."""
    path = Path(checkpoint_dir).resolve()
    return {"path": str(path), "sha256": weights_sha256(path),
            "config": read_json(path / CONFIG_FILE, CheckpointError, "model config (config.json)"),
            **({"hub": hub} if hub is not None else {})}


def hub_base(base: dict) -> dict | None:
    """The Hub bundle a LoRA checkpoint's base came from ({repo_id, revision, commit}: a run started from
    hub:ORG/NAME), None for a base of this machine (or adapters saved before cflib recorded it)."""
    hub = base.get("hub")
    return hub if isinstance(hub, dict) else None


def peft_base(base: dict) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) of adapters on `base`: a Hub bundle's repository at its commit, which
    transformers loads (with the bundle's own model code), else the base's folder."""
    hub = hub_base(base)
    return (hub["repo_id"], hub["commit"]) if hub is not None else (base["path"], None)


def _expert_depths(settings: LoraSettings) -> dict[str, int]:
    """PEFT's nesting: how many `base_layer.` sit between mlp.engine and each expert target's factors."""
    chosen = [name for name in EXPERT_TARGETS if name in settings.targets]
    return {name: len(chosen) - 1 - k for k, name in enumerate(chosen)}


def to_peft(adapters: dict[str, torch.Tensor], settings: LoraSettings) -> dict[str, torch.Tensor]:
    """The model's adapter tensors (cflib.model.lora.adapter_state_dict) under PEFT's names and layout."""
    depths = _expert_depths(settings)
    nested = "base_layer." * len(depths)
    out = {}
    for name, tensor in adapters.items():
        tensor = tensor.detach().to("cpu", torch.float32)
        if ".expert_lora." in name:
            owner, rest = name.split(".expert_lora.")
            target, factor = rest.split(".", 1)[0], rest.split(".")[1]
            prefix = f"{PEFT_PREFIX}{owner}.{'base_layer.' * depths[target]}"
            experts, rank = tensor.shape[0], settings.rank
            if factor == "lora_A":  # ours [E, r, in] -> PEFT's lora_B [in, r * E]
                out[prefix + "lora_B.weight"] = tensor.permute(2, 1, 0).reshape(tensor.shape[2], rank * experts)
            else:  # ours [E, out, r] -> PEFT's lora_A [E * r, out]
                out[prefix + "lora_A.weight"] = tensor.transpose(1, 2).reshape(experts * rank, tensor.shape[1])
        else:
            out[PEFT_PREFIX + name.replace(_SHARED, "mlp.engine." + nested + "shared_")] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_peft(tensors: dict[str, torch.Tensor], settings: LoraSettings, source: str) -> dict[str, torch.Tensor]:
    """The inverse of to_peft: PEFT's names and layout back to the model's adapter names."""
    depths = _expert_depths(settings)
    by_depth = {depth: name for name, depth in depths.items()}
    nested = "base_layer." * len(depths)
    out = {}
    for key, tensor in tensors.items():
        if not key.startswith(PEFT_PREFIX):
            raise CheckpointError(f"{source}: tensor {key!r} lacks PEFT's {PEFT_PREFIX!r} prefix")
        _check_factor(key, tensor, source)
        name = key[len(PEFT_PREFIX):]
        if ".mlp.engine." in name and ".mlp.engine." + nested + "shared_" not in name:
            owner, rest = name.split(".mlp.engine.")
            depth = rest.count("base_layer.")
            if depth not in by_depth or rest != "base_layer." * depth + rest.rsplit(".", 2)[-2] + ".weight":
                raise CheckpointError(f"{source}: tensor {key!r} is no adapter of the targets {settings.targets}")
            prefix, rank = f"{owner}.mlp.engine.expert_lora.{by_depth[depth]}", settings.rank
            stacked = tensor.shape[1] if rest.endswith("lora_B.weight") else tensor.shape[0]
            if stacked % rank:
                raise CheckpointError(f"{source}: tensor {key!r} has shape {list(tensor.shape)}: an expert adapter "
                                      f"stacks one rank-{rank} factor per expert, so {stacked} must be a multiple "
                                      f"of {rank}")
            if rest.endswith("lora_B.weight"):  # PEFT's [in, r * E] -> ours [E, r, in]
                experts = tensor.shape[1] // rank
                out[prefix + ".lora_A.weight"] = tensor.reshape(tensor.shape[0], rank, experts).permute(2, 1, 0)
            else:  # PEFT's [E * r, out] -> ours [E, out, r]
                experts = tensor.shape[0] // rank
                out[prefix + ".lora_B.weight"] = tensor.reshape(experts, rank, tensor.shape[1]).transpose(1, 2)
        else:
            out[name.replace(".mlp.engine." + nested + "shared_", ".mlp.engine.shared_")] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _is_int(value: object, low: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and low <= value < 2**31


def _is_real(value: object, low: float, high: float) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and low <= value < high


# Each setting a LoRA checkpoint records, and what it must be (as the run's parameters are checked).
_SETTING_CHECKS = {
    "rank": (lambda v: _is_int(v, 1), "a positive integer"),
    "alpha": (lambda v: _is_real(v, 0, math.inf) and v > 0, "a positive finite number"),
    "scaling": (lambda v: v in SCALINGS, f"one of {SCALINGS}"),
    "dora": (lambda v: isinstance(v, bool), "true or false"),
    "dropout": (lambda v: _is_real(v, 0, 1), "a number in [0, 1)"),
    "targets": (lambda v: isinstance(v, list) and v and all(t in TARGETS for t in v),
                f"a list of targets among {tuple(TARGETS)}"),
    "base_dtype": (lambda v: v in BASE_DTYPES, f"one of {tuple(BASE_DTYPES)}"),
    "trainable_tokens": (lambda v: isinstance(v, list) and all(_is_int(t, 0) for t in v), "a list of token ids"),
}


def _checked_settings(raw: dict, meta_file: Path) -> LoraSettings:
    """The LoRA settings a checkpoint records, each checked: a description edited or damaged by hand is refused
    by key, never turned into NaN weights or a raw error."""
    for key, (fits, what) in _SETTING_CHECKS.items():
        if key in raw and not fits(raw[key]):
            raise CheckpointError(f"{meta_file}: lora.{key} must be {what}, got {shown(raw[key])}")
    try:
        return LoraSettings.from_dict(raw)
    except ValueError as err:  # settings that cannot go together, e.g. DoRA on an expert tensor
        raise CheckpointError(f"{meta_file}: lora: {err}") from None


def _check_factor(key: str, tensor: torch.Tensor, source: str) -> None:
    """A LoRA factor is a matrix of weights: float32 or bfloat16 (an integer or FP16 one would be cast
    silently), two dimensions (anything else could not be laid out as the model's); DoRA's magnitude a vector."""
    if tensor.dtype not in WEIGHT_DTYPES:
        raise CheckpointError(f"{source}: tensor {key!r} is stored as {tensor.dtype}; cflib reads adapters in "
                              "float32 or bfloat16")
    magnitude = key.endswith(".lora_magnitude_vector")
    if tensor.dim() != (1 if magnitude else 2):
        what = "DoRA's magnitude is a vector" if magnitude else "a LoRA factor is a matrix"
        raise CheckpointError(f"{source}: tensor {key!r} has shape {list(tensor.shape)}; {what}")


def peft_config(settings: LoraSettings, base_path: str | None, revision: str | None = None) -> dict:
    """adapter_config.json: LoraConfig's fields that say what these adapters are; PEFT fills in the rest. `revision`:
    the commit of a base on the Hub, which AutoPeftModel hands from_pretrained with base_model_name_or_path."""
    linear = [name for name in LINEAR_TARGETS if name in settings.targets]
    experts = [name for name in EXPERT_TARGETS if name in settings.targets]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path, "revision": revision,
            "r": settings.rank, "lora_alpha": settings.alpha, "lora_dropout": settings.dropout,
            "target_modules": linear or None, "target_parameters": experts or None, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": settings.scaling == "rslora", "use_dora": settings.dora,
            "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
            "trainable_token_indices": {"embed_tokens": list(settings.trainable_tokens)}
            if settings.trainable_tokens else None}


def save_adapter(path: str | Path, adapters: dict[str, torch.Tensor], settings: LoraSettings, base: dict,
                 trainer_state: dict | None = None, progress: dict | None = None) -> Path:
    """Write a LoRA checkpoint atomically (optionally resumable: optimizer state and progress beside it)."""
    bad = non_finite_tensor(adapters)
    if bad:  # never published, whatever nan_patience allowed
        raise CheckpointError(f"{path}: not written: adapter {bad}; the earlier checkpoints are unchanged")
    with atomic_directory(path) as staging:
        (staging / ADAPTER_CONFIG_FILE).write_text(json.dumps(peft_config(settings, *peft_base(base)), indent=2) + "\n")
        save_file(to_peft(adapters, settings), str(staging / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        follow_umask(staging / ADAPTER_WEIGHTS_FILE)
        (staging / CFLIB_ADAPTER_FILE).write_text(json.dumps(
            {"format": ADAPTER_FORMAT, "lora": settings.to_dict(), "base": base}, indent=2) + "\n")
        if trainer_state is not None:
            torch.save(trainer_state, staging / TRAINER_STATE_FILE)
        if progress is not None:
            (staging / PROGRESS_FILE).write_text(json.dumps(progress, indent=2) + "\n")
    return Path(path)


def _description(meta_file: Path) -> tuple[LoraSettings, dict]:
    """A LoRA checkpoint's cflib_adapter.json: its settings, checked, and the whole description."""
    meta = read_json(meta_file, CheckpointError, "adapter description")
    if not isinstance(meta, dict) or not isinstance(meta.get("lora"), dict):
        raise CheckpointError(f"{meta_file}: 'lora' must be an object of LoRA settings")
    return _checked_settings(meta["lora"], meta_file), meta


def adapter_settings(path: str | Path) -> LoraSettings:
    """The LoRA settings a LoRA checkpoint folder's adapters were trained with (no tensor is read)."""
    return _description(live_path(path) / CFLIB_ADAPTER_FILE)[0]


def read_adapter(path: str | Path) -> tuple[LoraSettings, dict, dict[str, torch.Tensor]]:
    """(settings, base description, the model's adapter tensors) of a LoRA checkpoint folder."""
    path = live_path(path)  # a replacement killed between its renames left the previous folder aside
    meta_file, weights = path / CFLIB_ADAPTER_FILE, path / ADAPTER_WEIGHTS_FILE
    for needed in (path / ADAPTER_CONFIG_FILE, meta_file, weights):
        if not needed.is_file():
            raise CheckpointError(f"{needed}: missing; a LoRA checkpoint holds {ADAPTER_CONFIG_FILE}, "
                                  f"{ADAPTER_WEIGHTS_FILE} and {CFLIB_ADAPTER_FILE}")
    settings, meta = _description(meta_file)
    base = meta.get("base")
    if not isinstance(base, dict) or not isinstance(base.get("path"), str):
        raise CheckpointError(f"{meta_file}: 'base' must be an object with the base checkpoint's 'path', "
                              f"got {shown(base)}")
    _check_hub_base(base, meta_file)
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({err})") from None
    bad = non_finite_tensor(tensors)
    if bad:
        raise CheckpointError(f"{weights}: adapter {bad}; training or merging from it gives non-finite outputs")
    return settings, base, from_peft(tensors, settings, str(weights))


def _check_hub_base(base: dict, meta_file: Path) -> None:
    """A base's Hub bundle, where one is recorded, names a repository and a commit in full: adapters exported from
    the checkpoint send PEFT's loaders there."""
    if "hub" not in base:
        return
    hub = base["hub"]
    if not (names_hub_commit(hub) and (hub.get("revision") is None or isinstance(hub["revision"], str))):
        raise CheckpointError(f"{meta_file}: base.hub must name the Hub bundle the base was downloaded from "
                              f"(repo_id ORG/NAME, commit: 40 hex digits, revision), got {shown(hub)}")


def check_fits(expected: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], source: str,
               model: str = "the model") -> None:
    """Every adapter tensor named and shaped as `expected`'s (the adapters `model` takes)."""
    for name, tensor in adapters.items():
        if name not in expected:
            raise CheckpointError(f"{source}: adapter {name!r} has no counterpart in {model}")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{source}: adapter {name!r} has shape {list(tensor.shape)}, {model} needs "
                                  f"{list(expected[name].shape)}")
    missing = sorted(set(expected) - set(adapters))
    if missing:
        raise CheckpointError(f"{source}: missing adapter {missing[0]!r}")


def base_matches_training(adapter_dir: str | Path, base_dir: str | Path | None = None) -> bool:
    """Whether the base the adapters are merged into (`base_dir`, else the one they name) has the weights they were
    trained on: its weights' SHA-256 against the one cflib_adapter.json recorded."""
    base = read_json(live_path(Path(adapter_dir)) / CFLIB_ADAPTER_FILE, CheckpointError, "adapter description")["base"]
    return weights_sha256(base_dir or base["path"]) == base.get("sha256")


def load_merged(adapter_dir: str | Path, base_dir: str | Path | None = None) -> TRMoEModel:
    """base + scale * B @ A (fp32) in memory, from a LoRA checkpoint; base_dir: None for the recorded base."""
    return _merged(adapter_dir, base_dir)[0]


def merge(adapter_dir: str | Path, out_dir: str | Path, base_dir: str | Path | None = None) -> dict:
    """Write base + scale * B @ A (fp32) as a public-layout checkpoint; base_dir: None for the recorded base.

    Returns what was merged, and whether the base's weights are the ones the adapters were trained on.
    `out_dir` is new, or a folder an earlier merge wrote (its MERGE_MANIFEST and checkpoint, nothing else)."""
    recorded_base = read_adapter(adapter_dir)[1]["path"] if base_dir is None else base_dir
    def check() -> None:
        check_output_folder(out_dir, {"adapter": adapter_dir, "base": recorded_base}, MergeError,
                            owned=lambda entry: _written_by_merge(Path(out_dir), entry), overwrite=True)

    check()
    model, settings, base, base_dir = _merged(adapter_dir, base_dir)
    with exclusive_output(out_dir, check, MergeError) as staging:  # `out_dir` checked again under its lock
        # save_checkpoint publishes a folder of its own atomically: it takes the empty staging folder's place.
        save_checkpoint(model, staging)
        (staging / MERGE_MANIFEST).write_text(json.dumps(
            {"format": MERGE_FORMAT, "adapter": str(adapter_dir), "base": str(base_dir)}, indent=2) + "\n")
    return {"adapter": str(adapter_dir), "base": str(base_dir), "out": str(out_dir), "lora": settings.to_dict(),
            "base_matches_training": base_matches_training(adapter_dir, base_dir)}


class MergeError(ValueError):
    """A merge that cannot be written where asked; the message names the folder. Nothing was changed."""


MERGE_MANIFEST, MERGE_FORMAT = "merged_from.json", "cflib-lora-merge-v1"


def _written_by_merge(out_dir: Path, entry: Path) -> bool:
    """An entry of a folder an earlier merge wrote: recognised by the manifest it leaves."""
    try:
        manifest = read_json(out_dir / MERGE_MANIFEST, MergeError, "merge manifest")
    except MergeError:
        return False
    return (isinstance(manifest, dict) and manifest.get("format") == MERGE_FORMAT and entry.is_file()
            and entry.name in (MERGE_MANIFEST, CONFIG_FILE, WEIGHTS_FILE))


def _merged(adapter_dir: str | Path, base_dir: str | Path | None
            ) -> tuple[TRMoEModel, LoraSettings, dict, Path]:
    settings, base, adapters = read_adapter(adapter_dir)
    base_dir = Path(base_dir or base["path"])
    model = load_checkpoint(base_dir)
    _check_base_fits(model, adapters, settings, f"{adapter_dir} on {base_dir}")
    merge_adapters(model, adapters, settings)
    return model, settings, base, base_dir


def _check_base_fits(model, adapters: dict[str, torch.Tensor], settings: LoraSettings, source: str) -> None:
    """Each adapter's B @ A must have its base weight's shape, and every target its adapter."""
    from cflib.model.lora import attach_lora  # a skeleton of the adapted model gives every expected shape

    with torch.device("meta"):
        skeleton = type(model)(model.config, build_routes=False)
    attach_lora(skeleton, settings)
    expected = {name: p for name, p in skeleton.named_parameters() if p.requires_grad}
    check_fits(expected, adapters, source, model="a base of this shape")
