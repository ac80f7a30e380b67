"""cflib.train.evaluate: final-turn split, token-mean eval loss, greedy exact match."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cflib.data.shards import open_shard
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.train.evaluate import eval_loss, exact_match, final_turn

try:
    import sft_shard_helpers as h
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests import sft_shard_helpers as h

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=h.VOCAB, max_position_embeddings=64, shared_intermediate_size=32,
            num_experts=2, intermediate_size=16, num_experts_per_tok=2)


# --- final_turn ---------------------------------------------------------------------------------

def test_final_turn_single_turn():
    input_ids, labels = h.TOKENIZER.encode_chat("12+34=", "46")
    prompt, span = final_turn(torch.tensor(input_ids), torch.tensor(labels))
    assert prompt.tolist() == h.TOKENIZER.encode_prompt("12+34=")
    assert span.tolist() == h.TOKENIZER.encode("46") + [h.EOS]


def test_final_turn_two_assistant_turns():
    example = h.two_turn_example()
    prompt, span = final_turn(torch.tensor(example.input_ids), torch.tensor(example.labels))
    first_ids, _ = h.TOKENIZER.encode_chat("hi", "hello")
    assert prompt.tolist() == first_ids + h.TOKENIZER.encode_prompt("reverse dog")
    assert span.tolist() == h.TOKENIZER.encode("god") + [h.EOS]
    # The prompt followed by the span is the example itself (the final EOS is its last token).
    assert prompt.tolist() + span.tolist()[:-1] == list(example.input_ids)[:-1]


# --- eval_loss ----------------------------------------------------------------------------------

@pytest.fixture
def loss_shard(tmp_path):
    h.write_shard(tmp_path, h.chat_examples() + [h.two_turn_example()])
    return open_shard(tmp_path, "eval", vocab_size=h.VOCAB)


def reference_loss(model: TRMoEModel, shard) -> tuple[float, int]:
    """Full logits, one example at a time, no padding: sum of CE over supervised tokens / count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(shard)):
            ids, labels = shard[i]
            logits = (model(ids[None])[0] @ model.head_weight.T).double()
            total += float(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            count += int((labels != -100).sum())
    return total / count, count


@pytest.mark.parametrize("micro_batch", [1, 3])
@pytest.mark.parametrize("training", [True, False])
def test_eval_loss_is_the_token_mean_over_examples(loss_shard, micro_batch, training):
    torch.manual_seed(0)
    model = TRMoEModel(ModelConfig(**TINY))
    with torch.no_grad():  # confident, varied predictions: per-token losses far apart
        model.embed_tokens.weight.normal_(0.0, 0.5)
    model.eval()
    expected, count = reference_loss(model, loss_shard)
    model.train(training)

    result = eval_loss(model, loss_shard, micro_batch, "cpu", loss_chunk_tokens=5)
    assert model.training is training
    assert result["supervised_tokens"] == count == loss_shard.supervised_tokens()
    assert result["examples"] == len(loss_shard)
    assert result["loss"] == pytest.approx(expected, abs=1e-5)
    # The loss of a token mean is not the mean of per-example means: make sure the data tells them apart.
    assert len({int((loss_shard[i][1] != -100).sum()) for i in range(len(loss_shard))}) > 1


# --- exact_match --------------------------------------------------------------------------------

class Oracle(nn.Module):
    """Predicts, for any prefix it knows, the token the labels say comes next; EOS otherwise.

    Hidden size = vocab, head = identity: the hidden state of the last position is the
    one-hot of the predicted token, so `hidden @ head_weight.T` argmaxes to it.
    """

    def __init__(self, shard, tasks: set[str] | None = None) -> None:
        super().__init__()
        self.register_buffer("eye", torch.eye(h.VOCAB))
        self.next_token: dict[tuple[int, ...], int] = {}
        for i in range(len(shard)):
            if tasks is not None and shard.rows[i]["task"] not in tasks:
                continue
            ids, labels = shard[i]
            for j in (labels != -100).nonzero().flatten().tolist():
                self.next_token[tuple(ids[:j + 1].tolist())] = int(labels[j])

    @property
    def head_weight(self) -> torch.Tensor:
        return self.eye

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.zeros(*tokens.shape, h.VOCAB)
        for row, prefix in enumerate(tokens.tolist()):
            hidden[row, -1, self.next_token.get(tuple(prefix), h.EOS)] = 1.0
        return hidden


@pytest.fixture
def eval_shard(tmp_path):
    extra = [h.chat_example(10, "addition", "no-carry", "21+43=", "64"),  # same prompt length as 12+34=
             h.chat_example(11, "reverse", "short", "reverse xyz", "zyx")]
    h.write_shard(tmp_path, h.chat_examples(), h.chat_examples() + extra)
    return open_shard(tmp_path, "eval", vocab_size=h.VOCAB)


def group_keys(shard) -> set[str]:
    return {f"{row['task']}/{row['group']}" for row in shard.rows}


@pytest.mark.parametrize("batch_size", [1, 64])
def test_exact_match_oracle_scores_one(eval_shard, batch_size):
    oracle = Oracle(eval_shard)
    oracle.train()
    result = exact_match(oracle, eval_shard, "cpu", batch_size=batch_size)
    assert oracle.training
    assert result["examples"] == len(eval_shard)
    assert result["exact_match"] == {"addition": 1.0, "reverse": 1.0, "overall": 1.0}
    assert result["exact_match_by_group"] == {key: 1.0 for key in group_keys(eval_shard)}
    for sample in result["samples"]:
        row = next(r for r in eval_shard.rows if r["example_id"] == sample["example_id"])
        assert sample["hit"] and h.TOKENIZER.decode(sample["generated_ids"]) == row["answer"]


def test_exact_match_always_eos_scores_zero(eval_shard):
    result = exact_match(Oracle(eval_shard, tasks=set()), eval_shard, "cpu")
    assert result["exact_match"] == {"addition": 0.0, "reverse": 0.0, "overall": 0.0}
    assert set(result["exact_match_by_group"].values()) == {0.0}


def test_exact_match_rates_per_task_and_group(eval_shard):
    result = exact_match(Oracle(eval_shard, tasks={"addition"}), eval_shard, "cpu", batch_size=2)
    tasks = [row["task"] for row in eval_shard.rows]
    assert result["exact_match"] == {"addition": 1.0, "reverse": 0.0,
                                     "overall": pytest.approx(tasks.count("addition") / len(tasks))}
    assert result["exact_match_by_group"] == {key: float(key.startswith("addition/"))
                                              for key in group_keys(eval_shard)}


def test_exact_match_limit(eval_shard):
    result = exact_match(Oracle(eval_shard, tasks={"addition"}), eval_shard, "cpu", limit=3)
    first = [row["task"] for row in eval_shard.rows[:3]]
    assert result["examples"] == 3
    assert result["exact_match"]["overall"] == pytest.approx(first.count("addition") / 3)


def test_exact_match_needs_the_eos(tmp_path):
    """An answer that is right but runs on instead of stopping is not a hit."""
    h.write_shard(tmp_path, h.chat_examples()[:1])
    shard = open_shard(tmp_path, "eval")
    oracle = Oracle(shard)
    ids, _ = shard[0]
    oracle.next_token[tuple(ids[:-1].tolist())] = h.TOKENIZER.encode("7")[0]  # replace the EOS
    assert exact_match(oracle, shard, "cpu")["exact_match"]["overall"] == 0.0
