"""The optimizers a run may choose (`optimizer`), with weight decay on matrices only, and the learning-rate
schedules (the released one: linear warm-up, then one cosine).

AdamW, the default, runs as torch's fused AdamW, or (cflib_adamw) as cflib's Triton kernel (cflib.ops.adamw): the
same hyperparameters, state and state dict, one launch per parameter group, the BF16 weight copies written as
their masters are updated. The others are torch's own: Adafactor, or Muon on the 2-D weight matrices with AdamW on
every other weight (`MuonWithAdamW`; cflib.train.optimizer_choice says which weights and why).

The routed experts, the LoRA adapters and the token embedding may learn at their own rates
(`expert_lr_multiplier`, `lora_lr_multiplier`, `embedding_lr_multiplier`: lr x multiplier, both for an adapter on
an expert), and under LoRA+ (`lora_plus_ratio`) the B matrices at ratio x the A matrices' rate; each combination
is a parameter group, named, so the record can show every group's learning rate. Every AdamW implementation takes
the same epsilon (`adam_epsilon`).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cflib.model.weight_copies import WeightCopies
from cflib.ops.adamw import (
    BLOCK,
    NUM_WARPS,
    AdamWTables,
    adamw_step_,
    adamw_tables,
    step_coefficients,
    writes_rows,
)
from cflib.ops.dispatch import triton_problem

EPS = 1e-8  # AdamW's epsilon unless adam_epsilon says otherwise: torch's default, and transformers'
TABLES_KEPT = 32  # address tables cached per optimizer: one per group and set of gradient tensors (graph shapes)

# The optimizers `optimizer` names: torch's AdamW (or cflib's kernel of it), torch's Adafactor, torch's Muon (on the
# 2-D matrices, AdamW on the rest: MuonWithAdamW).
OPTIMIZERS = ("adamw", "adafactor", "muon")
# torch's Adafactor steps a tensor by max(eps[1], RMS(tensor)) x min(lr, 1/sqrt(step)) x its clipped update. Its
# default eps[1], 1e-3, makes the step relative to the tensor's RMS: a LoRA B matrix, zero at first, would move by
# 1e-3 x lr, and weight decay (lr x weight_decay a step) would outweigh a step of lr x RMS. eps[1] = 1 makes lr the
# step's size for every tensor of RMS at most 1, as transformers' `optim: adafactor` (relative_step=False,
# scale_parameter=False) reads it; eps[0] None: torch's default (the dtype's machine epsilon).
ADAFACTOR_EPS = (None, 1.0)
# torch's Muon's adjust_lr_fn: each matrix's update scaled to an RMS of 0.2, about an AdamW update's (Moonlight's
# rule), so that one lr serves Muon's part and AdamW's (the embedding, the experts, the norms)
MUON_ADJUST_LR = "match_rms_adamw"
EMBEDDING_PREFIX = "embed_tokens."  # the token embedding (the tied head), or LoRA's trainable rows of it


# The shapes `lr_schedule` names; cosine is the released recipe's.
SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_DECAY_RATIO = 0.1  # wsd's decay: the last tenth of the steps, unless lr_decay_ratio says otherwise


@dataclass(frozen=True)
class LrSchedule:
    """A run's learning-rate schedule, resolved to its steps before step 1 (cflib.train.run.resolve_schedule): the
    factor of lr at each optimizer step. Every schedule warms up linearly to the peak over `warmup_steps`; then
    cosine and linear fall from the peak toward `min_lr_ratio` over the rest of the run, constant stays at the
    peak, and wsd (warmup-stable-decay) stays at the peak until a linear fall over its last `decay_steps`. A fall
    reaches its floor at step `total_steps`, one past the last step taken, as transformers' schedules do: the
    last step still learns (and the first step of a fall runs at the peak). The warm-up is warmup_ratio's share of
    the steps (`warmup_ratio`), or, where warmup_steps is set, those steps (`warmup_ratio` None: unused)."""

    name: str
    total_steps: int
    warmup_steps: int
    decay_steps: int  # the last steps, over which the factor falls to its floor: none for constant
    min_lr_ratio: float = 0.0
    lr_decay_ratio: float | None = None  # wsd's share of the steps that decay, as resolved; None for the others
    warmup_ratio: float | None = None  # the share the warm-up was resolved from; None: warmup_steps set it

    def factor(self, step: int) -> float:
        """The factor of lr at optimizer step `step` (from 0)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        start = self.total_steps - self.decay_steps
        if self.name == "constant" or step < start:
            return 1.0
        span = max(self.decay_steps, 1)
        # The operations in the released cosine's order, so that its factors stay bit-identical.
        if self.name == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * min(step - start, span) / span))
        else:
            shape = 1.0 - min(step - start, span) / span
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape

    def record(self) -> dict:
        """The schedule as the record's `schedule` names it."""
        return {"lr_schedule": self.name, "warmup_steps": self.warmup_steps, "warmup_from": self.warmup_from,
                "warmup_ratio": self.warmup_ratio, "decay_steps": self.decay_steps,
                "min_lr_ratio": self.min_lr_ratio, "lr_decay_ratio": self.lr_decay_ratio}

    @property
    def warmup_from(self) -> str:
        """The parameter the warm-up's steps came from: warmup_steps where it is set (the ratio then unused)."""
        return "warmup_steps" if self.warmup_ratio is None else "warmup_ratio"

    def describe_warmup(self) -> str:
        """The warm-up in words: `3 warm-up`, or `50 warm-up (warmup_steps; warmup_ratio unused)`."""
        unused = " (warmup_steps; warmup_ratio unused)" if self.warmup_ratio is None else ""
        return f"{self.warmup_steps} warm-up{unused}"

    def describe(self) -> str:
        """The schedule after its warm-up, in words: `cosine to 0.1 x lr`, `constant, then linear to 0 x lr over
        the last 3 steps`."""
        if self.name == "constant":
            return "constant"
        floor = f"{self.min_lr_ratio:g} x lr"
        if self.name == "wsd":
            if self.total_steps <= 1:  # a one-step run takes its step at the peak, whatever the schedule
                return "wsd: its one step at the peak"
            return f"wsd: constant, then linear to {floor} over the last {self.decay_steps} steps"
        return f"{self.name} to {floor}"


