"""What the optimizer a run chooses (`optimizer`, cflib.train.optim) steps, keeps in memory and cannot serve.

AdamW (the default) and torch's Adafactor step every weight that trains. Under `optimizer: muon` torch's Muon steps
the 2-D weight matrices alone, for Muon orthogonalises each update of a matrix (Newton-Schulz), and its authors
(Keller Jordan's post, Moonlight's "Muon is Scalable for LLM Training") apply it to the hidden layers' linear maps.
Every other weight steps AdamW, as theirs do: the token embedding (and the tied head: rows looked up, and the output
layer), the norms' gains (vectors), and the routed experts' tensors, [E, in, out] stacks of one matrix per expert:
torch's Muon takes 2-D parameters only, and the stack orthogonalised as one matrix would couple the experts' updates
(Moonlight orthogonalises each expert's own matrix, which torch's Muon cannot do for a slice of a parameter).

The execution plan records which weights each part steps (`optimizer_plan`) and refuses, before step 1, what the
choice cannot serve; the memory estimate counts the chosen optimizer's state (`optimizer_memory`).
"""
from __future__ import annotations

import math

import torch

from cflib.errors import ParamError
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.model.lora import attach_lora
from cflib.train.freezing import family_of, frozen_names
from cflib.train.optim import EMBEDDING_PREFIX, steps_with_muon
from cflib.train.params import TrainParams

# What each optimizer keeps per trainable parameter beyond its fp32 weight and gradient: AdamW two fp32 moments,
# Muon one fp32 momentum buffer (its matrices), Adafactor a factored second moment (state_bytes).
ADAMW_STATE_BYTES, MUON_STATE_BYTES = 8, 4
NAMES = {"adamw": "AdamW", "adafactor": "Adafactor", "muon": "Muon + AdamW"}


# --- what it keeps in memory ------------------------------------------------------------------------------------

