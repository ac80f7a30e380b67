"""Chunked tied-head cross-entropy against full-logit F.cross_entropy."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from cflib.ops.loss import IGNORE_INDEX, chunked_cross_entropy_sum, cross_entropy_mean, supervised_positions

CHUNKS = [1, 3, 7, 1024]
BATCH, SEQ, DIM, VOCAB = 2, 9, 16, 37


@dataclass
class Problem:
    hidden: torch.Tensor  # [B, T, D] fp32
    weight: torch.Tensor  # [V, D] fp32
    labels: torch.Tensor  # [B, T] int64 with IGNORE_INDEX holes


def make_problem(seed: int = 0, ignored_fraction: float = 0.4) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, DIM, generator=gen)
    weight = torch.randn(VOCAB, DIM, generator=gen) * 0.5
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels[torch.rand(BATCH, SEQ, generator=gen) < ignored_fraction] = IGNORE_INDEX
    return Problem(hidden, weight, labels)


def leaves(problem: Problem, hidden_dtype: torch.dtype = torch.float32, weight_dtype: torch.dtype = torch.float32,
           hidden_grad: bool = True, weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh leaf copies (never aliasing the problem's tensors) in the given dtypes."""
    hidden = problem.hidden.to(hidden_dtype).clone().requires_grad_(hidden_grad)
    weight = problem.weight.to(weight_dtype).clone().requires_grad_(weight_grad)
    return hidden, weight


def reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
              reduction: str = "sum") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-logit fp32 loss of the (possibly rounded) inputs, and its grads w.r.t. hidden and weight."""
    h = hidden.detach().float().requires_grad_()
    w = weight.detach().float().requires_grad_()
    loss = F.cross_entropy((h @ w.t()).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.parametrize("fp32_loss", [True, False])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_fp32_sum_matches_full_logits(chunk: int, fp32_loss: bool) -> None:
    problem = make_problem()
    hidden, weight = leaves(problem)
    loss, count = chunked_cross_entropy_sum(hidden, weight, problem.labels, chunk, fp32_loss)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, problem.labels)
    assert count == int((problem.labels != IGNORE_INDEX).sum())
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_fp32_mean_matches_full_logits(chunk: int) -> None:
    problem = make_problem(seed=1)
    hidden, weight = leaves(problem)
    loss = cross_entropy_mean(hidden, weight, problem.labels, chunk)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, problem.labels, reduction="mean")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fp32_loss", [True, False])
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16_head", "fp32_head"])
def test_bf16_hidden_is_close_to_full_logits(weight_dtype: torch.dtype, chunk: int, fp32_loss: bool) -> None:
    """bf16 hidden states with a bf16 head, or an fp32 head as autocast leaves it."""
    problem = make_problem(seed=2)
    hidden, weight = leaves(problem, torch.bfloat16, weight_dtype)
    loss, _ = chunked_cross_entropy_sum(hidden, weight, problem.labels, chunk, fp32_loss)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, problem.labels)
    assert loss.dtype == torch.float32
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == weight_dtype
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=0.0)
    assert relative_error(hidden.grad, ref_dh) < 2e-2
    assert relative_error(weight.grad, ref_dw) < 2e-2


@pytest.mark.parametrize("chunk", CHUNKS)
def test_mostly_ignored_labels(chunk: int) -> None:
    problem = make_problem(seed=3, ignored_fraction=0.9)
    problem.labels[0, 4] = 5  # at least one supervised token
    hidden, weight = leaves(problem)
    loss, count = chunked_cross_entropy_sum(hidden, weight, problem.labels, chunk)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, problem.labels)
    assert count == int((problem.labels != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-5)
    assert bool((hidden.grad[problem.labels == IGNORE_INDEX] == 0).all())


@pytest.mark.parametrize("loss_fn", ["sum", "mean"])
def test_no_supervised_token_gives_zero_loss_that_backpropagates(loss_fn: str) -> None:
    problem = make_problem()
    labels = torch.full_like(problem.labels, IGNORE_INDEX)
    hidden, weight = leaves(problem)
    if loss_fn == "sum":
        loss, count = chunked_cross_entropy_sum(hidden, weight, labels, 3)
        assert count == 0
    else:
        loss = cross_entropy_mean(hidden, weight, labels, 3)
    assert loss.requires_grad and float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(weight.grad, torch.zeros_like(weight))


@pytest.mark.parametrize("chunk", [0, -1])
def test_invalid_chunk_size_raises(chunk: int) -> None:
    problem = make_problem()
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        chunked_cross_entropy_sum(problem.hidden, problem.weight, problem.labels, chunk)


@pytest.mark.parametrize("hidden_grad, weight_grad", [(False, True), (True, False)],
                         ids=["head_only", "hidden_only"])
def test_one_input_requiring_grad(hidden_grad: bool, weight_grad: bool) -> None:
    problem = make_problem(seed=4)
    hidden, weight = leaves(problem, hidden_grad=hidden_grad, weight_grad=weight_grad)
    loss, _ = chunked_cross_entropy_sum(hidden, weight, problem.labels, 3)
    loss.backward()
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, problem.labels)
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-5)
    if hidden_grad:
        torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-5)
        assert weight.grad is None
    else:
        torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-5)
        assert hidden.grad is None


def test_no_grad_evaluation() -> None:
    problem = make_problem(seed=5)
    with torch.no_grad():
        loss, _ = chunked_cross_entropy_sum(problem.hidden, problem.weight, problem.labels, 3)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(problem.hidden, problem.weight, problem.labels)[0],
                               rtol=1e-5, atol=1e-5)


def test_sums_accumulate_to_the_token_mean_of_the_whole_batch() -> None:
    """Two micro-batches, each divided by the total count, equal one batch's mean (loss and grads)."""
    problem = make_problem(seed=6)
    hidden, weight = leaves(problem)
    sums = [chunked_cross_entropy_sum(hidden[i:i + 1], weight, problem.labels[i:i + 1], 4) for i in range(BATCH)]
    total = sum(count for _, count in sums)
    for loss_sum, _ in sums:
        (loss_sum / total).backward()
    ref_loss, ref_dh, ref_dw = reference(hidden, weight, problem.labels, reduction="mean")
    torch.testing.assert_close(sum(s.detach() for s, _ in sums) / total, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weight.grad, ref_dw, rtol=1e-5, atol=1e-6)


