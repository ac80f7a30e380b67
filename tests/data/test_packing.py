"""Packing whole examples into windows, and document masking: packed losses equal unpacked ones; a mixture's
windows hold several sources' examples, and each epoch's draw is packed anew."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from sft_shard_helpers import EOS, write_shard
from tiny_models import random_ids, tiny_model

from cflib.data.mixture import MixedPartition, plan_mixture
from cflib.data.packing import EpochWindows, collate_packed, pack_examples
from cflib.data.shards import IGNORE_INDEX, Example, open_shard
from cflib.model.fast import checkpoint_layers
from cflib.ops.attention import attend, attention_batch, document_positions, pack_documents
from cflib.ops.loss import chunked_cross_entropy_sum

VOCAB = 50


def random_examples(count: int, seed: int = 0, longest: int = 20) -> list[Example]:
    """Causally aligned examples of random lengths, the second half of each supervised."""
    rng = np.random.default_rng(seed)
    examples = []
    for index in range(count):
        length = int(rng.integers(2, longest + 1))
        ids = rng.integers(1, VOCAB, length).tolist()
        labels = [IGNORE_INDEX] * length
        for j in range(length // 2, length - 1):
            labels[j] = ids[j + 1]
        labels[length - 2] = ids[length - 1]
        examples.append(Example(ids, labels, {"example_id": f"ex-{index}"}))
    return examples


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    root = write_shard(tmp_path_factory.mktemp("packing"), random_examples(23), vocab_size=VOCAB, max_seq_len=20)
    return open_shard(root, "train")


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, shard) -> MixedPartition:
    """Two sources read as one: the module's shard and another of 17 examples (long ones, up to 30 tokens)."""
    other = write_shard(tmp_path_factory.mktemp("other"), random_examples(17, seed=5, longest=30), vocab_size=VOCAB,
                        max_seq_len=30)
    return MixedPartition([shard, open_shard(other, "train")], ["short", "long"])


def test_plan_places_every_example_once_whole_and_within_the_window():
    lengths = np.random.default_rng(1).integers(1, 33, 500)
    plan = pack_examples(lengths, 32)
    assert sorted(plan.members.tolist()) == list(range(500))
    for w in range(len(plan)):
        members = plan.window(w)
        assert lengths[members].sum() + len(members) - 1 <= 32  # one separator between neighbours
    # best fit: far fewer windows than examples, and no two windows that could have been one
    assert len(plan) < 500 * 0.6
    np.testing.assert_array_equal(pack_examples(lengths, 32).members, plan.members)  # computed deterministically


def test_plan_refuses_an_example_longer_than_the_window():
    with pytest.raises(ValueError, match="example 2 has 9 tokens, more than seq_len 8"):
        pack_examples(np.array([3, 4, 9]), 8)


def test_windows_hold_whole_examples_with_unsupervised_eos_separators(shard):
    plan = pack_examples(shard.lengths, 32)
    input_ids, labels, document_ids, example_index = collate_packed(shard, plan, range(len(plan)))
    assert input_ids.shape == (len(plan), 32)
    for w in range(len(plan)):
        cursor = 0
        for document, example in enumerate(plan.window(w)):
            ids, labs = shard[int(example)]
            end = cursor + ids.numel()
            assert torch.equal(input_ids[w, cursor:end], ids) and torch.equal(labels[w, cursor:end], labs)
            assert (document_ids[w, cursor:end] == document).all() and (example_index[w, cursor:end] == example).all()
            if end < 32:  # separator or padding: EOS, never supervised
                assert input_ids[w, end] == EOS and labels[w, end] == IGNORE_INDEX
            cursor = end + 1
        assert (labels[w, cursor - 1:] == IGNORE_INDEX).all()
    assert int((labels != IGNORE_INDEX).sum()) == shard.supervised_tokens()
    efficiency = plan.efficiency(shard.lengths, shard.supervised_counts)
    assert efficiency["examples"] == len(shard) and 0 < efficiency["real_fraction"] <= 1
    assert efficiency["supervised_tokens_per_window"] == shard.supervised_tokens() / len(plan)


def test_positions_restart_at_zero_in_each_document():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


def test_packed_documents_give_each_document_its_start_length_and_positions():
    """Worked by hand: row 0 holds documents of 3, 2 and 4 tokens; row 1 one of 9 (the ids restart per row)."""
    documents = pack_documents(torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0, 0]]))
    assert documents.cu_seqlens.tolist() == [0, 3, 5, 9, 18] and documents.cu_seqlens.dtype == torch.int32
    assert documents.max_seqlen == 9
    assert documents.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


