"""Side-by-side A/B of one change to the production step, in one process: two sessions of measure_throughput's
production path at one micro-batch, the second built (and its CUDA graphs captured) with the change in place, then
timed in alternating blocks (A B B A ...) so both meet the same clocks under the board's power limit.

    python ab_probe.py VARIANT OUT_JSON [MICRO_BATCH] [ROUNDS] [STEPS_PER_BLOCK]

VARIANT:
  fa4_dq_swap   FlashAttention-4's SM90 backward at head size <= 64 with dQ_swapAB (its default: no swap)
  fa4_dq_atom1  the same backward with AtomLayoutMdQ 1 (default 2)
  race_sustained the two GEMM size classes whose burst winner differed from the winner sustained at the power
                limit (o projection forward: quack 128x160; gate|up input gradient: quack 128x128)
  norm_kept_sum the residual norms' backward from a kept BF16 sum (the path before; A reads the norms' output)
  route_scale_epilogue the experts' route scales in the SwiGLU GEMMs' epilogues (A: the scale kernel beside quack's
                plain SwiGLU GEMMs, cflib's backward kernel after the activation's gradient GEMM)
  keep_activation the TR-MoE block's scaled activation kept from forward for the down weight's gradient (A: recomputed
                by the backward kernel, which then writes it)
  embedding_index_add the token embedding's backward by index_add_ (A: torch's sort-and-scatter backward)
  none          B is a second baseline (the A/A spread)
"""
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from cflib.bench.batches import Batches  # noqa: F401  (import order: cflib first)
from cflib.bench.throughput import PROJECT_PATHS, ThroughputParams, _batches, _project_session, train_params
from cflib.bench.timing import sync
from cflib.model.config import PRESETS
from cflib.ops import gemm

variant, out_json = sys.argv[1], Path(sys.argv[2])
micro = int(sys.argv[3]) if len(sys.argv) > 3 else 48
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 8
block = int(sys.argv[5]) if len(sys.argv) > 5 else 8
device = torch.device("cuda")
work = Path(f"/tmp/ab_probe_{variant}")
profile = yaml.safe_load(Path("params/throughput_200m_h200.yaml").read_text())
params = ThroughputParams.from_dict({**profile, "micro_batches": [micro], "compare_micro_batch": micro,
                                     "paths": ["production"], "batches": ["random_rows"], "warmup_steps": 4,
                                     "timed_steps": 2 * rounds * block, "out_dir": str(work)})
config = PRESETS[params.model]
batches = _batches("random_rows", params, config, work)
steps, _ = batches.steps_of("production", micro, 4, 2 * rounds * block)
tokens_per_step = micro * params.seq_len


def build(tag):
    tparams = train_params(params, micro, 100_000, batches.root, work / f"run-{tag}", PROJECT_PATHS["production"])
    session = _project_session("production", tparams)
    for i in range(4):  # eager, capture, replays
        session.step(steps[i], steps[i + 1])
    sync(device)
    return session


