"""cflib's multi-tensor AdamW kernel (cflib.ops.adamw) beside its PyTorch reference, and the weight copies it writes.

Triton's interpreter runs it on a CPU (tests/conftest.py), the GPU where there is one. On the CPU the kernel's
FP32 arithmetic is the reference's operation by operation (no multiply-add contracted, divisions and square root
correctly rounded), so the two agree bit for bit; on a GPU they are checked within a few FP32 roundings.

The tables hold addresses only: every tensor handed to adamw_tables is kept in a variable until the launch.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from cflib.ops.adamw import BLOCK, adamw_reference_, adamw_step_, adamw_tables, step_coefficients, writes_rows

BETAS, EPS = (0.9, 0.95), 1e-8
SHAPES = [(5, 7), (2 * BLOCK + 3,), (3, 4, 5), (1,)]  # a tensor over two blocks with a tail, and a scalar-like


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    if KERNEL_DEVICE.type == "cpu":
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6 * float(expected.detach().abs().max()))


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
        coefficients = step_coefficients(torch.full((len(SHAPES),), float(step), device=KERNEL_DEVICE), 1e-2, BETAS)
        adamw_step_(tables, coefficients, 1e-2, 0.1, BETAS, EPS, grad_scale=scale)
        for tensors in zip(*reference):
            adamw_reference_(*tensors, step=step, lr=1e-2, weight_decay=0.1, betas=BETAS, eps=EPS,
                             grad_scale=grad_scale or 1.0)
    for got_column, expected_column in zip(kernel, reference):
        for got, expected in zip(got_column, expected_column):
            _close(got, expected)
    assert not torch.equal(kernel[0][0], _state(0)[0][0])  # the weights moved


def test_each_copy_is_the_bf16_cast_of_its_updated_master_in_any_layout():
    """A copy as its own tensor and as rows of a larger one (a fused copy's row slice): each holds exactly
    torch's round-to-nearest-even cast of the updated master, and nothing around it is touched."""
    params, grads, exp_avgs, exp_avg_sqs = _state(1)
    fused_rows = torch.zeros(9, 7, dtype=torch.bfloat16, device=KERNEL_DEVICE)  # rows 2..6 hold the first master
    copies = [fused_rows[2:7], torch.zeros(SHAPES[1], dtype=torch.bfloat16, device=KERNEL_DEVICE), None, None]
    steps = torch.ones(len(SHAPES), device=KERNEL_DEVICE)
    coefficients = step_coefficients(steps, 1e-2, BETAS)
    adamw_step_(adamw_tables(params, grads, exp_avgs, exp_avg_sqs, copies), coefficients, 1e-2, 0.0, BETAS, EPS)
    for param, copy in zip(params, copies):
        if copy is not None:
            assert torch.equal(copy, param.bfloat16())
    assert not fused_rows[:2].any() and not fused_rows[7:].any()


def test_a_column_slice_of_a_wider_copy_is_written_row_by_row():
    """The layout of the shared down projection's place in the fused down copy."""
    param = torch.randn(4, 6, device=KERNEL_DEVICE)
    grad, exp_avg, exp_avg_sq = torch.randn_like(param), torch.zeros_like(param), torch.zeros_like(param)
    wide = torch.zeros(4, 20, dtype=torch.bfloat16, device=KERNEL_DEVICE)
    coefficients = step_coefficients(torch.ones(1, device=KERNEL_DEVICE), 1e-2, BETAS)
    adamw_step_(adamw_tables([param], [grad], [exp_avg], [exp_avg_sq], [wide[:, 8:14]]), coefficients, 1e-2, 0.1,
                BETAS, EPS)
    assert torch.equal(wide[:, 8:14], param.bfloat16())
    assert not wide[:, :8].any() and not wide[:, 14:].any()


def test_a_transposed_view_is_left_to_its_caller():
    """An expert's slice of a fused copy is transposed: written by the kernel, its stores would scatter."""
    transposed = torch.zeros(5, 4, 3, dtype=torch.bfloat16, device=KERNEL_DEVICE).permute(2, 1, 0)
    assert not writes_rows(transposed) and not writes_rows(torch.zeros(6, 4).t())
    assert writes_rows(torch.zeros(6, 4)[:, 1:3]) and writes_rows(torch.zeros(6))
    state = _state(5)
    with pytest.raises(ValueError, match=r"copy 2 is a view of strides \(1, 3, 12\), not rows"):
        adamw_tables(*state, copies=[None, None, transposed, None])


@pytest.mark.filterwarnings("ignore:overflow encountered")  # numpy, in the interpreter, on the largest float
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_copies_round_ties_to_even_and_keep_nan(copy_dtype):
    """With lr 0 and zero gradients the masters keep their values, so the copy is the cast of chosen values:
    ties between two BF16 values, the largest float (which rounds to infinity in BF16) and NaN."""
    values = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), torch.finfo(torch.float32).max,
                           float("nan"), 0.5], device=KERNEL_DEVICE)
    params, grads = [values.clone()], [torch.zeros_like(values)]
    copy = torch.empty(values.shape, dtype=copy_dtype, device=KERNEL_DEVICE)
    moments = [torch.zeros_like(values)], [torch.zeros_like(values)]
    coefficients = step_coefficients(torch.ones(1, device=KERNEL_DEVICE), 0.0, BETAS)
    adamw_step_(adamw_tables(params, grads, *moments, [copy]), coefficients, 0.0, 0.0, BETAS, EPS)
    assert torch.equal(params[0][:4], values[:4]) and params[0][4].isnan()
    expected = values.to(copy_dtype)
    assert torch.equal(copy[:4].view(torch.int16), expected[:4].view(torch.int16))  # bit for bit
    assert copy[4].isnan() and copy[5] == 0.5


def test_a_found_inf_step_writes_nothing():
    params, grads, exp_avgs, exp_avg_sqs = _state(2)
    before = [tensor.clone() for tensor in params + exp_avgs + exp_avg_sqs]
    copies = [torch.full(shape, 5.0, dtype=torch.bfloat16, device=KERNEL_DEVICE) for shape in SHAPES]
    coefficients = step_coefficients(torch.ones(len(SHAPES), device=KERNEL_DEVICE), 1e-2, BETAS)
    found_inf = torch.tensor(1.0, device=KERNEL_DEVICE)
    adamw_step_(adamw_tables(params, grads, exp_avgs, exp_avg_sqs, copies), coefficients, 1e-2, 0.1, BETAS, EPS,
                found_inf=found_inf)
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