def test_fp32_loss_means_fp32_head_maths_under_bf16_autocast() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(24, 32, requires_grad=True)
    weight = torch.randn(50, 32, requires_grad=True)
    labels = torch.randint(0, 50, (24,))
    reference = F.cross_entropy(hidden @ weight.t(), labels, reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact, _ = chunked_cross_entropy_sum(hidden, weight, labels, 7, fp32_loss=True)
        rounded, _ = chunked_cross_entropy_sum(hidden, weight, labels, 7, fp32_loss=False)
    assert abs(exact.item() - reference.item()) < 1e-3
    assert abs(rounded.item() - reference.item()) > abs(exact.item() - reference.item())
    exact.backward()
    torch.testing.assert_close(hidden.grad, torch.autograd.grad(reference, hidden)[0], rtol=1e-5, atol=1e-5)


def test_evaluation_under_no_grad_matches_the_training_path() -> None:
    torch.manual_seed(1)
    hidden, weight = torch.randn(30, 16), torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (30,))
    with torch.no_grad():
        evaluated, _ = chunked_cross_entropy_sum(hidden, weight, labels, 4)
    trained, _ = chunked_cross_entropy_sum(hidden, weight, labels, 4)
    assert evaluated.grad_fn is None and trained.grad_fn is not None
    assert evaluated.item() == pytest.approx(trained.item(), rel=1e-6)


def weighted_reference(problem: Problem, token_weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """sum_i w_i CE_i over supervised positions, from full fp32 logits, and its grads."""
    h = problem.hidden.clone().requires_grad_()
    w = problem.weight.clone().requires_grad_()
    per_token = F.cross_entropy((h @ w.t()).flatten(0, 1), problem.labels.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="none")
    loss = (per_token * token_weights.flatten()).sum()
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", CHUNKS)
def test_token_weights_scale_each_token_loss_and_its_gradients(chunk: int) -> None:
    problem = make_problem(seed=3)
    token_weights = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(4)) * 5
    want, want_h, want_w = weighted_reference(problem, token_weights)
    hidden, weight = leaves(problem)
    loss, count = chunked_cross_entropy_sum(hidden, weight, problem.labels, chunk, token_weights=token_weights)
    loss.backward()
    assert count == int((problem.labels != IGNORE_INDEX).sum())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    assert relative_error(hidden.grad, want_h) < 1e-5 and relative_error(weight.grad, want_w) < 1e-5
    with torch.no_grad():  # the evaluation path, no head gradients
        loss_eval, _ = chunked_cross_entropy_sum(problem.hidden, problem.weight, problem.labels, chunk,
                                                 token_weights=token_weights)
    torch.testing.assert_close(loss_eval, want, rtol=1e-5, atol=1e-5)


def test_unit_token_weights_are_the_unweighted_loss() -> None:
    problem = make_problem(seed=5)
    plain, _ = chunked_cross_entropy_sum(problem.hidden, problem.weight, problem.labels, 4)
    ones, _ = chunked_cross_entropy_sum(problem.hidden, problem.weight, problem.labels, 4,
                                        token_weights=torch.ones(BATCH, SEQ))
    torch.testing.assert_close(plain, ones)


def test_token_weights_of_another_shape_are_refused() -> None:
    problem = make_problem()
    with pytest.raises(ValueError, match="token_weights has shape"):
        chunked_cross_entropy_sum(problem.hidden, problem.weight, problem.labels, token_weights=torch.ones(SEQ))


def test_supervised_positions_are_the_flat_indices_of_the_supervised_labels() -> None:
    labels = torch.tensor([[IGNORE_INDEX, 5, 6], [IGNORE_INDEX, IGNORE_INDEX, 2]])
    assert supervised_positions(labels).tolist() == [1, 2, 5]


@pytest.mark.parametrize("weighted", [False, True])
def test_given_supervised_positions_change_nothing(weighted: bool) -> None:
    """Rows gathered by host-computed indices (no boolean mask on the device): the same loss and gradients,
    bit for bit, as the positions found in the loss."""
    problem = make_problem(seed=6)
    token_weights = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(7)) * 3 if weighted else None
    results = []
    for supervised in (None, supervised_positions(problem.labels)):
        hidden, weight = leaves(problem)
        loss, count = chunked_cross_entropy_sum(hidden, weight, problem.labels, 3, token_weights=token_weights,
                                                supervised=supervised)
        loss.backward()
        results.append((loss, count, hidden.grad, weight.grad))
    (loss_a, count_a, *grads_a), (loss_b, count_b, *grads_b) = results
    assert count_a == count_b and torch.equal(loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