@dataclass(frozen=True)
class OptimizerSettings:
    """The hyperparameters of the optimizer `optimizer` names (lr and weight_decay every optimizer's; betas and eps
    AdamW's, and under Muon its AdamW part's; muon_momentum Muon's), and the rates of the routed experts, the LoRA
    adapters and the token embedding as multiples of lr."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    expert_lr_multiplier: float = 1.0
    lora_lr_multiplier: float = 1.0
    lora_plus_ratio: float = 1.0  # LoRA+: the B matrices' rate over the A matrices'; 1: off (one group for both)
    eps: float = EPS
    optimizer: str = "adamw"  # one of OPTIMIZERS
    embedding_lr_multiplier: float = 1.0
    muon_momentum: float = 0.95  # Muon's (torch's default)


def steps_with_muon(name: str, dim: int) -> bool:
    """Whether a run under `optimizer: muon` steps this parameter with Muon: a 2-D matrix other than the embedding."""
    return dim == 2 and not name.startswith(EMBEDDING_PREFIX)


def group_optimizer(group: dict) -> str:
    """The optimizer that steps a parameter group: its `optimizer` under Muon, Adafactor's by its keys, or AdamW."""
    return group.get("optimizer") or ("adafactor" if "beta2_decay" in group else "adamw")


def lora_plus_side(name: str, parameter: torch.nn.Parameter) -> str:
    """An adapter parameter's side under LoRA+: `lora_B` for a B matrix and every vector (DoRA's magnitude), as PEFT's
    create_loraplus_optimizer and LoRA+'s reference code group them; `lora_A` for the rest (the A matrices)."""
    return "lora_B" if ".lora_B." in name or parameter.dim() == 1 else "lora_A"