def test_packed_documents_of_collated_windows_are_their_examples_and_padding(shard):
    """cu_seqlens from the windows' document ids: each example with the separator after it is one document,
    the tail padding one more, row after row; built on the host from what the pack plan knows."""
    plan = pack_examples(shard.lengths, 32)
    _, _, document_ids, _ = collate_packed(shard, plan, range(len(plan)))
    expected = []
    for w in range(len(plan)):
        lengths = shard.lengths[plan.window(w)]
        starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]])
        expected += (w * 32 + starts).tolist()
        if (end := int(starts[-1] + lengths[-1])) < 32:
            expected.append(w * 32 + end)
    expected.append(32 * len(plan))
    documents = pack_documents(document_ids)
    assert documents.cu_seqlens.tolist() == expected
    assert documents.max_seqlen == int(np.diff(expected).max())


@pytest.mark.parametrize("backend", ["sdpa_mask", pytest.param("flex", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="FlexAttention trains on GPUs (no backward on a CPU)"))])
def test_document_attention_is_attention_of_each_document_alone(backend):
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v = (torch.randn(1, heads, 12, 16, generator=gen).to(device) for heads in (4, 2, 2))
    document_ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3], device=device)
    batch = attention_batch(backend, q.device, q.dtype, q.shape[-1], pack_documents(document_ids))
    out = attend(q, k, v, batch)
    assert batch.kernel == {"sdpa_mask": "sdpa_mask", "flex": "flex_attention"}[backend]
    for start, stop in ((0, 5), (5, 9), (9, 12)):
        alone = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop], is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out[:, :, start:stop], alone, rtol=1e-5, atol=1e-6)


def test_one_document_per_row_is_the_unpacked_model():
    model = tiny_model()
    ids = random_ids(VOCAB, 2, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.zeros_like(ids)), model(ids), rtol=1e-5, atol=1e-5)
    assert model.kernel_path()["attention"] == "torch_sdpa"


def per_example_losses(model, shard, examples) -> dict[int, float]:
    """Each example run alone: its summed cross-entropy."""
    losses = {}
    for example in examples:
        ids, labels = shard[int(example)]
        loss, _ = chunked_cross_entropy_sum(model(ids[None]), model.head_weight, labels[None], 7)
        losses[int(example)] = float(loss)
    return losses


@torch.no_grad()
@pytest.mark.parametrize("source", ["shard", "mixed"])
def test_packed_batch_gives_each_example_its_unpacked_loss(source, request):
    """One shard's examples, or two sources' in one window: each one's loss is the loss it has alone."""
    shard = request.getfixturevalue(source)
    model = tiny_model(seed=2)
    plan = pack_examples(shard.lengths, 48)
    input_ids, labels, document_ids, example_index = collate_packed(shard, plan, range(len(plan)))
    hidden = model(input_ids, document_ids)
    assert model.kernel_path()["attention"] == "sdpa_mask"
    alone = per_example_losses(model, shard, plan.members)
    for example, want in alone.items():
        mine = torch.where(example_index == example, labels, IGNORE_INDEX)
        got, count = chunked_cross_entropy_sum(hidden, model.head_weight, mine, 7)
        assert count == shard.supervised_counts[example]
        assert abs(float(got) - want) < 1e-4 * max(1.0, abs(want)), example
    # Without the document mask the same windows give other losses: the mask is doing the work.
    leaky = model(input_ids)
    example = int(plan.window(0)[1])
    mine = torch.where(example_index == example, labels, IGNORE_INDEX)
    assert abs(float(chunked_cross_entropy_sum(leaky, model.head_weight, mine, 7)[0]) - alone[example]) > 1e-3


