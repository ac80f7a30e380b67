"""One-off: the gated block untuned, untuned with the pre-activation's gradient written in place, and tuned;
gradients of each compared with the untuned run's; peak memory of one forward+backward; tuned winners printed."""
import gc, json, os, time
import torch
from cflib.bench.swiglu_epilogue import _Layer, measure_variant
import cflib.ops.trmoe as t
from quack.gemm_interface import gemm_gated, gemm_dgated

layer = _Layer(16 * 2048, torch.device("cuda"))
ref = layer.reference(True)
NAME = "cflib_gated_copies"

def grads_and_peak():
    for leaf in layer.leaves:
        leaf.grad = None
    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    getattr(layer, NAME)().backward(layer.grad)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return [None if l.grad is None else l.grad.detach().float().clone() for l in layer.leaves], peak

def compare(a, b):
    out = []
    for x, y in zip(a, b):
        if x is None or y is None:
            out.append(None)
        else:
            out.append(float((x - y).norm() / y.norm().clamp_min(1e-30)))
    return out

res = {}
res["untuned"] = measure_variant(layer, NAME, ref, 300)
base_grads, res["untuned"]["peak_mib"] = grads_and_peak()
print("untuned", res["untuned"], flush=True)

t.dgated_gemm = lambda dy, down, pre: gemm_dgated(dy, down, pre, activation="swiglu", dx_out=pre, tuned=False)
res["inplace"] = measure_variant(layer, NAME, ref, 300)
g, res["inplace"]["peak_mib"] = grads_and_peak()
res["inplace"]["grad_rel_vs_untuned"] = compare(g, base_grads)
print("inplace", res["inplace"], flush=True)

t.gated_gemm = lambda x, w: gemm_gated(x, w.t(), activation="swiglu", tuned=True)
t.dgated_gemm = lambda dy, down, pre: gemm_dgated(dy, down, pre, activation="swiglu", dx_out=pre, tuned=True)
t0 = time.time()
res["tuned_inplace"] = measure_variant(layer, NAME, ref, 300)
g, res["tuned_inplace"]["peak_mib"] = grads_and_peak()
res["tuned_inplace"]["grad_rel_vs_untuned"] = compare(g, base_grads)
print("tuned_inplace", res["tuned_inplace"], "tuning+timing s", round(time.time() - t0), flush=True)
from quack.autotuner import Autotuner
found = []
for o in gc.get_objects():
    try:
        if isinstance(o, Autotuner) and o.cache:
            for k, v in o.cache.items():
                found.append({"fn": getattr(getattr(o, "fn", None), "__name__", str(type(o))), "key": str(k)[:300], "config": repr(v)})
    except Exception:
        pass
for f in found:
    print("winner", f)
res["winners"] = found
json.dump(res, open(os.environ["OUT"] + "/gated_tuned_probe_h200.json", "w"), indent=1)
