"""The model a run trains: a full checkpoint, or LoRA adapters on a frozen base (full_parameter: false).

A LoRA run's checkpoints hold only its adapters (cflib.export.peft) and name
their base; resuming reloads that base, checks it is the same weights, and
refuses to turn a LoRA run into a full one or the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cflib.atomic import live_path
from cflib.data.shards import sha256_file
from cflib.errors import ParamError
from cflib.jsonio import read_json
from cflib.export.peft import (
    ADAPTER_WEIGHTS_FILE,
    CFLIB_ADAPTER_FILE,
    adapter_settings,
    check_fits,
    describe_base,
    is_adapter_checkpoint,
    read_adapter,
    save_adapter,
    weights_sha256,
)
from cflib.export.pull import checkpoint_folder, is_hub
from cflib.model.checkpoint import WEIGHTS_FILE, CheckpointError, load_checkpoint, load_config
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import LoraSettings, adapter_state_dict, attach_lora, is_adapter_name
from cflib.paths import resolve_path
from cflib.train.params import TrainParams

SETTING_PARAMETERS = {"rank": "lora_rank", "alpha": "lora_alpha", "scaling": "lora_scaling", "dora": "lora_dora",
                      "dropout": "lora_dropout", "targets": "lora_targets", "base_dtype": "base_dtype",
                      "trainable_tokens": "lora_trainable_tokens"}


@dataclass(frozen=True)
class LoraRun:
    """A LoRA run's settings and the base checkpoint it adapts (path, weights' SHA-256, config)."""

    settings: LoraSettings
    base: dict

    def save(self, model: TRMoEModel, path: Path, adapters: dict[str, torch.Tensor] | None = None,
             trainer_state: dict | None = None, progress: dict | None = None) -> Path:
        # Gathered FSDP weights come with the buffers (route tables): only the factors are the adapter's.
        adapters = adapter_state_dict(model) if adapters is None else {
            name: tensor for name, tensor in adapters.items() if is_adapter_name(name)}
        return save_adapter(path, adapters, self.settings, self.base, trainer_state, progress)

    def describe(self) -> str:
        s = self.settings
        tokens = f", {len(s.trainable_tokens)} trainable token rows" if s.trainable_tokens else ""
        scaling = "rsLoRA scale alpha / sqrt(rank)" if s.scaling == "rslora" else "scale"
        kind = "DoRA (LoRA with a trained magnitude per output feature)" if s.dora else "LoRA"
        return (f"{kind} rank {s.rank}, alpha {s.alpha:g} ({scaling} {s.scale:g}), dropout {s.dropout:g}, frozen base "
                f"in {s.base_dtype}, on {', '.join(s.targets)}{tokens}; base {self.base['path']}")


def with_adapter_settings(params: TrainParams, resumed: Path | None = None) -> TrainParams:
    """A LoRA run whose init_checkpoint holds adapters trains them on: the LoRA settings it leaves unset are
    theirs (a set one that differs is refused as the adapters load), so the record names what trains. resumed: the
    checkpoint a resume continues, whose adapters train on whatever init_checkpoint names (the base alone, found
    again after a move)."""
    if params.full_parameter or (resumed is None and params.init_checkpoint is None):
        return params
    if resumed is None and is_hub(params.init_checkpoint):  # a Hub bundle is a model, never adapters
        return params
    checkpoint_dir = resumed or resolve_path(params.init_checkpoint)
    if not is_adapter_checkpoint(checkpoint_dir):
        return params
    saved = adapter_settings(checkpoint_dir)
    unset = {parameter: getattr(saved, name) for name, parameter in SETTING_PARAMETERS.items()
             if getattr(params, parameter) is None and not (name == "trainable_tokens" and not saved.trainable_tokens)}
    filled = replace(params, **unset)
    try:
        filled.validate()
    except ParamError as err:
        raise ParamError(f"{err} ({'' if resumed else 'init_checkpoint '}{checkpoint_dir}'s adapters set "
                         f"{', '.join(f'{k} {v}' for k, v in unset.items())})") from None
    return filled


def start_adapters(params: TrainParams) -> dict | None:
    """The adapters a LoRA run starts from (an init_checkpoint holding adapters): their place and their file's
    SHA-256, which a resume checks (cflib.train.resume_identity). None: it starts from a base, or is a full run."""
    if params.full_parameter or params.init_checkpoint is None or is_hub(params.init_checkpoint):
        return None
    checkpoint_dir = resolve_path(params.init_checkpoint)
    if not is_adapter_checkpoint(checkpoint_dir):
        return None
    weights = live_path(checkpoint_dir) / ADAPTER_WEIGHTS_FILE
    return {"path": str(checkpoint_dir.resolve()), "sha256": sha256_file(weights)}


def initial_model(checkpoint_dir: Path, settings: LoraSettings | None, hub: dict | None = None
                  ) -> tuple[TRMoEModel, LoraRun | None]:
    """init_checkpoint's model, with fresh adapters of `settings` on it for a LoRA run (None: full-parameter); a
    LoRA run started from adapters trains them on (their base, their settings), as a curriculum's later stage
    does. hub: the Hub bundle (HubStart.record()) `checkpoint_dir` holds, which the adapters name as their base."""
    if is_adapter_checkpoint(checkpoint_dir):
        if settings is None:
            raise ParamError(f"init_checkpoint {checkpoint_dir} holds LoRA adapters, not a model: merge them into "
                             "their base first (python -m cflib.export merge), or continue that run with resume")
        return adapted_model(checkpoint_dir, settings, read_adapter(checkpoint_dir))
    model = load_checkpoint(checkpoint_dir)
    if settings is None:
        return model, None
    outside = [t for t in settings.trainable_tokens if t >= model.config.vocab_size]
    if outside:
        raise ParamError(f"lora_trainable_tokens: token id {outside[0]} is outside the model's vocabulary "
                         f"[0, {model.config.vocab_size})")
    return attach_lora(model, settings), LoraRun(settings, describe_base(checkpoint_dir, hub))


def resumed_model(checkpoint_dir: Path, settings: LoraSettings | None, init_checkpoint: str | None
                  ) -> tuple[TRMoEModel, LoraRun | None]:
    """The model of a resumable checkpoint; a LoRA checkpoint's adapters on their (unchanged) base. settings: the
    run's LoRA settings (None: full-parameter); init_checkpoint: where the run started, if it names it."""
    adapter = is_adapter_checkpoint(checkpoint_dir)
    if adapter and settings is None:
        raise ParamError(f"{checkpoint_dir} is a checkpoint of a LoRA run: it resumes with full_parameter: false "
                         "(and its LoRA settings); to train every weight from it, merge it (python -m cflib.export "
                         "merge) and start a new run with init_checkpoint")
    if not adapter and settings is not None:
        raise ParamError(f"{checkpoint_dir} is a checkpoint of a full-parameter run: it resumes with "
                         "full_parameter: true; for LoRA, start a new run with init_checkpoint")
    if not adapter:
        return load_checkpoint(checkpoint_dir), None
    adapter = read_adapter(checkpoint_dir)
    base = adapter[1]
    if init_checkpoint is not None:
        start = checkpoint_folder(init_checkpoint)  # a Hub bundle's: in the Hugging Face cache at its commit
        # The run started from the base, or from adapters on that base (a curriculum's later LoRA stage)
        start_base = Path(adapter_base(start)["path"]) if is_adapter_checkpoint(start) else start
        if start_base.resolve() != Path(base["path"]).resolve():
            # The same weights elsewhere (outputs/ moved to another disk or machine) are the same base.
            if not (start_base / WEIGHTS_FILE).is_file() or weights_sha256(start_base) != base["sha256"]:
                raise ParamError(f"init_checkpoint {init_checkpoint} is not the base {base['path']} that "
                                 f"{checkpoint_dir} adapts (nor a copy of its weights)")
            adapter = (adapter[0], {**base, "path": str(start_base.resolve())}, adapter[2])
    return adapted_model(checkpoint_dir, settings, adapter)


