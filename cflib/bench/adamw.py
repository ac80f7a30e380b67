"""The optimizer step at the 200M size: torch's fused AdamW (then the weight copies' refresh) against cflib's kernel
(GPU).

Side by side in one run, over the production model's parameters (201,194,368 FP32, every fused weight copied to
BF16, the tied head too) with random gradients, each step clipped on the device as the trainer clips it:
- torch_fused: torch's fused AdamW alone, as a run without weight copies steps;
- torch_fused_refresh: the same, then `WeightCopies.refresh()`, as a run with the copies and cflib_adamw: false
  steps;
- cflib_b{BLOCK}_w{WARPS}: cflib.ops.adamw, which writes the copies in the same pass, at several launch sizes.
Each is timed over CUDA events (median wall time, which may be the host's launch time) and by the sum of its
kernels' GPU time (what it costs inside a training step), beside the bytes it has to move and the rate that
makes. The first cflib step is compared with torch's from the same state: the largest relative difference of
the weights, and whether every copy is the BF16 cast of its updated master.

    python -m cflib.bench.adamw --out outputs/records/adamw_200m_h200.json
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from cflib.atomic import write_json_atomic
from cflib.jobs import error_line, record_header
from cflib.model.config import preset
from cflib.model.fast import attach_weight_copies, build_model
from cflib.ops.dispatch import KernelChoice
from cflib.train.optim import TritonAdamW, clip_in_fused_step, parameter_groups
from cflib.train.params import TrainParams
from cflib.train.step import adamw_settings

LAUNCHES = ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16))
RECIPE = TrainParams.from_dict({"lr": 2e-5})  # the released lr; AdamW's betas and weight decay as defaulted


def _timed(step: Callable[[], None], rep_ms: int) -> float:
    from triton.testing import do_bench
    return do_bench(step, warmup=20, rep=rep_ms, return_mode="median")


def _gpu_ms(step: Callable[[], None], steps: int = 5) -> float:
    """The GPU time of one step, its kernels' sum under torch.profiler: what it costs inside a training step,
    where the host has queued it during the backward (wall time here may be the host's launch time)."""
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()) / steps / 1e3


class _Setting:
    """The 200M model's parameters with gradients, its weight copies written, and one optimizer of each kind."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        self.model = build_model(preset("tr_hash_200m"), KernelChoice(liger=True, custom=True)).to(device)
        self.copies = attach_weight_copies(self.model, head=True)
        self.copies.refresh()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        for parameter in self.params:
            parameter.grad = torch.randn_like(parameter) * 1e-3
        self.copied = sum(master.numel() for master in self.copies.targets())

    def optimizer(self, triton: bool, **launch: int) -> torch.optim.AdamW:
        """The trainer's groups (weight decay on matrices) at the release recipe's settings."""
        groups = parameter_groups(self.model, adamw_settings(RECIPE))
        betas = (RECIPE.beta1, RECIPE.beta2)
        if triton:
            optimizer = TritonAdamW(groups, lr=RECIPE.lr, betas=betas, **launch)
            optimizer.weight_copies = self.copies
            return optimizer
        return torch.optim.AdamW(groups, lr=RECIPE.lr, betas=betas, fused=True)

    def step(self, optimizer: torch.optim.AdamW, refresh: bool = False) -> Callable[[], None]:
        def run() -> None:
            clip_in_fused_step(optimizer, self.params, 1.0)
            optimizer.found_inf = torch.zeros((), device=self.params[0].device)
            optimizer.step()
            if refresh:
                self.copies.refresh()
        return run


def _agreement(setting: _Setting) -> dict:
    """One step of each from the same state: the weights' largest relative difference; the copies' exactness."""
    start = [p.detach().clone() for p in setting.params]
    grads = [p.grad.clone() for p in setting.params]  # torch's clipped step writes the divided gradients back
    torch_opt, triton_opt = setting.optimizer(False), setting.optimizer(True)
    setting.step(torch_opt)()
    after_torch = [p.detach().clone() for p in setting.params]
    with torch.no_grad():
        for p, value, grad in zip(setting.params, start, grads):
            p.copy_(value)
            p.grad.copy_(grad)
    setting.copies.refresh()
    setting.step(triton_opt)()
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for a, b in zip(setting.params, after_torch))
    exact = all(torch.equal(view, master.detach().to(view.dtype)) for master, view in setting.copies.targets().items())
    return {"max_relative_weight_difference": worst, "copies_are_the_cast": exact}


def measure(rep_ms: int) -> dict:
    device = torch.device("cuda")
    setting = _Setting(device)
    n, copied = sum(p.numel() for p in setting.params), setting.copied
    rows = {}
    variants: list[tuple[str, Callable[[], Callable[[], None]], int]] = [
        ("torch_fused", lambda: setting.step(setting.optimizer(False)), 32 * n),
        ("torch_fused_refresh", lambda: setting.step(setting.optimizer(False), refresh=True), 32 * n + 6 * copied),
    ]
    for block, warps in LAUNCHES:
        variants.append((f"cflib_b{block}_w{warps}", lambda block=block, warps=warps: setting.step(
            setting.optimizer(True, block=block, num_warps=warps)), 28 * n + 2 * copied))
    _timed(setting.step(setting.optimizer(False)), rep_ms)  # the clocks up before the first timed variant
    for name, make, moved in variants:
        try:
            step = make()
            ms, gpu_ms = _timed(step, rep_ms), _gpu_ms(step)
            rows[name] = {"ms": ms, "gpu_ms": gpu_ms, "bytes_moved": moved, "gb_per_s_gpu": moved / gpu_ms / 1e6}
        except Exception as err:  # one variant failing leaves the others measured
            rows[name] = {"error": error_line(err)}
    torch.cuda.synchronize()
    return {"parameters": n, "copied_parameters": copied, "variants": rows, "agreement": _agreement(setting),
            "bytes_note": "torch's fused step with a clipping factor reads and writes p, g, m, v (32 B a parameter); "
                          "a refresh reads each copied master and writes its copy (6 B); cflib's kernel reads p, g, "
                          "m, v and writes p, m, v and the copy (28 B + 2 B a copied parameter)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the record's path (JSON)")
    parser.add_argument("--rep-ms", type=int, default=300, help="milliseconds of timed repetitions per variant")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark measures a GPU; none is available")
    record = {**record_header("adamw_200m", torch.device("cuda")), **measure(args.rep_ms)}
    write_json_atomic(args.out, record)
    for name, row in record["variants"].items():
        print(f"{name:24s} " + (f"{row['ms']:.3f} ms wall  {row['gpu_ms']:.3f} ms GPU  {row['gb_per_s_gpu']:,.0f} GB/s"
                                if "ms" in row else row["error"]))
    print(record["agreement"])


if __name__ == "__main__":
    main()
