"""cflib's multi-tensor AdamW kernel (cflib.ops.adamw) beside its PyTorch reference, and the weight copies it writes.

Triton's interpreter runs it on a CPU (tests/conftest.py), the GPU where there is one. On the CPU the kernel's
FP32 arithmetic is the reference's operation by operation, so the two agree bit for bit; a GPU may contract a
multiply and an add into one rounding, so there they agree within a few FP32 roundings.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from cflib.ops.adamw import BLOCK, adamw_reference_, adamw_step_, adamw_tables, step_coefficients

BETAS, EPS = (0.9, 0.95), 1e-8
SHAPES = [(5, 7), (2 * BLOCK + 3,), (3, 4, 5), (1,)]  # a tensor over two blocks with a tail, and a scalar-like


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    if KERNEL_DEVICE.type == "cpu":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-9)


def _state(seed: int) -> list[list[torch.Tensor]]:
    """Parameters, gradients and both moments (the second non-negative), one of each per shape."""
    gen = torch.Generator().manual_seed(seed)
    columns = [[torch.randn(shape, generator=gen) for shape in SHAPES],
               [torch.randn(shape, generator=gen) * 3 for shape in SHAPES],
               [torch.randn(shape, generator=gen) * 0.1 for shape in SHAPES],
               [torch.rand(shape, generator=gen) * 0.01 for shape in SHAPES]]
    return [[tensor.to(KERNEL_DEVICE) for tensor in column] for column in columns]


@pytest.mark.parametrize("grad_scale", [None, 2.5], ids=["unclipped", "clipped"])
def test_three_steps_match_the_reference_tensor_by_tensor(grad_scale):
    kernel, reference = _state(0), _state(0)
    tables = adamw_tables(*kernel, copies=[None] * len(SHAPES))
    scale = None if grad_scale is None else torch.tensor(grad_scale, device=KERNEL_DEVICE)
    for step in (1, 2, 3):
        steps = torch.full((len(SHAPES),), float(step), device=KERNEL_DEVICE)
        adamw_step_(tables, step_coefficients(steps, 1e-2, BETAS), 1e-2, 0.1, BETAS, EPS, grad_scale=scale)
        for tensors in zip(*reference):
            adamw_reference_(*tensors, step=step, lr=1e-2, weight_decay=0.1, betas=BETAS, eps=EPS,
                             grad_scale=grad_scale or 1.0)
    for got_column, expected_column in zip(kernel, reference):
        for got, expected in zip(got_column, expected_column):
            _close(got, expected)
    assert not torch.equal(kernel[0][0], _state(0)[0][0])  # the weights moved


def test_each_copy_is_the_bf16_cast_of_its_updated_master_in_any_layout():
    """A copy as its own tensor, as rows of a larger one, and transposed (the layouts the weight copies use):
    each holds exactly torch's round-to-nearest-even cast of the updated master; the rest stays untouched."""
    params, grads, exp_avgs, exp_avg_sqs = _state(1)
    fused_rows = torch.zeros(9, 7, dtype=torch.bfloat16, device=KERNEL_DEVICE)  # rows 2..6 hold the first master
    transposed = torch.zeros(5, 4, 3, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    copies = [fused_rows[2:7], torch.zeros(SHAPES[1], dtype=torch.bfloat16, device=KERNEL_DEVICE),
              transposed.permute(2, 1, 0), None]
    steps = torch.ones(len(SHAPES), device=KERNEL_DEVICE)
    adamw_step_(adamw_tables(params, grads, exp_avgs, exp_avg_sqs, copies), step_coefficients(steps, 1e-2, BETAS),
                1e-2, 0.0, BETAS, EPS)
    for param, copy in zip(params, copies):
        if copy is not None:
            assert torch.equal(copy, param.bfloat16())
    assert not fused_rows[:2].any() and not fused_rows[7:].any()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # numpy, in the interpreter, on the largest float
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copies_round_ties_to_even_and_keep_nan(copy_dtype):
    """With lr 0 and zero gradients the masters keep their values, so the copy is the cast of chosen values:
    ties between two BF16 values, the largest float (which rounds to infinity in BF16) and NaN."""
    values = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), torch.finfo(torch.float32).max,
                           float("nan"), 0.5], device=KERNEL_DEVICE)
    params = [values.clone()]
    copy = torch.empty(values.shape, dtype=copy_dtype, device=KERNEL_DEVICE)
    moments = [torch.zeros_like(values)], [torch.zeros_like(values)]
    adamw_step_(adamw_tables(params, [torch.zeros_like(values)], *moments, [copy]),
                step_coefficients(torch.ones(1, device=KERNEL_DEVICE), 0.0, BETAS), 0.0, 0.0, BETAS, EPS)
    assert torch.equal(params[0][:4], values[:4]) and params[0][4].isnan()
    expected = values.to(copy_dtype)
    assert torch.equal(copy[:4].view(torch.int16), expected[:4].view(torch.int16))  # bit for bit
    assert copy[4].isnan() and copy[5] == 0.5


def test_a_found_inf_step_writes_nothing():
    params, grads, exp_avgs, exp_avg_sqs = _state(2)
    before = [tensor.clone() for tensor in params + exp_avgs + exp_avg_sqs]
    copies = [torch.full(shape, 5.0, dtype=torch.bfloat16, device=KERNEL_DEVICE) for shape in SHAPES]
    steps = torch.ones(len(SHAPES), device=KERNEL_DEVICE)
    adamw_step_(adamw_tables(params, grads, exp_avgs, exp_avg_sqs, copies), step_coefficients(steps, 1e-2, BETAS),
                1e-2, 0.1, BETAS, EPS, found_inf=torch.tensor(1.0, device=KERNEL_DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(before, params + exp_avgs + exp_avg_sqs))
    assert all(bool((copy == 5.0).all()) for copy in copies)


@pytest.mark.parametrize("change, message", [
    (lambda state: state[0].__setitem__(1, state[0][1].double()), "parameter 1 is torch.float64"),
    (lambda state: state[1].__setitem__(0, state[1][0].t()), "gradient 0 is torch.float32, not contiguous"),
    (lambda state: state[2].__setitem__(2, state[2][2].flatten()), r"exp_avg 2 has shape \(60,\)"),
])
def test_tensors_it_cannot_update_are_refused_by_name(change, message):
    state = _state(3)
    change(state)
    with pytest.raises(ValueError, match=message):
        adamw_tables(*state, copies=[None] * len(SHAPES))


def test_copies_of_another_shape_or_dtype_are_refused():
    state = _state(4)
    with pytest.raises(ValueError, match=r"copy 0 has shape \(7, 5\), its parameter \(5, 7\)"):
        adamw_tables(*state, copies=[torch.zeros(7, 5, dtype=torch.bfloat16, device=KERNEL_DEVICE), None, None, None])
    with pytest.raises(ValueError, match="one dtype per launch"):
        adamw_tables(*state, copies=[torch.zeros(5, 7, dtype=torch.bfloat16, device=KERNEL_DEVICE),
                                     torch.zeros(SHAPES[1], dtype=torch.float16, device=KERNEL_DEVICE), None, None])