def state_bytes(optimizer: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """The bytes of `optimizer`'s state over trainable parameters of these names and shapes (fp32): AdamW 8 B/param;
    Muon 4 B/param of its matrices, AdamW's 8 of the rest; Adafactor 4 B x (rows + columns) per matrix of a tensor
    of two or more dimensions (its factored second moment: a row and a column mean), 4 B/param of a vector."""
    total = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if optimizer == "adafactor":
            total += 4 * (math.prod(shape[:-2]) * (shape[-2] + shape[-1]) if len(shape) >= 2 else numel)
        elif optimizer == "muon" and steps_with_muon(name, len(shape)):
            total += MUON_STATE_BYTES * numel
        else:
            total += ADAMW_STATE_BYTES * numel
    return total


def trainable_shapes(params: TrainParams, config: ModelConfig, model: torch.nn.Module | None = None
                     ) -> dict[str, tuple[int, ...]]:
    """The shapes of the parameters a run trains, by name: on `model` (its adapters attached, frozen_modules not
    yet applied), or where none is built yet on one of `config` built on the meta device (no memory)."""
    if model is None:
        with torch.device("meta"):
            model = TRMoEModel(config)
            settings = params.lora_settings()
            if settings is not None:
                attach_lora(model, settings)
    return {name: tuple(parameter.shape) for name, parameter in trained(params, model).items()}


def optimizer_memory(params: TrainParams, config: ModelConfig, model: torch.nn.Module | None = None) -> dict | None:
    """What the memory estimate counts of an optimizer other than AdamW (cflib.train.distributed.
    training_state_bytes): its name, its state's bytes and the rule; None for AdamW (16 B/param, as before)."""
    if params.optimizer == "adamw":
        return None
    shapes = trainable_shapes(params, config, model)
    state = state_bytes(params.optimizer, shapes)
    if params.optimizer == "muon":
        matrices = sum(math.prod(shape) for name, shape in shapes.items() if steps_with_muon(name, len(shape)))
        rule = (f"Muon's momentum 4 B/param ({matrices:,} in 2-D matrices), AdamW's moments 8 B/param on the rest "
                f"({sum(math.prod(shape) for shape in shapes.values()) - matrices:,})")
    else:
        rule = "Adafactor's factored second moment, 4 B x (rows + columns) per matrix, 4 B/param of vectors"
    return {"name": NAMES[params.optimizer], "state_bytes": state, "rule": f"{rule}: {state:,} B"}


# --- the plan ---------------------------------------------------------------------------------------------------

def trained(params: TrainParams, model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters of `model` a run of `params` trains, by name: those that take gradients (a LoRA run's
    adapters) but those frozen_modules freezes, which the plan freezes only after it is made."""
    frozen = set(frozen_names(model, params.frozen_modules, params.frozen_layers)) if params.frozen_modules else set()
    return {name: parameter for name, parameter in model.named_parameters()
            if parameter.requires_grad and name not in frozen}


def _family(name: str, depth: int) -> str:
    """A trainable parameter's family for the plan: a module family of frozen_modules, or LoRA's adapters."""
    if name.startswith(EMBEDDING_PREFIX):
        return "embeddings"
    try:
        return family_of(name, depth)[0]
    except ValueError:
        return "adapters"


def _part(names: list[str], sizes: dict[str, int], depth: int) -> dict:
    return {"families": sorted({_family(name, depth) for name in names}), "tensors": len(names),
            "params": sum(sizes[name] for name in names)}


def optimizer_plan(params: TrainParams, model: TRMoEModel, strategy: str) -> dict:
    """Which optimizer steps which of the weights that train (module families, tensors, parameters) and why, as the
    execution plan records it; ParamError for a run it cannot serve."""
    trainable = trained(params, model)
    _check_choice(params, trainable, strategy)
    sizes, depth = {name: parameter.numel() for name, parameter in trainable.items()}, len(model.layers)
    if params.optimizer != "muon":
        return {"optimizer": params.optimizer, "parts": {params.optimizer: _part(list(trainable), sizes, depth)}}
    muon = [name for name, parameter in trainable.items() if steps_with_muon(name, parameter.dim())]
    rest = [name for name in trainable if name not in muon]
    return {"optimizer": "muon", "parts": {"muon": _part(muon, sizes, depth), "adamw": _part(rest, sizes, depth)},
            "why": "torch's Muon steps 2-D matrices: the embedding (the tied head), the norms' gains and the routed "
                   "experts' [E, in, out] stacks (one matrix per expert, which Muon would orthogonalise as one) "
                   "step AdamW, as Muon's authors and Moonlight step theirs"}


def _check_choice(params: TrainParams, trainable: dict[str, torch.nn.Parameter], strategy: str) -> None:
    """ParamError where the chosen optimizer, or embedding_lr_multiplier, cannot serve the weights that train."""
    if params.optimizer == "adafactor" and strategy == "fsdp":
        raise ParamError("optimizer: adafactor cannot step FSDP's sharded weights (torch's Adafactor updates its "
                         "factored second moment in place, which DTensor shards refuse); choose strategy: ddp, or "
                         "optimizer: adamw or muon under FSDP")
    if params.optimizer == "muon" and not any(steps_with_muon(n, p.dim()) for n, p in trainable.items()):
        raise ParamError("optimizer: muon, but no weight that trains is a 2-D matrix Muon steps (the embedding, the "
                         "norms and the routed experts step AdamW): choose optimizer: adamw, or leave attention or "
                         "shared out of frozen_modules")
    # A full-parameter run trains the embedding: TrainParams refuses the multiplier with frozen_modules freezing it.
    if params.embedding_lr_multiplier != 1.0 and not any(name.startswith(EMBEDDING_PREFIX) for name in trainable):
        raise ParamError(f"embedding_lr_multiplier {params.embedding_lr_multiplier:g} is set, but the token embedding "
                         "does not train: LoRA trains adapters on a frozen embedding (lora_trainable_tokens names "
                         "embedding rows that train, at lr x embedding_lr_multiplier); it would do nothing, remove it")


def describe_choice(choice: dict | None, implementation: str) -> str:
    """The plan's words for the optimizer: `AdamW torch_fused`, `Adafactor torch`, `Muon (attention, shared) +
    AdamW torch (embeddings, experts, norms)`."""
    if choice is None or choice["optimizer"] == "adamw":
        return f"AdamW {implementation}"
    if choice["optimizer"] == "adafactor":
        return "Adafactor torch"
    parts = choice["parts"]
    return (f"Muon ({', '.join(parts['muon']['families'])})"
            + (f" + AdamW {implementation} ({', '.join(parts['adamw']['families'])})" if parts["adamw"]["tensors"]
               else ""))


def weight_copies_writer(optimizer: str, implementation: str, copies: bool) -> str | None:
    """Who writes the BF16 weight copies after each step: cflib's AdamW kernel in its pass, or a refresh from the
    masters after torch's step (any optimizer, this one's too); None where the run reads none."""
    if not copies:
        return None
    if implementation == "cflib_adamw":
        return "cflib's AdamW kernel, as it steps each master"
    return f"refreshed from the masters after each step of torch's {NAMES[optimizer]}"
