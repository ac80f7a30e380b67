"""Checkpoints in the public layout: `config.json` + `model.safetensors`.

Weights are copied name by name with shape checks. Every checkpoint written
also carries the derived buffers the published adapter needs (cflib.model.derived);
a checkpoint read may lack them, and where it has them they must agree with its
route tables. Optimizer and scheduler state, when saved, go beside the weights
as tensors and plain data, loaded with `weights_only=True`: never pickled code.
"""
from __future__ import annotations

import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from cflib.atomic import atomic_directory, follow_umask, live_path
from cflib.jsonio import read_json
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.model.derived import DERIVED_SUFFIXES, INV_FREQ, derived_buffers, derived_disagreement

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAINER_STATE_FILE = "trainer_state.pt"
# Where a run stood (step, epoch, ...): small, so finding the newest checkpoint reads no tensors.
PROGRESS_FILE = "trainer_progress.json"
CURRICULUM_FILE = "curriculum.json"  # a curriculum's folder (cflib.train.curriculum_run): its stages are runs


class CheckpointError(ValueError):
    """A checkpoint that does not match the public layout; the message names the tensor."""


# Weights are stored in float32 or bfloat16. FP16's 10-bit mantissa cannot hold the rope frequencies nor the weights'
# range, and an integer tensor where a weight belongs is no weight: each is refused by name, before the
# derived-buffer check would blame rope_theta for the rounding or a cast would hide it.
WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