def adapted_model(checkpoint_dir: Path, wanted: LoraSettings,
                  adapter: tuple[LoraSettings, dict, dict[str, torch.Tensor]]) -> tuple[TRMoEModel, LoraRun]:
    """A LoRA checkpoint's adapters (read_adapter's) on their base, checked: the run's LoRA settings (`wanted`)
    and the base unchanged."""
    saved, base, adapters = adapter
    for name, parameter in SETTING_PARAMETERS.items():
        if getattr(saved, name) != getattr(wanted, name):
            raise ParamError(f"{checkpoint_dir} was trained with {parameter} {getattr(saved, name)}, this run has "
                             f"{getattr(wanted, name)}: adapters trained on keep their LoRA settings")
    base_dir = Path(base["path"])
    if not (base_dir / WEIGHTS_FILE).is_file():
        raise ParamError(f"{checkpoint_dir} adapts the base checkpoint {base_dir}, which is gone; if it moved, "
                         "name its new place as init_checkpoint (its weights' SHA-256 must match)")
    if weights_sha256(base_dir) != base["sha256"]:
        raise ParamError(f"the base checkpoint {base_dir} changed since {checkpoint_dir} was written (its weights' "
                         "SHA-256 differs): the adapters fit only the weights they were trained on")
    model = attach_lora(load_checkpoint(base_dir), saved)
    own = adapter_state_dict(model)
    check_fits(own, adapters, str(checkpoint_dir))
    with torch.no_grad():
        for name, tensor in adapters.items():
            own[name].copy_(tensor)
    return model, LoraRun(saved, base)


def checkpoint_config(checkpoint_dir: Path) -> ModelConfig:
    """The architecture of a full checkpoint or of a LoRA checkpoint's base, without loading weights."""
    if is_adapter_checkpoint(checkpoint_dir):
        return ModelConfig.from_dict(adapter_base(checkpoint_dir)["config"],
                                     source=str(live_path(checkpoint_dir) / CFLIB_ADAPTER_FILE))
    return load_config(checkpoint_dir)


def adapter_base(checkpoint_dir: Path) -> dict:
    """A LoRA checkpoint's description of its base (path, SHA-256, config), without reading its tensors."""
    path = live_path(checkpoint_dir) / CFLIB_ADAPTER_FILE
    description = read_json(path, CheckpointError, "adapter description")
    if not isinstance(description, dict) or not isinstance(description.get("base"), dict):
        raise CheckpointError(f"{path}: 'base' must describe the base checkpoint (path, sha256, config)")
    return description["base"]