def _group_of(name: str, parameter: torch.nn.Parameter, settings: OptimizerSettings) -> tuple[str, float]:
    """The parameter's group name and learning-rate multiplier."""
    # Norm gains are scale parameters; decaying them toward 0 fights the normalisation.
    parts = ["decay" if parameter.dim() >= 2 else "no_decay"]
    multiplier = 1.0
    if settings.optimizer == "muon" and steps_with_muon(name, parameter.dim()):
        parts.append("muon")
    if name.startswith(EMBEDDING_PREFIX) and settings.embedding_lr_multiplier != 1.0:
        parts.append("embeddings")
        multiplier *= settings.embedding_lr_multiplier
    if ".expert_" in name and settings.expert_lr_multiplier != 1.0:
        parts.append("experts")
        multiplier *= settings.expert_lr_multiplier
    if "lora_" in name and settings.lora_plus_ratio != 1.0:
        side = lora_plus_side(name, parameter)
        parts.append(side)
        multiplier *= settings.lora_lr_multiplier * (settings.lora_plus_ratio if side == "lora_B" else 1.0)
    elif "lora_" in name and settings.lora_lr_multiplier != 1.0:
        parts.append("lora")
        multiplier *= settings.lora_lr_multiplier
    return "+".join(parts), multiplier


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW, its state and state dict unchanged, stepped by cflib's Triton kernel (cflib.ops.adamw): one
    launch per parameter group; a clipping factor (`grad_scale`) and a skip flag (`found_inf`) read on the device,
    as torch's fused step reads them; where `weight_copies` holds a copy of a master, the kernel writes it in
    the same pass (rows of a fused copy), or a copy follows the launch (a transposed expert slice), so no
    refresh follows the step. The gradients are left as they were (torch's clipped step writes them back
    divided by the factor): read after the step, they are unclipped."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float = EPS,
                 block: int = BLOCK, num_warps: int = NUM_WARPS) -> None:
        # fused: the steps live on the parameters' device, and a loaded state dict keeps them there
        super().__init__(groups, lr=lr, betas=betas, eps=eps, fused=True)
        self.launch = {"block": block, "num_warps": num_warps}
        self.weight_copies: WeightCopies | None = None
        self.stepped = False  # read back into the record's kernel path
        self._tables: OrderedDict[tuple, AdamWTables] = OrderedDict()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a state dict of a non-fused AdamW: the device reads the skip flag still
            group["fused"] = True

    def _state(self, parameter: torch.nn.Parameter) -> dict:
        state = self.state[parameter]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=parameter.device)
            state["exp_avg"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(parameter, memory_format=torch.preserve_format)
        elif state["step"].device != parameter.device:  # loaded from a state dict that kept steps on the host
            state["step"] = state["step"].to(parameter.device, torch.float32)
        return state

    def _tables_for(self, params: list[torch.nn.Parameter], states: list[dict],
                    targets: dict[torch.nn.Parameter, torch.Tensor]) -> AdamWTables:
        """The group's address tables, cached by every address they hold (a set per CUDA graph shape's
        gradients), the least recently used dropped first."""
        tensors = [(p, p.grad, s["exp_avg"], s["exp_avg_sq"], targets.get(p)) for p, s in zip(params, states)]
        key = tuple((*(t.data_ptr() for t in row[:4]), row[0].shape,
                     None if row[4] is None else (row[4].data_ptr(), row[4].stride())) for row in tensors)
        if key in self._tables:
            self._tables.move_to_end(key)
        else:
            if len(self._tables) >= TABLES_KEPT:
                self._tables.popitem(last=False)
            self._tables[key] = adamw_tables(*(list(column) for column in zip(*tensors)), **self.launch)
        return self._tables[key]

    def _copy_views(self) -> tuple[dict, list[tuple[torch.nn.Parameter, torch.Tensor]]]:
        """The copies' views the kernel writes (rows), by master; and the others, written after it."""
        targets = self.weight_copies.targets() if self.weight_copies is not None else {}
        rows = {master: view for master, view in targets.items() if writes_rows(view)}
        return rows, [(master, view) for master, view in targets.items() if master not in rows]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("cflib's AdamW takes no closure")
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        rows, rest = self._copy_views()
        updated: set[int] = set()  # ids of the parameters stepped
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("cflib's AdamW has no amsgrad and no maximize")
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            steps = [state["step"] for state in states]
            torch._foreach_add_(steps, 1.0)
            coefficients = step_coefficients(torch.stack(steps), float(group["lr"]), group["betas"])
            adamw_step_(self._tables_for(params, states, rows), coefficients, float(group["lr"]),
                        group["weight_decay"], group["betas"], group["eps"], grad_scale, found_inf)
            if found_inf is not None:  # a skipped step does not count, as in torch's fused AdamW
                torch._foreach_sub_(steps, [found_inf] * len(steps))
            updated.update(map(id, params))
        for master, view in rest:
            if id(master) in updated:
                view.copy_(master)
        self.stepped = True


class MuonWithAdamW(torch.optim.Optimizer):
    """torch's Muon on the groups named `muon`, torch's AdamW (fused with `fused`) on those named `adamw`: one
    Optimizer whose groups and state are the two parts', so the schedule, the clipping, the checkpoints (keyed by
    parameter name) and the record see one optimizer. torch's load_state_dict replaces the groups and the state, so
    each step hands the parts theirs anew."""

    def __init__(self, groups: list[dict], settings: OptimizerSettings, fused: bool = False) -> None:
        chosen = {name: [group for group in groups if group["optimizer"] == name] for name in ("muon", "adamw")}
        self.parts: dict[str, torch.optim.Optimizer] = {}
        if chosen["muon"]:
            self.parts["muon"] = torch.optim.Muon(chosen["muon"], lr=settings.lr, weight_decay=settings.weight_decay,
                                                  momentum=settings.muon_momentum,
                                                  adjust_lr_fn=MUON_ADJUST_LR)
        if chosen["adamw"]:
            self.parts["adamw"] = torch.optim.AdamW(chosen["adamw"], lr=settings.lr, betas=settings.betas,
                                                    eps=settings.eps, fused=fused)
        super().__init__(groups, {"lr": settings.lr})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("cflib's Muon + AdamW takes no closure")
        for name, part in self.parts.items():
            part.param_groups = [group for group in self.param_groups if group["optimizer"] == name]
            part.state = self.state
            part.step()


def cflib_adamw_problem(model: torch.nn.Module, device: torch.device, strategy: str) -> str | None:
    """Why cflib's AdamW kernel cannot step this model's parameters, or None."""
    if strategy == "fsdp":
        return "FSDP shards the parameters"
    problem = triton_problem(device, rocm_opt_in=False)
    if problem is not None:
        return problem
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in trainable}
    if dtypes - {torch.float32}:
        return f"trainable parameters in {sorted(map(str, dtypes))}, not only float32"
    if not all(p.is_contiguous() for p in trainable):
        return "a trainable parameter is not contiguous"
    return None