def non_finite_tensor(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding NaN or inf, with how many; None when all are finite."""
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.dtype.is_floating_point and tensor.numel():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                return f"{name!r} ({bad} of {tensor.numel()} values are NaN or inf)"
    return None


def save_checkpoint(model: TRMoEModel, path: str | Path, trainer_state: dict[str, Any] | None = None,
                    weights: dict[str, torch.Tensor] | None = None, progress: dict[str, Any] | None = None,
                    config_extra: dict[str, Any] | None = None) -> Path:
    """Write weights with their derived buffers (and optionally optimizer/scheduler state and progress) atomically.

    The single writer of checkpoints. `weights` replaces `model.state_dict()`
    where the model is sharded and its full weights were gathered beforehand.
    `config_extra` adds keys to config.json after the model's own (a Hub bundle's).
    """
    weights = model.state_dict() if weights is None else weights
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights.items()}
    tensors = {**tensors, **checked_derived_buffers(model.config, tensors, "weights to save")}
    bad = non_finite_tensor(tensors)
    if bad:  # whatever nan_patience allowed, a run never publishes weights that cannot be trained on
        raise CheckpointError(f"{path}: not written: tensor {bad}; the earlier checkpoints are unchanged")
    config = {**model.config.to_dict(), **(config_extra or {})}
    with atomic_directory(path) as staging:
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        follow_umask(staging / WEIGHTS_FILE)
        if trainer_state is not None:
            save_trainer_state(trainer_state, staging / TRAINER_STATE_FILE)
        if progress is not None:
            (staging / PROGRESS_FILE).write_text(json.dumps(progress, indent=2) + "\n")
    return Path(path)


def save_trainer_state(state: dict[str, Any], file: Path) -> None:
    """torch.save through a Python file: a full disk then surfaces as the OSError it is (ENOSPC, kept as the
    cause of torch's RuntimeError), not only as torch's own "unexpected pos" message."""
    with open(file, "wb") as handle:
        torch.save(state, handle)


def load_config(path: str | Path) -> ModelConfig:
    path = live_path(path)
    if not (path / CONFIG_FILE).exists() and (path / "checkpoints").is_dir():
        chosen = run_checkpoint(path / "checkpoints")
        raise CheckpointError(f"{path}: a run folder, not a checkpoint ({CONFIG_FILE} + {WEIGHTS_FILE}): name one "
                              f"of its checkpoints, e.g. {chosen[0] if chosen else path / 'checkpoints' / 'best'}")
    return ModelConfig.from_json_file(path / CONFIG_FILE)


def holds_model(folder: Path) -> bool:
    """Whether `folder` is a full model's checkpoint (its config and weights)."""
    return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()


def run_checkpoint(checkpoints: Path, holds: Callable[[Path], bool] = holds_model) -> tuple[Path, str] | None:
    """The checkpoint a run's checkpoints/ folder stands for, and why: its best, else its last, else its newest
    epoch-N, else its newest step-N (each found under its retired name where a kill cut its replacement
    between two renames: cflib.atomic.live_path); None when none `holds` what is asked (a full model by
    default; a LoRA run's checkpoints hold adapters: cflib.export.peft)."""
    if not checkpoints.is_dir():
        return None
    best, last = live_path(checkpoints / "best"), live_path(checkpoints / "last")
    if holds(best):
        return best, "the run's best evaluation loss"
    if holds(last):
        return last, "no best checkpoint; the run's final weights"
    for kind in ("epoch", "step"):
        numbered = [(int(match.group(1)), folder) for folder in checkpoints.iterdir()
                    if (match := re.fullmatch(rf"{kind}-(\d+)", folder.name)) and holds(folder)]
        if numbered:
            return max(numbered)[1], f"no best or last checkpoint; the newest {kind} checkpoint"
    return None


def trained_folder(path: Path) -> Path:
    """The run folder `path` stands for: a curriculum's folder (its curriculum.json and stages/) stands for its last
    stage that saved a checkpoint, in the curriculum's order (whose checkpoints the next stage would start from);
    any other folder for itself."""
    written = path / CURRICULUM_FILE
    if not written.is_file():
        return path
    document = read_json(written, CheckpointError, "curriculum file")
    stages = document.get("stages") if isinstance(document, dict) else None
    names = [stage.get("name") for stage in stages if isinstance(stage, dict)] if isinstance(stages, list) else []
    for name in reversed(names):  # a stage killed before its first save has no checkpoint to stand for it
        checkpoints = path / "stages" / str(name) / "checkpoints"
        if isinstance(name, str) and "/" not in name and name not in (".", "..") and checkpoints.is_dir() and \
                any(entry.is_dir() and not entry.name.startswith(".") for entry in checkpoints.iterdir()):
            return path / "stages" / name
    raise CheckpointError(f"{path}: a curriculum's folder whose stages saved no checkpoint yet (stages/<name>/)")


def checkpoint_in(path: Path, holds: Callable[[Path], bool] = holds_model) -> Path | None:
    """`path` itself where it `holds` a checkpoint, else the checkpoint its run folder (a curriculum's: its last
    stage's, trained_folder) stands for (run_checkpoint), else None. A folder a kill left aside is taken under its
    retired name (live_path)."""
    path = live_path(path)
    if holds(path):
        return path
    chosen = run_checkpoint(trained_folder(path) / "checkpoints", holds)
    return chosen[0] if chosen is not None else None


def derived_names(config: ModelConfig) -> set[str]:
    return {f"layers.{i}.{suffix}" for i in range(config.num_hidden_layers) for suffix in DERIVED_SUFFIXES}


def checked_derived_buffers(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str
                            ) -> dict[str, torch.Tensor]:
    """The derived buffers the route tables in `tensors` give; any `tensors` already holds must agree."""
    try:
        derived = derived_buffers(config, tensors)
    except (KeyError, ValueError) as err:  # a missing or out-of-range route table
        raise CheckpointError(f"{source}: {err}") from None
    for name in sorted(derived.keys() & tensors.keys()):
        problem = derived_disagreement(config, name, tensors[name], tensors)
        if problem:
            raise CheckpointError(f"{source}: {problem}")
    return derived


def check_layer_count(config: ModelConfig, tensors: dict[str, torch.Tensor], source: str) -> None:
    """config.json may not name more layers than the weights hold (counted from the tensor names alone): a config
    of a million layers is refused here, before a model of it, or its skeleton, is built."""
    held = {name.split(".", 2)[1] for name in tensors if name.startswith("layers.")}
    if config.num_hidden_layers > len(held):
        raise CheckpointError(f"{source}: config.json says num_hidden_layers {config.num_hidden_layers}, but the "
                              f"weights hold {len(held)} layer(s)")


def check_tensors(expected: dict[str, torch.Tensor], config: ModelConfig, tensors: dict[str, torch.Tensor],
                  source: str) -> None:
    """Every name, dtype and shape of `tensors` against `expected` (a model's state dict, on the meta device
    or not), and any derived buffer against its route table."""
    derived = derived_names(config)
    unknown = sorted(name for name in tensors if name not in expected and name not in derived)
    if unknown:
        raise CheckpointError(f"{source}: unexpected tensor {unknown[0]!r}"
                              + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    missing = sorted(name for name in expected if name not in tensors)
    if missing:
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, tensor in sorted(tensors.items()):
        wanted = expected[name].dtype if name in expected else torch.float32 if name.endswith(INV_FREQ) else None
        if wanted is not None and wanted.is_floating_point and tensor.dtype not in WEIGHT_DTYPES:
            raise CheckpointError(f"{source}: tensor {name!r} is stored as {tensor.dtype}; cflib reads float32 or "
                                  "bfloat16 checkpoints (convert the weights, e.g. tensor.float(), and save again)")
    bad = non_finite_tensor(tensors)
    if bad:
        raise CheckpointError(f"{source}: tensor {bad}; training from it would make every loss non-finite")
    for name, target in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {list(tensor.shape)}, "
                                  f"the config needs {list(target.shape)}")
        if name.endswith("route_table"):
            if tensor.dtype.is_floating_point:
                raise CheckpointError(f"{source}: tensor {name!r} must be integer, got {tensor.dtype}")
            num_experts = config.num_experts
            if tensor.numel() and (tensor.min() < 0 or tensor.max() >= num_experts):
                raise CheckpointError(f"{source}: tensor {name!r} routes to experts outside "
                                      f"[0, {num_experts})")
    checked_derived_buffers(config, tensors, source)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> TRMoEModel:
    """Build the model from config.json and load its weights; the loaded route tables are kept. The weights are
    checked against the config (layer count, then every name and shape on a skeleton that holds no memory)
    before a model is built, so memory and time follow the checkpoint's size, not what its config claims."""
    path = live_path(path)  # a replacement killed between its renames left the previous folder aside
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    config = load_config(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: missing")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({err})") from None
    check_layer_count(config, tensors, str(weights))
    with torch.device("meta"):
        skeleton = TRMoEModel(config, build_routes=False)
    check_tensors(skeleton.state_dict(), config, tensors, str(weights))
    model = TRMoEModel(config, build_routes=False)
    with torch.no_grad():  # everything passed: copied by name, each into its own dtype
        for name, target in model.state_dict().items():
            target.copy_(tensors[name].to(target.dtype))
    return model.to(device=device, dtype=dtype)


def load_trainer_state(path: str | Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Optimizer/scheduler state saved beside a checkpoint (tensors and plain data only), holding `required`."""
    state_file = live_path(path) / TRAINER_STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{state_file}: missing; only checkpoints saved with optimizer state "
                              "(save_every_steps, or save_optimizer_state: true) can be resumed")
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch's own message would suggest loading it with code: never
        raise CheckpointError(f"{state_file}: refused: it holds Python objects other than tensors and plain data, "
                              "which cflib never loads (they can run code); resume from a checkpoint cflib wrote "
                              "(resume: PATH)") from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as err:
        detail = str(err).split("\n")[0][:160] if "weights_only" not in str(err) else "not tensors and plain data"
        raise CheckpointError(f"{state_file}: not a readable trainer state (truncated or corrupt: "
                              f"{type(err).__name__}: {detail}); resume from another checkpoint "
                              "(resume: PATH)") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{state_file}: a trainer state is a mapping, got {type(state).__name__}")
    missing = [key for key in required if key not in state]
    if missing:
        raise CheckpointError(f"{state_file}: trainer state lacks {missing[0]!r}; resume from another checkpoint "
                              "(resume: PATH)")
    return state


def checkpoint_step(folder: Path) -> int | None:
    """The optimizer step a training run saved `folder` at (its progress file), or None where it has none."""
    progress = folder / PROGRESS_FILE
    if not progress.is_file():
        return None
    saved = read_json(progress, CheckpointError, "progress file")
    if not isinstance(saved, dict) or isinstance(saved.get("step"), bool) or not isinstance(saved.get("step"), int):
        raise CheckpointError(f"{progress}: unreadable progress file (no integer 'step')")
    return saved["step"]


def latest_resumable(checkpoints_dir: str | Path) -> Path:
    """The checkpoint of the furthest step that carries optimizer state."""
    checkpoints_dir = Path(checkpoints_dir)
    candidates = []
    entries = list(checkpoints_dir.iterdir()) if checkpoints_dir.is_dir() else []
    # Dot-folders are unfinished or retired saves (cflib.atomic): a resume point only where a replacement was
    # interrupted between its renames, leaving the previous folder aside (live_path finds it).
    names = {f.name for f in entries if not f.name.startswith(".")}
    names |= {f.name[1:].rsplit(".old-", 1)[0] for f in entries if f.name.startswith(".") and ".old-" in f.name}
    for folder in (live_path(checkpoints_dir / name) for name in sorted(names)):
        step = checkpoint_step(folder)
        if step is None or not (folder / TRAINER_STATE_FILE).is_file():
            continue
        candidates.append((step, folder.name, folder))
    if not candidates and not checkpoints_dir.parent.is_dir():
        raise CheckpointError(f"{checkpoints_dir.parent} does not exist: resume: latest continues a run in its "
                              "out_dir; check the path, or start a new run without resume")
    if not candidates:
        raise CheckpointError(f"{checkpoints_dir}: no checkpoint with optimizer state to resume from "
                              "(save_every_steps, or save_optimizer_state: true, makes them)")
    return max(candidates)[2]
