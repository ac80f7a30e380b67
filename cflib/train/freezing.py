"""Frozen module families of a full-parameter run (`frozen_modules`, `frozen_layers`): which weights train.

Each weight of the decoder belongs to one family, read from its published name (docs/formats.md):
`embeddings` (embed_tokens, which is also the tied head: freezing one freezes the other), `attention` (the q, k, v
and o projections), `shared` (the shared SwiGLU's gate, up and down), `experts` (the routed experts' tensors) and
`norms` (every RMSNorm: each layer's two, the attention's QK-norms, the final norm). `frozen_layers` narrows the
layer families to those layers; the final norm counts with the last layer, the embeddings with none (they freeze
whenever named).

The execution plan resolves the frozen weights once, before step 1 (`frozen_plan`, checked against the model:
a layer it lacks, or nothing left to train, stops the run naming the parameter), and `prepare()` freezes them
where the model is built (`freeze`), so every torchrun rank and every resume trains the same weights. A frozen
weight has requires_grad false: no gradient, no optimizer state, no place in an optimizer group, the clipped norm
or DDP's buckets, and its BF16 weight copy is written once (cflib.model.weight_copies).
"""
from __future__ import annotations

import torch
from torch import nn

from cflib.errors import ParamError
from cflib.model.config import ModelConfig
from cflib.model.decoder import EXPERT_TENSORS, TRMoEModel

ATTENTION_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj")
SHARED_WEIGHTS = ("shared_gate", "shared_up", "shared_down")


def family_of(name: str, layers: int) -> tuple[str, int | None]:
    """A decoder parameter's family and layer (None: the embeddings; the final norm: the last layer), from its
    published name; ValueError for a name of no family."""
    if name == "embed_tokens.weight":
        return "embeddings", None
    if name == "norm.weight":
        return "norms", layers - 1
    parts = name.split(".")
    leaf = parts[-2] if parts[-1] == "weight" else parts[-1]
    if parts[0] == "layers" and len(parts) > 2 and parts[1].isdigit():
        if leaf.endswith("norm"):
            return "norms", int(parts[1])
        for family, leaves in (("attention", ATTENTION_WEIGHTS), ("shared", SHARED_WEIGHTS),
                               ("experts", EXPERT_TENSORS)):
            if leaf in leaves:
                return family, int(parts[1])
    raise ValueError(f"parameter {name} belongs to no module family of frozen_modules")


def frozen_names(model: nn.Module, modules: tuple[str, ...], layers: tuple[int, ...] | None) -> list[str]:
    """The names of the parameters that `modules` (in `layers`, None: all) freeze."""
    depth = len(model.layers)
    chosen = []
    for name, _ in model.named_parameters():
        family, layer = family_of(name, depth)
        if family in modules and (layer is None or layers is None or layer in layers):
            chosen.append(name)
    return chosen


def frozen_plan(modules: tuple[str, ...] | None, layers: tuple[int, ...] | None, model: nn.Module) -> dict | None:
    """What the plan records of the frozen weights (None: every weight trains); ParamError where frozen_layers names
    a layer the model lacks, or nothing would be left to train."""
    if modules is None:
        return None
    depth = len(model.layers)
    if layers is not None and max(layers) >= depth:
        raise ParamError(f"frozen_layers names layer {max(layers)}, but the model has {depth} layers (0-{depth - 1})")
    names = set(frozen_names(model, modules, layers))
    sizes = {name: parameter.numel() for name, parameter in model.named_parameters()}
    frozen = sum(sizes[name] for name in names)
    if frozen == sum(sizes.values()):
        raise ParamError(f"frozen_modules {', '.join(modules)}"
                         + (f" in frozen_layers {describe_layers(layers)}" if layers is not None else "")
                         + " freezes every weight of the model: nothing would train; leave a family or a layer out")
    return {"modules": list(modules), "layers": None if layers is None else list(layers),
            "tied_head": "embeddings" in modules, "tensors": len(names), "params": frozen}


def freeze(model: nn.Module, plan: dict | None) -> nn.Module:
    """The weights the plan's frozen_plan names frozen (requires_grad false); the others left as they are."""
    if plan is None:
        return model
    names = set(frozen_names(model, tuple(plan["modules"]), None if plan["layers"] is None else tuple(plan["layers"])))
    for name, parameter in model.named_parameters():
        if name in names:
            parameter.requires_grad_(False)
    return model


def describe_layers(layers: tuple[int, ...] | list[int]) -> str:
    """Layer indices as ranges: 0-7,10."""
    runs: list[list[int]] = []
    for index in sorted(layers):
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def describe_frozen(plan: dict) -> str:
    """The execution plan's words for what stays frozen."""
    layered = [name for name in plan["modules"] if name != "embeddings"]
    layers = plan["layers"]
    where = "" if layers is None else f" in layer{'s' if len(layers) > 1 else ''} {describe_layers(layers)}"
    parts = (["embeddings (and the tied head)"] if plan["tied_head"] else []) + (
        [", ".join(layered) + where] if layered else [])
    return f"frozen {'; '.join(parts)}: {plan['params']:,} parameters in {plan['tensors']} tensors"


def frozen_weights(modules: tuple[str, ...] | None, layers: tuple[int, ...] | None, config: ModelConfig,
                   model: nn.Module | None = None) -> dict | None:
    """What the memory estimate holds of a full-parameter run's weights (cflib.train.distributed.
    training_state_bytes): the parameters that train and those `modules` (in `layers`) freeze, counted as
    frozen_plan counts them on `model`, or where none is built yet on one of `config` built on the meta device (no
    memory); None where every weight trains."""
    if modules is None:
        return None
    if model is None:
        with torch.device("meta"):
            model = TRMoEModel(config)
    frozen = frozen_plan(modules, layers, model)["params"]
    return {"trainable_params": sum(parameter.numel() for parameter in model.parameters()) - frozen,
            "frozen_params": frozen, "frozen_dtype": "float32", "frozen_by": "frozen_modules"}