def test_packed_gradients_equal_the_sum_of_unpacked_gradients(shard):
    model = tiny_model(seed=3)
    plan = pack_examples(shard.lengths, 48)
    windows = range(min(len(plan), 3))
    input_ids, labels, document_ids, _ = collate_packed(shard, plan, windows)
    loss, _ = chunked_cross_entropy_sum(model(input_ids, document_ids), model.head_weight, labels, 7)
    loss.backward()
    packed = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for example in plan.examples_of(windows):
        ids, labs = shard[int(example)]
        chunked_cross_entropy_sum(model(ids[None]), model.head_weight, labs[None], 7)[0].backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_activation_checkpointing_keeps_packed_gradients():
    ids = random_ids(VOCAB, 1, 32, seed=4)
    document_ids = torch.tensor([[0] * 6 + [1] * 8 + [2] * 4 + [3] * 10 + [4] * 4])
    labels = torch.roll(ids, -1)
    grads = []
    for grad_ckpt in (False, True):
        model = checkpoint_layers(tiny_model(seed=6).train(), grad_ckpt)
        chunked_cross_entropy_sum(model(ids, document_ids), model.head_weight, labels, 16)[0].backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def windows_hold_their_examples(data, plan, windows, input_ids, labels, document_ids, example_index) -> None:
    """Row r of the collated tensors is window windows[r]: its examples' tokens in order, an unsupervised EOS after
    each, the tail unsupervised; each position carries its example's document and row."""
    seq_len = input_ids.shape[1]
    for row, w in enumerate(windows):
        cursor = 0
        for document, example in enumerate(plan.window(w)):
            ids, labs = data[int(example)]
            end = cursor + ids.numel()
            assert torch.equal(input_ids[row, cursor:end], ids) and torch.equal(labels[row, cursor:end], labs)
            assert (document_ids[row, cursor:end] == document).all()
            assert (example_index[row, cursor:end] == example).all()
            if end < seq_len:
                assert input_ids[row, end] == EOS and labels[row, end] == IGNORE_INDEX
            cursor = end + 1
        assert (labels[row, cursor - 1:] == IGNORE_INDEX).all()


def test_a_mixture_s_windows_hold_whole_examples_of_several_sources(mixed):
    plan = pack_examples(mixed.lengths, 48)
    windows = range(len(plan))
    columns = collate_packed(mixed, plan, windows)
    windows_hold_their_examples(mixed, plan, windows, *columns)
    sources_of_window = [set(mixed.source_of[plan.window(w)].tolist()) for w in windows]
    assert any(len(sources) == 2 for sources in sources_of_window)  # the case to check: sources side by side
    assert int((columns[1] != IGNORE_INDEX).sum()) == mixed.supervised_tokens()


def test_a_mixture_of_one_source_collates_as_its_shard(shard):
    """The mixture's gather, one source at a time, against the shard's own: the same tensors, bit for bit."""
    plan = pack_examples(shard.lengths, 32)
    alone = collate_packed(shard, plan, range(len(plan)))
    for got, want in zip(collate_packed(MixedPartition([shard], ["only"]), plan, range(len(plan))), alone):
        assert torch.equal(got, want)


def test_each_epoch_s_draw_is_packed_anew_and_numbered_across_the_run(mixed):
    """A mixture's windows: each epoch's hold exactly its draw (repeats included), planned from (seed, epoch)
    alone, numbered epoch after epoch; asking for a later epoch first plans the ones before it."""
    mixture = plan_mixture(mixed.source_names, ["a", "b"], [0.5, 0.5], [len(part) for part in mixed.parts], 50,
                           seed=3)  # 25 of the 17 long examples an epoch: some drawn twice
    windows = EpochWindows(mixture.epoch, mixed.lengths, 48)
    third = windows.of_epoch(3)
    assert len(windows.epochs) == 3 and len(windows) == sum(len(windows.of_epoch(e)) for e in (1, 2, 3))
    again = EpochWindows(mixture.epoch, mixed.lengths, 48)
    for epoch in (1, 2, 3):
        packed = windows.of_epoch(epoch)
        assert sorted(packed.members.tolist()) == sorted(mixture.epoch(epoch).tolist())
        for w in range(len(packed)):
            assert mixed.lengths[packed.window(w)].sum() + len(packed.window(w)) - 1 <= 48
            np.testing.assert_array_equal(windows.window(windows.first_window(epoch) + w), packed.window(w))
        np.testing.assert_array_equal(again.of_epoch(epoch).members, packed.members)  # deterministic
        np.testing.assert_array_equal(again.of_epoch(epoch).offsets, packed.offsets)
    assert windows.first_window(3) == len(windows) - len(third)
    assert not np.array_equal(windows.of_epoch(1).members, windows.of_epoch(2).members)  # another draw
    all_windows = range(len(windows))
    assert len(windows.examples_of(all_windows)) == 3 * 50
    efficiency = windows.efficiency(mixed.lengths, mixed.supervised_counts)
    assert (efficiency["windows"], efficiency["examples"], efficiency["epochs"]) == (len(windows), 150, 3)
    assert efficiency["supervised_tokens_per_window"] == sum(
        mixed.supervised_tokens(mixture.epoch(e)) for e in (1, 2, 3)) / len(windows)
