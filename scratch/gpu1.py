import json, os, sys, time, tempfile
import numpy as np, torch
from cflib.data import Example, write_partition
from cflib.train import train
from cflib.validate import validate, summarize
out = os.environ.get("OUT", "/tmp/out")
dev = torch.device("cuda")
t = time.time()
rows, skipped = validate(dev) if os.environ.get("VALIDATE") else ([], [])
if rows: print("validate", summarize(rows), skipped, f"{time.time()-t:.0f}s", flush=True)
for r in rows:
    if r["shape"] == "200m": print(f"  {r['component']:14s} {r['tensor']:22s} {r['dtype']:9s} {r['backend']:38s} {r['norm_rel']:.2e} ref {r['reference_norm_rel']:.2e} {'ok' if r['passed'] else 'FAIL'}")
json.dump(rows, open(f"{out}/validate_rows.json", "w"))
# synthetic shard: random tokens, first third unsupervised
root = tempfile.mkdtemp()
rng = np.random.default_rng(0)
def examples(n):
    for i in range(n):
        ids = rng.integers(1, 32000, 2048)
        labels = np.concatenate([ids[1:], [0]]).astype(np.int64); labels[:2048 // 3] = -100
        yield Example(ids.tolist(), labels.tolist(), {"task": "random"})
write_partition(f"{root}/train", examples(16 * 24), vocab_size=32000, eos_token_id=0, max_seq_len=2048)
write_partition(f"{root}/eval", examples(16), vocab_size=32000, eos_token_id=0, max_seq_len=2048)
for name, kw in (
                 ("production", dict(use_custom_kernels="true", require_liger=True)),):
    rec = train(dict(model="tr_hash_200m", data=root, seq_len=2048, micro_batch_per_rank=16, global_batch=16,
                     max_steps=20, bf16=True, fp32_loss=False, eval_at_start=False, exact_match_limit=0,
                     save_checkpoints=False, out_dir=f"{root}/run-{name}", lr=2e-5, **kw), progress=False)
    th = rec["throughput"] if "throughput" in rec else rec
    print(name, json.dumps({k: rec.get(k) for k in ("kernel_path", "peak_memory_gib")}), json.dumps(rec.get("throughput")), flush=True)
    json.dump(rec, open(f"{out}/train_{name}.json", "w"), default=str)
from torch.profiler import profile, ProfilerActivity
from cflib.config import preset
from cflib.model import TRMoEModel
from cflib.kernels import plan_kernels, SFTLoss
cfg = preset("tr_hash_200m")
model = TRMoEModel(cfg).to(dev)
plan = plan_kernels("true", True, dev); model.use_kernels(plan); loss_fn = SFTLoss(plan)
ids = torch.randint(1, 32000, (16, 2048), device=dev); labels = ids.roll(-1, 1).clone(); labels[:, :682] = -100
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = model(ids); l, n = loss_fn(h, model.head_weight, labels, 1024, False)
    (l / n).backward()
for _ in range(3): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(2): step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70))
