"""Whether the residual norms' backward from their output trains as the backward from a kept BF16 sum did:
cflib.bench.loss_parity's comparison, the baseline being the kept sum (AddRMSNorm.normed_from_output patched
False, the path before), its repeat the noise, and the output path (today's default) the variant.

    python norm_parity.py OUT_JSON [STEPS]
"""
import json
import sys
import tempfile
from pathlib import Path

from cflib.bench import loss_parity
from cflib.model.fast import AddRMSNorm
from cflib.train.params import load_params_file

out, steps = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 50
params = {**load_params_file("params/sft_200m_release.yaml"), "init_checkpoint": None, "data": "embedded",
          "require_release_ready": False, "lr": 3e-4}
base = {**params, **loss_parity.QUIET, "max_steps": steps, "epochs": max(int(params.get("epochs") or 1), steps)}
work = Path(tempfile.mkdtemp())
AddRMSNorm.normed_from_output = False
baseline, kernels = loss_parity._losses(base, work / "baseline")
repeat, _ = loss_parity._losses(base, work / "repeat")
AddRMSNorm.normed_from_output = True
variant, _ = loss_parity._losses(base, work / "variant")
noise = loss_parity.deviation(repeat, baseline)
allowed = max(loss_parity.NOISE_FACTOR * noise, loss_parity.BF16_FLOOR)
off = loss_parity.deviation(variant, baseline)
record = {"steps": steps, "baseline": "residual norms' backward from a kept BF16 sum", "variant":
          "from the norms' output (default)", "noise": noise, "allowed": allowed, "deviation": off,
          "within_noise": off <= allowed, "losses": {"baseline": baseline, "repeat": repeat, "variant": variant},
          "kernel_path": kernels}
out.write_text(json.dumps(record, indent=1))
print(f"repeat {noise:.2e}; allowed {allowed:.2e}; output path {off:.2e} "
      f"{'within' if off <= allowed else 'OUTSIDE'} the noise")