def optimizer_kernel(optimizer: torch.optim.Optimizer) -> str:
    """What stepped the parameters, read back from the optimizer: cflib's Triton kernel or torch's AdamW, torch's
    Adafactor, or torch's Muon and the AdamW of its other weights (`torch_muon+torch_fused`)."""
    if isinstance(optimizer, TritonAdamW) and optimizer.stepped:
        return "cflib_triton"
    if isinstance(optimizer, torch.optim.Adafactor):
        return "torch_adafactor"
    if isinstance(optimizer, MuonWithAdamW):
        return "+".join([f"torch_{name}" if name == "muon" else optimizer_kernel(part)
                         for name, part in optimizer.parts.items()])
    return "torch_fused" if all(group.get("fused") for group in optimizer.param_groups) else "torch"


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer as a record names it."""
    if isinstance(optimizer, TritonAdamW):
        return "AdamW, cflib's Triton kernel"
    if isinstance(optimizer, torch.optim.Adafactor):
        return "Adafactor (torch)"
    if isinstance(optimizer, MuonWithAdamW):
        return " + ".join("Muon (torch)" if name == "muon" else describe_optimizer(part)
                          for name, part in optimizer.parts.items())
    return f"AdamW fused={optimizer.defaults.get('fused')}"


def parameter_groups(model: torch.nn.Module, settings: OptimizerSettings) -> list[dict]:
    """The model's trainable parameters in named groups, each with its learning rate and weight decay."""
    groups: dict[str, dict] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        group, multiplier = _group_of(name, parameter, settings)
        groups.setdefault(group, {"name": group, "params": [], "lr": settings.lr * multiplier,
                                  "weight_decay": settings.weight_decay if group.startswith("decay") else 0.0})
        if settings.optimizer == "muon":  # the part of MuonWithAdamW that steps the group
            groups[group]["optimizer"] = "muon" if "muon" in group.split("+") else "adamw"
        groups[group]["params"].append(parameter)
    return list(groups.values())


