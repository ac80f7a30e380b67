"""Chosen rows of an activation (cflib.ops.rows): the gather, and its gradient put back by the Triton kernel
beside the PyTorch reference, padding entries included.

Triton's interpreter runs the kernel on a CPU (tests/conftest.py), the GPU where there is one.
"""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from cflib.ops.rows import Rows, gather_rows, scatter_rows, scatter_rows_reference

NUM_ROWS, DIM = 40, 48  # a width below a power of two: the kernel's masked columns run too


def _rows(padding: int) -> Rows:
    """Eleven distinct positions in no order, then `padding` entries repeating the first, kept 0.0."""
    indices = torch.randperm(NUM_ROWS, generator=torch.Generator().manual_seed(3))[:11]
    keep = None
    if padding:
        indices = torch.cat([indices, indices[:1].expand(padding)])
        keep = torch.cat([torch.ones(11), torch.zeros(padding)])
    return Rows(indices.to(KERNEL_DEVICE), None if keep is None else keep.to(KERNEL_DEVICE))


@pytest.mark.parametrize("padding", [0, 5], ids=["unique", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_kernel_puts_each_kept_row_back_and_zeros_the_rest(dtype, padding):
    rows = _rows(padding)
    grad = torch.randn(rows.indices.numel(), DIM, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE, dtype)
    got = scatter_rows(grad, rows, NUM_ROWS)
    want = scatter_rows_reference(grad, rows, NUM_ROWS)
    assert got.dtype == dtype and torch.equal(got, want)  # copies only: bit for bit
    kept = rows.indices[:11]
    untouched = torch.ones(NUM_ROWS, dtype=torch.bool, device=KERNEL_DEVICE)
    untouched[kept] = False
    assert torch.equal(got[kept], grad[:11]) and not got[untouched].any()


def test_padding_takes_no_gradient_even_where_it_has_one():
    """A padding entry's row is dropped, whatever its gradient: the kept entry of that position alone lands."""
    rows = _rows(3)
    grad = torch.randn(rows.indices.numel(), DIM, generator=torch.Generator().manual_seed(5)).to(KERNEL_DEVICE)
    first = int(rows.indices[0])
    assert torch.equal(scatter_rows(grad, rows, NUM_ROWS)[first], grad[0])


def test_gather_picks_the_rows_and_its_backward_is_the_scatter():
    rows = _rows(4)
    x = torch.randn(4, NUM_ROWS // 4, DIM, generator=torch.Generator().manual_seed(6)).to(KERNEL_DEVICE)
    x.requires_grad_(True)
    picked = gather_rows(x, rows)
    assert torch.equal(picked, x.detach().reshape(-1, DIM)[rows.indices])
    grad = torch.randn(picked.shape, generator=torch.Generator().manual_seed(7)).to(KERNEL_DEVICE)
    picked.backward(grad)
    assert x.grad.shape == x.shape
    assert torch.equal(x.grad.reshape(-1, DIM), scatter_rows_reference(grad, rows, NUM_ROWS))


def test_rows_refuse_a_mask_of_another_shape():
    with pytest.raises(ValueError, match="Rows.keep has shape"):
        Rows(torch.arange(3), torch.ones(4))
    with pytest.raises(ValueError, match="Rows.indices must be 1-D"):
        Rows(torch.zeros(2, 2, dtype=torch.long))
