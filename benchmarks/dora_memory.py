"""DoRA's folded weight: what autograd keeps for backward, and the time of a layer and of a step, in three forms.

    python benchmarks/dora_memory.py --out outputs/records/dora_memory_cpu.json [--layer-preset tr_hash_200m]
        [--preset smoke] [--rank 8] [--tokens 2048] [--step-tokens 256] [--rounds 5] [--steps-per-block 3]
        [--autocast]

The forms, side by side in one process, on equal weights and inputs:
- `lora`: plain LoRA's effective weight W + s B A;
- `dora_autograd`: DoRA's m * (W + s B A) / ||W + s B A|| (the norm detached) under autograd, as cflib computed it
  before cflib.model.lora.DoraWeight (rebuilt here): the product keeps W + s B A, weight-sized, for m's gradient;
- `dora`: cflib's DoraWeight, whose backward keeps W, A, B and two [out] vectors.

For three linear targets' shapes of `--layer-preset` (one layer, `--tokens` rows of input that takes a gradient)
it counts the bytes autograd keeps from a forward of F.linear(x, effective weight) to its backward
(saved_tensors_hooks; a storage counted once, parameters' own not counted), and times forward + backward,
and the effective weight's own forward + backward (no GEMM: the part the forms differ in); then
it does the same for a training step of the whole `--preset` model (`--step-tokens` tokens) on the fused paths
(all seven linear targets; the bytes per adapted layer are the step's, less plain LoRA's, over the adapted
layers). Times: the median over `--rounds` rounds, the forms in rotating order in each. On a CPU the fused paths
run in Triton's interpreter, whose time dwarfs the weights' arithmetic at smoke size: the step times there prove
the plumbing; the layer times are PyTorch's own.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused paths' kernels, before cflib.ops imports Triton

from cflib.atomic import write_json_atomic  # noqa: E402
from cflib.bench.memory import saved_for_backward  # noqa: E402
from cflib.jobs import record_header  # noqa: E402
from cflib.model.config import preset  # noqa: E402
from cflib.model.decoder import TRMoEModel  # noqa: E402
from cflib.model.fast import use_kernels  # noqa: E402
from cflib.model.lora import (  # noqa: E402
    LINEAR_TARGETS,
    DoraLinear,
    LoraLinear,
    LoraSettings,
    adapter_modules,
    attach_lora,
    dora_factor,
)
from cflib.ops.dispatch import KernelChoice  # noqa: E402
from cflib.ops.sft_loss import SFTLoss  # noqa: E402

FORMS = ("lora", "dora_autograd", "dora")
FUSED = KernelChoice(liger=True, custom=True)


def autograd_effective_weight(self: DoraLinear) -> torch.Tensor:
    """DoRA's effective weight as cflib computed it before DoraWeight: autograd through the product."""
    update = (self.lora_B.weight @ self.lora_A.weight) * self.scale
    return dora_factor(self.weight, update, self.lora_magnitude_vector).unsqueeze(1) * (self.weight + update)


