"""cflib's QK-norm + RoPE kernels (blocks of (token, head) rows) against a candidate kept beside this script
(`qk_norm_rope_tokens.py`: a block of tokens, every head of each, whole rows, cos and sin once a token), at the
200M shapes on the same inputs: outputs compared, each way timed round robin (triton.testing.do_bench median,
backward with its partials' sum), and the bytes each way must move over its time. The inputs' cos and sin
are random, not RoPE tables, so the two (which read the tables' halves differently) differ in q and k.

    PYTHONPATH=. python qk_norm_rope_ab.py OUT.json
"""
import importlib.util
import json
import pathlib
import sys

import torch
from triton.testing import do_bench

from cflib.bench.tiles import _qk_inputs
from cflib.model.config import preset
from cflib.ops import qk_norm_rope as rows_kernels

spec = importlib.util.spec_from_file_location("qk_tokens", pathlib.Path(__file__).with_name("qk_norm_rope_tokens.py"))
tokens_kernels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tokens_kernels)


def main(out_path):
    config = preset("tr_hash_200m")
    tokens = 16 * 2048
    i = _qk_inputs(config, tokens, torch.device("cuda"))
    heads, eps = (config.num_attention_heads, config.num_key_value_heads), config.norm_eps
    tensors = (i["qkv"], i["q_weight"], i["k_weight"], i["cos"], i["sin"], i["positions"])
    record = {"device": torch.cuda.get_device_name(), "tokens": tokens, "kernels": {}}
    launches, outputs = {}, {}
    for name, module in (("rows", rows_kernels), ("tokens", tokens_kernels)):
        q, k, v, rstd = module.qk_norm_rope_forward(*tensors, *heads, eps)
        grad_qkv, grad_w = module.qk_norm_rope_backward(*i["grads"], *tensors, rstd, *heads)
        outputs[name] = (q, k, v, grad_qkv, grad_w)
        launches[name] = (lambda m=module: m.qk_norm_rope_forward(*tensors, *heads, eps),
                          lambda m=module, r=rstd: m.qk_norm_rope_backward(*i["grads"], *tensors, r, *heads))
    record["max_abs_diff"] = {what: (a.float() - b.float()).abs().max().item() for what, a, b in
                              zip(("q", "k", "v", "grad_qkv", "grad_w"), outputs["rows"], outputs["tokens"])}
    width = i["qkv"].shape[1]
    moved = {"forward": 2 * tokens * width * 2, "backward": 3 * tokens * width * 2}  # bf16 in and out, least
    for rep in range(3):
        for name, (forward, backward) in launches.items():
            entry = record["kernels"].setdefault(name, {"forward_us": [], "backward_us": []})
            entry["forward_us"].append(1000 * do_bench(forward, warmup=25, rep=200))
            entry["backward_us"].append(1000 * do_bench(backward, warmup=25, rep=200))
    for name, entry in record["kernels"].items():
        for way in ("forward", "backward"):
            best = min(entry[f"{way}_us"])
            entry[f"{way}_best_us"] = best
            entry[f"{way}_gb_per_s"] = moved[way] / best / 1e3
        print(name, {k: round(v, 1) for k, v in entry.items() if k.endswith(("best_us", "gb_per_s"))}, flush=True)
    print("max_abs_diff", record["max_abs_diff"], flush=True)
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