def make_optimizer(model: torch.nn.Module, settings: OptimizerSettings, fused: bool = False,
                   triton: bool = False) -> torch.optim.Optimizer:
    """The optimizer settings.optimizer names over the model's trainable parameters in named groups: AdamW,
    torch's (its fused kernel with `fused`) or with `triton` cflib's kernel (the execution plan says which:
    cflib.train.execution); torch's Adafactor, its lr the step's size (ADAFACTOR_EPS); or torch's Muon with
    torch's AdamW (fused with `fused`) on the weights Muon does not step."""
    groups = parameter_groups(model, settings)
    if settings.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=settings.lr, weight_decay=settings.weight_decay, eps=ADAFACTOR_EPS)
    if settings.optimizer == "muon":
        return MuonWithAdamW(groups, settings, fused=fused)
    if triton:
        return TritonAdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps)
    return torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps, fused=fused)


def _update_settings(group: dict) -> dict:
    """What a group's update reads besides its rate and decay: AdamW's epsilon, Muon's momentum and lr adjustment,
    Adafactor's decay of its second moment's rate; and the optimizer that steps it."""
    name = group_optimizer(group)
    own = ({"momentum": group["momentum"], "adjust_lr_fn": group["adjust_lr_fn"]} if name == "muon" else
           {"beta2_decay": group["beta2_decay"]} if name == "adafactor" else {"eps": group["eps"]})
    return {**own, "optimizer": name}


def describe_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's name, size and peak learning rate, and the optimizer that steps it, for the record."""
    return [{"name": group.get("name", str(index)), "tensors": len(group["params"]),
             "params": sum(p.numel() for p in group["params"]), "lr": group.get("initial_lr", group["lr"]),
             "weight_decay": group["weight_decay"], **_update_settings(group)}
            for index, group in enumerate(optimizer.param_groups)]


def clip_in_fused_step(optimizer: torch.optim.Optimizer, parameters: list[torch.nn.Parameter],
                       max_norm: float | None) -> torch.Tensor:
    """The gradients' total norm, their clipping left to the fused AdamW's next step: it divides each gradient
    by `grad_scale` as it reads it (GradScaler's unscaling), so no separate pass rewrites every gradient, not
    even to multiply by 1 when unclipped. The factor is clip_grad_norm_'s: max(1, (norm + 1e-6) / max_norm)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
    optimizer.grad_scale = None if max_norm is None else torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    return norm

