"""The token embedding's one-pass backward (cflib.ops.embedding) beside torch's embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tiny_models import KERNEL_DEVICE

from cflib.ops.embedding import token_rows


def test_rows_and_the_table_gradient_equal_torch_s_repeated_ids_included():
    """Every id of a small vocabulary repeats, so rows from many positions meet in one table row; float64 on
    both sides leaves only the adds' order to differ."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (3, 40), generator=gen).to(KERNEL_DEVICE)
    table = torch.randn(7, 16, generator=gen, dtype=torch.float64).to(KERNEL_DEVICE)
    upstream = torch.randn(3, 40, 16, generator=gen, dtype=torch.float64).to(KERNEL_DEVICE)
    ours, theirs = table.clone().requires_grad_(), table.clone().requires_grad_()
    rows = token_rows(ids, ours)
    torch.testing.assert_close(rows, F.embedding(ids, table), rtol=0, atol=0)
    rows.backward(upstream)
    F.embedding(ids, theirs).backward(upstream)
    assert ids.unique().numel() == 7  # 120 positions over 7 rows: every row sums many
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)


def test_a_table_row_no_id_reads_gets_a_zero_gradient_in_float32():
    table = torch.randn(5, 4, device=KERNEL_DEVICE, requires_grad=True)
    ids = torch.tensor([[0, 2, 2]], device=KERNEL_DEVICE)
    token_rows(ids, table).sum().backward()
    assert table.grad.dtype == torch.float32
    assert table.grad[[1, 3, 4]].abs().sum().item() == 0.0
    assert table.grad[2].tolist() == [2.0] * 4 and table.grad[0].tolist() == [1.0] * 4
