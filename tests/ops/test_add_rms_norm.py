"""cflib's residual add + RMSNorm kernel (cflib.ops.add_rms_norm) beside its PyTorch reference, forward and backward.

Triton's interpreter runs it on a CPU (tests/conftest.py), the GPU where there is one.
"""
from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPE_IDS, DTYPES, assert_matches, leaves, run
from tiny_models import KERNEL_DEVICE

from cflib.ops.add_rms_norm import add_rms_norm

EPS = 1e-6
ROWS, DIM = 24, 48  # a width below a power of two: the kernel's masked columns run too


def reference(h, delta, weight):
    """s = h + delta; rmsnorm(s) * weight, every step in the inputs' dtype (float64 for the truth)."""
    total = h + delta
    return total, total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * weight


def inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"h": torch.randn(ROWS, DIM, generator=gen) * 2, "delta": torch.randn(ROWS, DIM, generator=gen),
            "weight": torch.randn(DIM, generator=gen) * 0.1 + 1.0}


@pytest.mark.parametrize("from_output", [False, True], ids=["kept_sum", "from_output"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_the_reference_forward_and_backward(dtype, seed, from_output):
    """As training runs it: the residual h and the weight in fp32, the sub-layer's output delta in the
    compute dtype, the normed output in the autocast dtype; backward from a kept sum or from the output."""
    raw = inputs(seed)
    dtypes = {"h": torch.float32, "delta": dtype, "weight": torch.float32}
    rounded = {name: value.to(dtypes[name]) for name, value in raw.items()}
    grad = ("h", "delta", "weight")
    truth = run(reference, leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), seed + 10)
    got = run(lambda h, delta, weight: add_rms_norm(h, delta, weight, EPS, normed_from_output=from_output),
              leaves(rounded, dtypes, KERNEL_DEVICE, grad), seed + 10,
              autocast_dtype=dtype if dtype != torch.float32 else None)
    assert got["out0"].dtype == torch.float32 and got["out1"].dtype == dtype  # the stream stays fp32
    assert got["d_delta"].dtype == dtype
    assert_matches(got, truth, dtype)


def test_nothing_to_add_is_the_norm_of_the_stream():
    """The first layer has no delta: the stream passes unchanged and is normalised."""
    raw = inputs(2)
    grad = ("h", "weight")
    truth = run(lambda h, weight: reference(h, torch.zeros_like(h), weight),
                leaves({k: raw[k] for k in grad}, dict.fromkeys(grad, torch.float64), KERNEL_DEVICE, grad), 3)
    got = run(lambda h, weight: add_rms_norm(h, None, weight, EPS),
              leaves({k: raw[k] for k in grad}, {}, KERNEL_DEVICE, grad), 3)
    assert torch.equal(got["out0"].cpu(), raw["h"])
    assert_matches(got, truth, torch.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_stream_in_the_compute_dtype_is_the_rounded_sum_and_its_gradient_is_written_once(seed):
    """A stream already in the compute dtype (here BF16): s = h + delta rounded to it, normalised as rounded;
    one gradient serves h and delta."""
    raw = inputs(seed)
    dtypes = {"h": torch.bfloat16, "delta": torch.bfloat16, "weight": torch.float32}
    rounded = {name: value.to(dtypes[name]) for name, value in raw.items()}
    grad = ("h", "delta", "weight")
    truth = run(reference, leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), seed + 10)
    got = run(lambda h, delta, weight: add_rms_norm(h, delta, weight, EPS),
              leaves(rounded, dtypes, KERNEL_DEVICE, grad), seed + 10, autocast_dtype=torch.bfloat16)
    assert got["out0"].dtype == got["out1"].dtype == got["d_h"].dtype == torch.bfloat16
    # The fp32 sum rounded to BF16: within one BF16 step of PyTorch's rounding (Triton's interpreter truncates).
    total = (rounded["h"].float() + rounded["delta"].float()).to(KERNEL_DEVICE)
    assert bool(((got["out0"].float() - total).abs() <= total.abs() * 2 ** -7).all())
    assert torch.equal(got["d_h"], got["d_delta"])
    assert_matches(got, truth, torch.bfloat16)


def _saved_by_the_norm(from_output: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The normed output of one BF16 add + norm, and the tensors its backward keeps."""
    raw = inputs(4)
    h, weight = raw["h"].to(KERNEL_DEVICE).requires_grad_(), raw["weight"].to(KERNEL_DEVICE).requires_grad_()
    delta = raw["delta"].to(KERNEL_DEVICE, torch.bfloat16).requires_grad_()
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t), \
            torch.autocast(KERNEL_DEVICE.type, dtype=torch.bfloat16):
        _, normed = add_rms_norm(h, delta, weight, EPS, normed_from_output=from_output)
    return normed, kept


def test_from_the_output_backward_keeps_no_tensor_of_its_own():
    """With normed_from_output the norm keeps the output the next GEMM keeps anyway (the same storage), so a
    step holds one [tokens, hidden] BF16 tensor less per norm; otherwise it keeps a BF16 copy of the sum."""
    normed, kept = _saved_by_the_norm(True)
    wide = [t for t in kept if t.shape == (ROWS, DIM)]
    assert len(wide) == 1 and wide[0].untyped_storage().data_ptr() == normed.untyped_storage().data_ptr()
    normed, kept = _saved_by_the_norm(False)
    wide = [t for t in kept if t.shape == (ROWS, DIM)]
    assert len(wide) == 1 and wide[0].untyped_storage().data_ptr() != normed.untyped_storage().data_ptr()
    assert wide[0].dtype == torch.bfloat16


@pytest.mark.parametrize("from_output", [False, True], ids=["kept_sum", "from_output"])
def test_a_zero_weight_is_exact_from_a_kept_sum_and_nan_from_the_output(from_output):
    """A zero weight zeroes its column of the output, so the output no longer holds the sum there: backward
    from the output gives NaN in that column (the trainer stops on it, no weight written), from a kept sum the
    exact gradients. cflib.model.fast takes the output only for norms without a zero weight."""
    raw = inputs(5)
    raw["weight"][7] = 0.0
    dtypes = {"h": torch.float32, "delta": torch.bfloat16, "weight": torch.float32}
    rounded = {name: value.to(dtypes[name]) for name, value in raw.items()}
    grad = ("h", "delta", "weight")
    got = run(lambda h, delta, weight: add_rms_norm(h, delta, weight, EPS, normed_from_output=from_output),
              leaves(rounded, dtypes, KERNEL_DEVICE, grad), 15, autocast_dtype=torch.bfloat16)
    if from_output:
        assert bool(got["d_weight"][7].isnan()) and bool(got["d_h"][:, 7].isnan().all())
        return
    truth = run(reference, leaves(rounded, dict.fromkeys(raw, torch.float64), KERNEL_DEVICE, grad), 15)
    assert_matches(got, truth, torch.bfloat16)
