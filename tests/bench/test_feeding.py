"""Realistic lengths: the generator, the stream of windows, and the three ways the peer is fed (CPU, smoke size)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cflib.bench.batches import realistic
from cflib.bench.feeding import (
    FEEDS,
    examples_to_fill,
    flattened_batch,
    packed_batch,
    padded_batch,
    realistic_stream,
)
from cflib.bench.peer import PathUnavailable, build_llama, varlen_attention
from cflib.bench.synthetic import EOS_TOKEN_ID, realistic_lengths, write_realistic_shard
from cflib.data.packing import collate_packed
from cflib.data.shards import IGNORE_INDEX, open_shard
from cflib.errors import ParamError
from cflib.model.config import preset

try:
    from sft_shard_helpers import chat_examples, write_shard
except ImportError:
    from tests.sft_shard_helpers import chat_examples, write_shard

SEQ_LEN = 64


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    root = tmp_path_factory.mktemp("realistic") / "shard"
    write_realistic_shard(root, vocab_size=260, seq_len=SEQ_LEN, median=10, train_examples=120, eval_examples=4,
                          seed=5)
    return open_shard(root, "train", vocab_size=260, seq_len=SEQ_LEN)


# --- the generator ------------------------------------------------------------------------

def test_generated_lengths_have_the_documented_shape():
    lengths = realistic_lengths(40_000, median=300, cap=2048, seed=0)
    assert np.median(lengths) == pytest.approx(300, rel=0.03)
    # Mean about 1.35x the median (docs/measuring.md#throughput-against-the-peer-stack): 405 before the cap.
    assert 380 < lengths.mean() < 410
    assert lengths.min() >= 2 and lengths.max() == 2048  # the longest are capped, not dropped
    assert np.array_equal(lengths, realistic_lengths(40_000, median=300, cap=2048, seed=0))
    assert not np.array_equal(lengths, realistic_lengths(40_000, median=300, cap=2048, seed=1))


def test_generated_examples_end_in_eos_with_the_first_third_unsupervised(shard, tmp_path):
    assert np.array_equal(shard.lengths, realistic_lengths(120, 10, SEQ_LEN, seed=5))
    for index in range(len(shard)):
        ids, labels = shard[index]
        length = ids.numel()
        assert int(ids[-1]) == EOS_TOKEN_ID and int(ids[:-1].min()) >= 1  # EOS only where the example ends
        assert (labels[:length // 3] == IGNORE_INDEX).all() and int(labels[-1]) == IGNORE_INDEX
        assert torch.equal(labels[length // 3:-1], ids[length // 3 + 1:])  # causally aligned, the last predicts EOS
    again = write_realistic_shard(tmp_path / "again", 260, SEQ_LEN, 10, 120, 4, seed=5)
    assert (again / "train" / "input_ids.bin").read_bytes() == (shard.directory / "input_ids.bin").read_bytes()


def test_enough_examples_are_generated_for_the_windows_asked():
    count = examples_to_fill(40, SEQ_LEN, median=10, seed=3)
    from cflib.data.packing import pack_examples

    assert len(pack_examples(realistic_lengths(count, 10, SEQ_LEN, 3), SEQ_LEN)) >= 40


# --- the stream ---------------------------------------------------------------------------

def test_every_unit_of_batches_carries_the_same_examples_in_the_same_order(shard):
    stream = realistic_stream(shard, SEQ_LEN, micro=3, warmup_steps=2, timed_steps=4, seed=0)
    windows = stream.window_batches()
    assert len(windows) == 6 and all(len(batch) == 3 for batch in windows)
    assert np.array_equal(np.concatenate(windows), stream.order) and len(set(stream.order.tolist())) == 18
    examples, warmup = stream.example_batches()
    assert np.array_equal(np.concatenate(examples), stream.plan.examples_of(stream.order))
    assert np.array_equal(np.concatenate(examples[:warmup]), stream.plan.examples_of(stream.order[:6]))
    assert all(len(batch) <= 3 for batch in examples)
    assert np.array_equal(np.concatenate(examples[warmup:]), stream.timed_examples())
    summary = stream.summary()
    assert summary["timed_examples"] == len(stream.timed_examples()) and summary["windows"] == 18


def test_a_shard_too_small_for_the_steps_is_refused_naming_it(shard):
    with pytest.raises(ParamError, match=r"shard .*: its 120 examples pack into \d+ windows .* needs 400"):
        realistic_stream(shard, SEQ_LEN, micro=40, warmup_steps=2, timed_steps=8, seed=0)


def test_a_users_shard_feeds_the_realistic_batches(tmp_path):
    root = write_shard(tmp_path / "chats", chat_examples() * 6)
    batches = realistic(str(root), tmp_path / "unused", vocab_size=260, seq_len=SEQ_LEN, median=10, micro=2,
                        warmup_steps=1, timed_steps=2, eval_examples=4, seed=0)
    assert batches.source["shard"] == str(root) and "generated" not in batches.source
    assert batches.stream.summary()["windows"] == 6 and not (tmp_path / "unused").exists()
    with pytest.raises(ParamError, match="pack into .* windows"):
        realistic(str(root), tmp_path / "unused", 260, SEQ_LEN, 10, 8, 1, 2, 4, 0)


def test_a_broken_users_shard_is_refused_before_any_step(tmp_path):
    root = write_shard(tmp_path / "chats", chat_examples())
    (root / "train" / "labels.bin").write_bytes(b"\0" * 4)
    with pytest.raises(ParamError, match="shard: .*labels.bin"):
        realistic(str(root), tmp_path / "unused", 260, SEQ_LEN, 10, 2, 1, 2, 4, 0)


# --- the feeds ----------------------------------------------------------------------------

def test_the_three_feeds_supervise_the_same_tokens(shard):
    stream = realistic_stream(shard, SEQ_LEN, micro=3, warmup_steps=0, timed_steps=1, seed=0)
    windows = stream.window_batches()[0]
    examples = stream.plan.examples_of(windows)
    supervised = shard.supervised_tokens(examples)

    padded = padded_batch(shard, stream.plan, examples)
    assert padded["input_ids"].shape == (len(examples), int(shard.lengths[examples].max()))
    assert padded["attention_mask"].sum(1).tolist() == shard.lengths[examples].tolist()
    assert (padded["labels"][padded["attention_mask"] == 0] == IGNORE_INDEX).all()

    packed = packed_batch(shard, stream.plan, windows)
    ids, labels, _, _ = collate_packed(shard, stream.plan, windows)
    assert torch.equal(packed["input_ids"], ids) and torch.equal(packed["labels"], labels)
    assert packed["attention_mask"].shape == (3, SEQ_LEN) and bool(packed["attention_mask"].all())

    flat = flattened_batch(shard, stream.plan, windows)
    total = int(shard.lengths[examples].sum())
    assert flat["input_ids"].shape == flat["labels"].shape == flat["position_ids"].shape == (1, total)
    assert torch.equal(flat["input_ids"][0], torch.cat([shard[int(i)][0] for i in examples]))
    assert flat["cu_seq_lens_q"].dtype == torch.int32 and flat["cu_seq_lens_q"].tolist() == [0, *np.cumsum(
        shard.lengths[examples]).tolist()]
    assert flat["max_length_q"] == flat["max_length_k"] == int(shard.lengths[examples].max())
    starts = flat["cu_seq_lens_q"][:-1].long()
    assert (flat["position_ids"][0, starts] == 0).all() and int((flat["position_ids"] == 0).sum()) == len(examples)

    for batch in (padded, packed, flat):
        assert int((batch["labels"] != IGNORE_INDEX).sum()) == supervised
    assert {name: feed.unit for name, feed in FEEDS.items()} == {
        "peer_padded": "examples", "peer_packed": "windows", "peer_padding_free": "windows",
        "peer_compile_padding_free": "windows"}
    compiled = FEEDS["peer_compile_padding_free"]  # the same rows as padding-free, into the compiled model
    assert compiled.collate is flattened_batch and compiled.varlen and compiled.compiled
    assert not any(feed.compiled for name, feed in FEEDS.items() if name != "peer_compile_padding_free")


def test_padding_free_positions_keep_each_example_alone_and_the_packed_feed_does_not(shard):
    """Each example alone (padded with its mask) and the flattened row (documents from position_ids, as
    transformers infers them for SDPA) give the same loss; whole windows without masking do not."""
    stream = realistic_stream(shard, SEQ_LEN, micro=2, warmup_steps=0, timed_steps=1, seed=1)
    windows = stream.window_batches()[0]
    examples = stream.plan.examples_of(windows)
    model = build_llama(preset("smoke"), torch.device("cpu"), seed=0).eval()

    def supervised_logits(batch: dict) -> torch.Tensor:
        """Logits of the supervised positions, in example order (every feed keeps the examples' order)."""
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        with torch.no_grad():
            logits = model(**inputs).logits
        return logits[batch["labels"] != IGNORE_INDEX]

    alone = supervised_logits(padded_batch(shard, stream.plan, examples))
    flat = supervised_logits(flattened_batch(shard, stream.plan, windows))
    packed = supervised_logits(packed_batch(shard, stream.plan, windows))
    assert flat.shape == packed.shape == alone.shape
    torch.testing.assert_close(flat, alone, rtol=1e-4, atol=1e-4)
    assert (packed - alone).abs().max() > 1e-3  # later examples of a window attend to earlier ones


def test_the_varlen_kernel_is_chosen_from_what_transformers_can_use(monkeypatch):
    with pytest.raises(PathUnavailable, match="needs a CUDA device; this run is on cpu"):
        varlen_attention(torch.device("cpu"))
    import transformers.utils

    for version in (2, 3, 4):
        monkeypatch.setattr(transformers.utils, f"is_flash_attn_{version}_available", lambda: False, raising=False)
    with pytest.raises(PathUnavailable, match="no varlen attention kernel that transformers .* flash-attn-4"):
        varlen_attention(torch.device("cuda"))
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    assert varlen_attention(torch.device("cuda")) == "flash_attention_2"
    monkeypatch.setattr(transformers.utils, "is_flash_attn_4_available", lambda: True, raising=False)
    assert varlen_attention(torch.device("cuda")) == "flash_attention_4"  # FlashAttention 4 first
