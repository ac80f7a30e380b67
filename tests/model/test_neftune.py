"""NEFTune's embedding noise (cflib.model.neftune): its bound and distribution, off outside training, the embedding's
gradient passed through, each rank's own stream, and the model it is attached to unchanged but for the noise."""
from __future__ import annotations

import math

import pytest
import torch
from tiny_models import random_ids, tiny_model

from cflib.model.lora import LoraSettings, attach_lora
from cflib.model.neftune import EmbeddingNoise, attach_noise, noise_generator, noise_seed
from cflib.ops.loss import supervised_positions
from cflib.train.batch import MicroBatch
from cflib.train.graphs import padded, static_shape


def _noise(alpha: float, h: torch.Tensor, lengths: torch.Tensor | None, seed: int = 0) -> torch.Tensor:
    module = EmbeddingNoise(alpha).train()
    module.generator = torch.Generator().manual_seed(seed)
    return module(h, lengths) - h


def test_the_noise_is_uniform_within_alpha_over_sqrt_of_each_example_s_length_times_width():
    """Each token's noise lies in +-alpha / sqrt(L d), L its own example's tokens (here a row of two examples of 7
    and 57 tokens beside a row of one), filling that range uniformly: mean 0, variance bound^2 / 3."""
    alpha, width = 5.0, 64
    h = torch.randn(2, 64, width)
    lengths = torch.tensor([[7] * 7 + [57] * 57, [64] * 64], dtype=torch.int32)
    noise = _noise(alpha, h, lengths)
    bound = alpha / torch.sqrt(lengths.float() * width)[..., None]
    assert bool((noise.abs() <= bound * (1 + 1e-6)).all())
    scaled = noise / bound  # U(-1, 1) wherever the bound is
    assert scaled.abs().max() > 0.99 and abs(float(scaled.mean())) < 0.03
    assert float(scaled.var()) == pytest.approx(1 / 3, rel=0.05)
    for length in (7, 57, 64):  # each example's own scale, not the row's or the batch's
        picked = noise[lengths == length]
        assert float(picked.abs().max()) == pytest.approx(alpha / math.sqrt(length * width), rel=0.02)
    # Without lengths (a forward of a caller of its own) L is the row length, TRL's padded length.
    assert float(_noise(alpha, h, None).abs().max()) == pytest.approx(alpha / math.sqrt(64 * width), rel=0.02)


def test_no_noise_outside_training_mode():
    h = torch.randn(2, 8, 16)
    module = EmbeddingNoise(5.0).eval()
    assert module(h, torch.full((2, 8), 8)) is h and module.last_form == "none"
    assert module.train()(h, torch.full((2, 8), 8)).ne(h).all() and module.last_form == "neftune"


def test_the_embedding_s_gradient_passes_the_noise_unchanged():
    h = torch.randn(2, 8, 16, requires_grad=True)
    upstream = torch.randn(2, 8, 16)
    (_noise(5.0, h, torch.full((2, 8), 8)) + h).backward(upstream)  # d(noise + h)/dh, the noise carrying none
    torch.testing.assert_close(h.grad, upstream, rtol=0, atol=0)


def test_a_model_with_noise_computes_as_without_it_but_for_the_noise():
    """Attached to a model: the same state dict; in eval mode the same outputs, bit for bit; in training mode other
    outputs, and a gradient for every embedding row read."""
    ids = random_ids(50, 2, 12)
    lengths = torch.full((2, 12), 12)
    plain, noisy = tiny_model(seed=1), attach_noise(tiny_model(seed=1), 5.0)
    assert noisy.state_dict().keys() == plain.state_dict().keys()
    assert attach_noise(tiny_model(seed=1), 0.0).embedding_noise is None
    torch.testing.assert_close(noisy(ids, example_lengths=lengths), plain(ids), rtol=0, atol=0)
    noisy.train().embedding_noise.generator = torch.Generator().manual_seed(0)
    out = noisy(ids, example_lengths=lengths)
    assert not torch.equal(out, plain(ids)) and noisy.kernel_path()["embedding_noise"] == "neftune"
    out.square().sum().backward()
    grad = noisy.embed_tokens.weight.grad
    assert grad is not None and bool(grad[ids.unique()].abs().sum(-1).gt(0).all()) and bool(grad.isfinite().all())


def test_a_lora_model_s_trainable_token_rows_learn_through_the_noise():
    model = attach_lora(tiny_model(seed=2), LoraSettings(rank=2, trainable_tokens=(3, 4)))
    attach_noise(model, 5.0).train()
    ids = torch.tensor([[3, 4, 5, 6, 3, 7]])
    model(ids, example_lengths=torch.full((1, 6), 6)).square().sum().backward()
    rows = model.embed_tokens.token_adapter.trainable_tokens_delta
    assert rows.grad is not None and bool(rows.grad.abs().sum(-1).gt(0).all())
    assert model.embed_tokens.weight.grad is None  # the base embedding stays frozen


def test_each_rank_draws_its_own_stream_the_same_every_time():
    assert noise_seed(0, 0) == noise_seed(0, 0) != noise_seed(0, 1)
    assert len({noise_seed(seed, rank, step) for seed in (0, 1) for rank in (0, 1, 7) for step in (0, 4)}) == 12
    h = torch.zeros(1, 4, 8)

    def drawn(rank: int) -> torch.Tensor:
        module = EmbeddingNoise(1.0).train()
        module.generator = noise_generator(torch.device("cpu"), 3, rank)
        return module(h, None)

    assert torch.equal(drawn(0), drawn(0)) and not torch.equal(drawn(0), drawn(1))


@pytest.mark.parametrize("alpha", [0.0, -1.0, math.nan, math.inf])
def test_the_module_refuses_an_alpha_that_adds_no_noise_or_no_number(alpha):
    with pytest.raises(ValueError, match="neftune_noise_alpha must be a positive finite number"):
        EmbeddingNoise(alpha)


def test_a_static_shape_s_padding_keeps_each_example_s_length():
    """A CUDA graph's static shape pads a dense row with positions after its real tokens: theirs get a length
    too, and the real ones keep their own, so the noise an example gets does not change with the padding."""
    ids = random_ids(50, 2, 40)
    labels = ids.clone()
    labels[:, :10] = -100
    lengths = torch.tensor([[40] * 40, [33] * 40], dtype=torch.int32)
    batch = MicroBatch(ids, labels, None, None, supervised_positions(labels), example_lengths=lengths)
    shape = static_shape(batch, seq_len=512)
    staged = padded(batch, shape, pad_token_id=0)
    assert staged.example_lengths.shape == (2, shape.seq) and shape.seq > 40
    assert torch.equal(staged.example_lengths[:, :40], lengths) and bool((staged.example_lengths[:, 40:] > 0).all())