def as_form(module: torch.nn.Module, form: str) -> torch.nn.Module:
    """Every DoRA layer of `module` (or `module` itself) computing its effective weight in `form`."""
    for layer in module.modules():
        if isinstance(layer, DoraLinear) and form == "dora_autograd":
            layer.effective_weight = types.MethodType(autograd_effective_weight, layer)
    return module


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_rounds(steps: dict[str, Callable[[], None]], rounds: int, repeats: int,
                 device: torch.device) -> dict[str, float]:
    """Median seconds per call of each step over `rounds` rounds of `repeats` calls, the order rotating."""
    names, seconds = list(steps), {name: [] for name in steps}
    for name in names:  # warm-up
        steps[name]()
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                steps[name]()
            sync(device)
            seconds[name].append((time.perf_counter() - start) / repeats)
    return {name: statistics.median(values) for name, values in seconds.items()}


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of three of the linear targets."""
    d, s = config.hidden_size, config.shared_intermediate_size
    return {"q_proj": (config.num_attention_heads * config.head_dim, d), "shared_up": (s, d), "shared_down": (d, s)}


def one_layer(form: str, shape: tuple[int, int], args, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    base = torch.nn.Linear(shape[1], shape[0], bias=False, device=device).requires_grad_(False)
    dora = form != "lora"
    layer = (DoraLinear if dora else LoraLinear)(base, LoraSettings(rank=args.rank, alpha=args.rank, dora=dora))
    with torch.no_grad():
        layer.lora_B.weight.normal_(0.0, 0.02)
    return as_form(layer, form)


def layer_results(args, device: torch.device) -> dict:
    results = {}
    for target, shape in layer_shapes(preset(args.layer_preset)).items():
        x = torch.randn(args.tokens, shape[1], device=device, requires_grad=True)
        layers = {form: one_layer(form, shape, args, device) for form in FORMS}

        def forward(layer):
            with torch.autocast(device.type, torch.bfloat16, enabled=args.autocast):
                return F.linear(x, layer.effective_weight())

        kept = {form: saved_for_backward(layer, lambda: forward(layer))[0] for form, layer in layers.items()}
        steps = {form: (lambda layer=layer: forward(layer).float().square().mean().backward())
                 for form, layer in layers.items()}
        grad = torch.randn(shape, device=device)  # the weight's own work: its forward and backward, no GEMM
        weight_steps = {form: (lambda layer=layer: layer.effective_weight().backward(grad))
                        for form, layer in layers.items()}
        times = timed_rounds(steps, args.rounds, args.steps_per_block, device)
        weight_times = timed_rounds(weight_steps, args.rounds, args.steps_per_block, device)
        results[target] = {"out_in": list(shape), "weight_bytes_fp32": shape[0] * shape[1] * 4,
                           "input_bytes": x.numel() * x.element_size(), "saved_bytes": kept,
                           "fwd_bwd_ms": {form: 1e3 * t for form, t in times.items()},
                           "weight_fwd_bwd_ms": {form: 1e3 * t for form, t in weight_times.items()}}
    return results


def adapted_model(form: str, args, device: torch.device) -> TRMoEModel:
    torch.manual_seed(0)
    model = TRMoEModel(preset(args.preset))
    attach_lora(model, LoraSettings(rank=args.rank, alpha=args.rank, dora=form != "lora", targets=LINEAR_TARGETS))
    model.to(device)
    with torch.no_grad():
        for module in adapter_modules(model).values():
            module.lora_B.weight.normal_(0.0, 0.02)
    return as_form(use_kernels(model, FUSED), form)


def step_results(args, device: torch.device) -> dict:
    models = {form: adapted_model(form, args, device) for form in FORMS}
    config = preset(args.preset)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, args.step_tokens // 2), generator=generator).to(device)
    labels = torch.randint(0, config.vocab_size, (2, args.step_tokens // 2), generator=generator).to(device)
    loss_fn = SFTLoss(FUSED)

    def loss(model: TRMoEModel) -> torch.Tensor:
        with torch.autocast(device.type, torch.bfloat16, enabled=args.autocast):
            total, count = loss_fn(model(ids), model.head_weight, labels, 8, True)
        return total / count

    kept = {form: saved_for_backward(model, lambda: loss(model))[0] for form, model in models.items()}
    layers = len(adapter_modules(models["dora"]))
    steps = {form: (lambda model=model: loss(model).backward()) for form, model in models.items()}
    times = timed_rounds(steps, args.rounds, args.steps_per_block, device)
    return {"adapted_layers": layers, "saved_bytes": kept,
            "saved_bytes_per_adapted_layer_beyond_lora": {f: (kept[f] - kept["lora"]) / layers for f in FORMS},
            "step_ms": {form: 1e3 * t for form, t in times.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="benchmarks/dora_memory.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/records/dora_memory.json")
    parser.add_argument("--layer-preset", default="tr_hash_200m", help="the model whose layer shapes are timed")
    parser.add_argument("--preset", default="smoke", help="the model whose step is measured")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048, help="input rows of a layer")
    parser.add_argument("--step-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps-per-block", type=int, default=3)
    parser.add_argument("--autocast", action="store_true", help="BF16 autocast, as a training step on a GPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record = {**record_header("dora_memory", device, params=vars(args)),
              "layers": layer_results(args, device), "step": step_results(args, device)}
    write_json_atomic(Path(args.out), record)
    return record


if __name__ == "__main__":
    main()