def apply_variant():
    if variant in ("fa4_dq_swap", "fa4_dq_atom1"):
        import flash_attn.cute.interface as fa
        original = fa._tile_size_bwd_sm90

        def patched(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
            cfg = original(head_dim, head_dim_v, causal, local, sparse_block_size_q=sparse_block_size_q)
            if head_dim > 64:
                return cfg
            if variant == "fa4_dq_swap":
                return dataclasses.replace(cfg, dQ_swapAB=True)
            return dataclasses.replace(cfg, AtomLayoutMdQ=1)
        fa._tile_size_bwd_sm90 = patched
        return {"default": repr(original(64, 64, True, False)), "variant": repr(patched(64, 64, True, False))}
    if variant == "route_scale_epilogue":
        from cflib.ops.trmoe import GatedSwiGLUDown
        GatedSwiGLUDown.scale_in_epilogue = True
        return {"GatedSwiGLUDown.scale_in_epilogue": True}
    if variant == "embedding_index_add":
        RowAddEmbedding.forward = ROW_ADD_FORWARD
        return {"RowAddEmbedding.forward": "token_rows"}
    if variant == "keep_activation":
        from cflib.ops.trmoe import GatedSwiGLUDown
        GatedSwiGLUDown.keep_activation = True
        return {"GatedSwiGLUDown.keep_activation": True}
    if variant == "norm_kept_sum":
        from cflib.model.fast import AddRMSNorm
        AddRMSNorm.normed_from_output = False  # read at capture: A's graphs keep the output path
        return {"AddRMSNorm.normed_from_output": False}
    if variant == "race_sustained":
        raced = gemm.step_gemms(True)
        changed = {}
        for key, tile in list(raced.chosen.items()):
            kind, sides = key[0], key[1]
            if kind == "linear" and sides[1:] == (10, 10) and sides[0] >= 14:  # o projection forward
                raced.chosen[key] = (128, 160, 1, 2, True, True)
            elif kind == "matmul" and sides[1:] == (13, 10) and sides[0] >= 14:  # gate|up input gradient
                raced.chosen[key] = (128, 128, 1, 2, True, True)
            else:
                continue
            changed[repr(key)] = [repr(tile), repr(raced.chosen[key])]
        return changed
    return {}


def clocks():
    try:
        return {"watts": torch.cuda.power_draw(device) / 1000, "mhz": torch.cuda.clock_rate(device)}
    except Exception as err:  # noqa: BLE001
        return {"error": str(err)}


if variant == "embedding_index_add":
    from torch import nn

    from cflib.model.fast import RowAddEmbedding
    ROW_ADD_FORWARD = RowAddEmbedding.forward
    RowAddEmbedding.forward = nn.Embedding.forward  # read at capture: A's graphs keep torch's backward
if variant == "route_scale_epilogue":
    from cflib.ops.trmoe import GatedSwiGLUDown
    GatedSwiGLUDown.scale_in_epilogue = False  # read at capture: A's graphs keep the scale kernel
started = time.time()
a = build("a")
race_before = {repr(k): repr(v) for k, v in gemm.step_gemms(True).chosen.items()}
change = apply_variant()
b = build("b")
print("built", round(time.time() - started, 1), "s; change:", change, flush=True)
blocks = []
index = 4
order = []
for r in range(rounds):
    order += ["a", "b"] if r % 2 == 0 else ["b", "a"]
for name in order:
    session = a if name == "a" else b
    sync(device)
    t0 = time.perf_counter()
    samples = []
    for i in range(block):
        batch = steps[(index + i) % len(steps)]
        following = steps[(index + i + 1) % len(steps)]
        session.step(batch, following)
        if i == block // 2:
            samples.append(clocks())
    sync(device)
    seconds = time.perf_counter() - t0
    index += block
    blocks.append({"side": name, "tokens_per_s": block * tokens_per_step / seconds, "seconds": seconds,
                   "clocks": samples})
    print(name, round(blocks[-1]["tokens_per_s"]), samples, flush=True)
summary = {}
for name in ("a", "b"):
    rates = [x["tokens_per_s"] for x in blocks if x["side"] == name]
    summary[name] = {"median": float(np.median(rates)), "mean": float(np.mean(rates)), "max": max(rates),
                     "min": min(rates)}
pairs = [blocks[i + 1]["tokens_per_s"] / blocks[i]["tokens_per_s"] if blocks[i]["side"] == "a" else
         blocks[i]["tokens_per_s"] / blocks[i + 1]["tokens_per_s"] for i in range(0, len(blocks), 2)]
summary["b_over_a_per_round"] = pairs
summary["b_over_a_median"] = float(np.median(pairs))
summary["b_over_a_of_means"] = summary["b"]["mean"] / summary["a"]["mean"]
print(json.dumps(summary), flush=True)
out_json.write_text(json.dumps({"variant": variant, "micro_batch": micro, "rounds": rounds, "steps_per_block": block,
                                "change": change, "race_choices_before": race_before,
                                "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                                "summary": summary, "blocks": blocks}, indent=1))
