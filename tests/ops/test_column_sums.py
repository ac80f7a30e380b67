"""cflib's column sums (cflib.ops.column_sums) against float64 sums, on the norms' partial shapes."""
from __future__ import annotations

import pytest
import torch
from tiny_models import KERNEL_DEVICE

from cflib.ops.column_sums import column_sums


@pytest.mark.parametrize("rows, cols", [(1, 5), (64, 48), (65, 48), (1056, 896), (300, 128), (4100, 130)])
def test_sums_every_row_of_every_column(rows, cols):
    partial = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)).to(KERNEL_DEVICE)
    got = column_sums(partial)
    truth = partial.double().sum(0)
    assert got.dtype == torch.float32 and got.shape == (cols,)
    torch.testing.assert_close(got.double(), truth, rtol=1e-5, atol=1e-5 * rows ** 0.5)


def test_the_same_bits_every_time():
    partial = torch.randn(1056, 896, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    assert torch.equal(column_sums(partial), column_sums(partial.clone()))


def test_refuses_what_it_cannot_sum():
    with pytest.raises(ValueError, match="contiguous 2-D FP32"):
        column_sums(torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous 2-D FP32"):
        column_sums(torch.ones(4, 4).t())
