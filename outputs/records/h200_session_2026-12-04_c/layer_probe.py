"""One TR-MoE block of the 200M model through the SwiGLU GEMMs, forward + backward, at micro-batch 16 and 48 x 2,048
tokens on the H200: the experts' route scales in the GEMMs' epilogues (cflib.ops.quack_epilogues, A) against the
scale kernel beside quack's plain SwiGLU GEMMs and cflib's backward kernel (B), each timed over sustained windows at
the board's power limit, interleaved; the backward GEMM's tile swept; both paths' outputs and gradients compared.

    python layer_probe.py OUT_JSON
"""
import json
import statistics
import sys
import time

import torch

from cflib.model.config import PRESETS
from cflib.model.decoder import TRMoEEngine
from cflib.ops import gemm
from cflib.ops.trmoe import GatedSwiGLUDown, fused_weights, interleave_gate_up, kernel_layout

device = torch.device("cuda")
config = PRESETS["tr_hash_200m"]
torch.manual_seed(0)
engine = TRMoEEngine(config).to(device)
layout = kernel_layout(engine)
gate_up_w, down_w = fused_weights(engine)
gate_up = (torch.randn_like(interleave_gate_up(gate_up_w)) * 0.03).bfloat16()
down = (torch.randn_like(down_w) * 0.02).bfloat16()
gate_up.requires_grad_()
down.requires_grad_()
gemms = gemm.step_gemms(True)


def power():
    return {"watts": torch.cuda.power_draw(device) / 1000, "mhz": torch.cuda.clock_rate(device)}


def step(x, ids, grad):
    out = GatedSwiGLUDown.apply(x, ids, engine.route_table, gate_up, down, layout, gemms, None)
    out.backward(grad)
    return out


def results(x, ids, grad, epilogue):
    GatedSwiGLUDown.scale_in_epilogue = epilogue
    for t in (x, gate_up, down):
        t.grad = None
    out = step(x, ids, grad)
    return [out.float(), x.grad.float(), gate_up.grad.float(), down.grad.float()]


def window(run, ms):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    t0 = time.perf_counter()
    start.record()
    while (time.perf_counter() - t0) * 1000 < ms:
        run()
        calls += 1
        if calls % 4 == 0:
            torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


record = {"layout": layout, "dgated_tile_default": gemm.DGATED_TILE, "shapes": {}}
for micro in (16, 48):
    rows = micro * 2048
    x = (torch.randn(rows, config.hidden_size, device=device) * 0.5).bfloat16().requires_grad_()
    ids = torch.randint(0, config.vocab_size, (rows,), device=device)
    grad = (torch.randn(rows, config.hidden_size, device=device) * 0.01).bfloat16()
    new, old = results(x, ids, grad, True), results(x, ids, grad, False)
    agreement = [float((a - b).norm() / b.norm()) for a, b in zip(new, old)]
    entry = {"agreement_out_dx_dgateup_ddown": agreement}
    print(micro, "agreement", agreement, flush=True)

    def run(epilogue):
        GatedSwiGLUDown.scale_in_epilogue = epilogue
        for t in (x, gate_up, down):
            t.grad = None
        step(x, ids, grad)

    times = {"epilogue": [], "scale_kernel": []}
    window(lambda: run(False), 1000)  # to the power limit
    for _ in range(3):
        for name, flag in (("epilogue", True), ("scale_kernel", False)):
            times[name].append(window(lambda: run(flag), 600))
    entry["ms"] = {name: statistics.median(found) for name, found in times.items()}
    entry["ms_rounds"] = times
    entry["power"] = power()
    print(micro, entry["ms"], entry["power"], flush=True)
    sweep = {}
    for tile in ((128, 192, 1, 2, True, False), (128, 192, 2, 1, True, False), (128, 128, 1, 2, True, False),
                 (128, 256, 2, 1, False, False), (128, 160, 1, 2, True, False)):
        gemm.DGATED_TILE = tile
        try:
            run(True)
            sweep[repr(tile)] = [window(lambda: run(True), 400) for _ in range(2)]
        except Exception as err:  # noqa: BLE001
            sweep[repr(tile)] = repr(err)[:300]
        print(micro, tile, sweep[repr(tile)], flush=True)
    gemm.DGATED_TILE = record["dgated_tile_default"]
    entry["dgated_tile_sweep_ms"] = sweep
    record["shapes"][micro] = entry
    del x, grad, ids
    torch.cuda.empty_cache()
json.dump(record, open(sys.argv[1], "w"), indent=1)
