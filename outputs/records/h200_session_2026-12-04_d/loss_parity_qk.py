"""loss_parity with QK-norm's backward keeping qkv in the baseline and its repeat, and recovering the normed heads
from q and k in every variant (a variant repeating --set runs the default alone)."""
import sys

import cflib.model.fast as fast
from cflib.bench import loss_parity

measure = loss_parity._losses


def _losses(params, out_dir):
    fast.FusedAttention.normed_from_output = out_dir.name not in ("baseline", "repeat")
    return measure(params, out_dir)


loss_parity._losses = _losses
loss_parity.main(sys.argv[1:])
