"""cflib.train.held_out: final-turn split, token-mean eval loss, greedy exact match and its scores."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from cflib.data.shards import open_shard
from cflib.model.config import ModelConfig
from cflib.model.decoder import TRMoEModel
from cflib.data.mixture import MixedPartition
from cflib.train.held_out import eval_loss, exact_match, final_turn, score_answers, scored_examples

try:
    import sft_shard_helpers as h
    from tiny_models import trained_model
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests import sft_shard_helpers as h
    from tests.tiny_models import trained_model

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


# --- exact_match ----------------------------------------------------------------------------------

@pytest.fixture
def eval_shard(tmp_path):
    extra = [h.chat_example(10, "addition", "no-carry", "21+43=", "64"),  # same prompt length as 12+34=
             h.chat_example(11, "reverse", "short", "reverse xyz", "zyx")]
    h.write_shard(tmp_path, h.chat_examples(), h.chat_examples() + extra + [h.two_turn_example()])
    return open_shard(tmp_path, "eval", vocab_size=h.VOCAB)


def group_keys(shard) -> set[str]:
    return {f"{row['task']}/{row['group']}" for row in shard.rows}


def answers(shard, right: set[str] = frozenset(), run_on: set[str] = frozenset()) -> dict:
    """{index: (target, generated)}: the target itself for examples of the `right` tasks, an EOS alone
    otherwise; for `run_on` tasks the right answer with another token where its EOS should be."""
    out = {}
    for index in range(len(shard)):
        _, target = final_turn(*shard[index])
        target = target.tolist()
        task = shard.rows[index]["task"]
        generated = target if task in right else [h.EOS]
        out[index] = (target, target[:-1] + h.TOKENIZER.encode("7") if task in run_on else generated)
    return out


def test_scores_per_task_and_group(eval_shard):
    tasks = [row["task"] for row in eval_shard.rows]
    perfect = score_answers(eval_shard, answers(eval_shard, right={"addition", "reverse", "dialog"}))
    assert perfect["exact_match"] == {"addition": 1.0, "dialog": 1.0, "reverse": 1.0, "overall": 1.0}
    assert perfect["exact_match_by_group"] == {key: 1.0 for key in group_keys(eval_shard)}
    assert perfect["examples"] == len(eval_shard)
    half = score_answers(eval_shard, answers(eval_shard, right={"addition"}))
    assert half["exact_match"] == {"addition": 1.0, "dialog": 0.0, "reverse": 0.0,
                                   "overall": pytest.approx(tasks.count("addition") / len(tasks))}
    assert half["exact_match_by_group"] == {key: float(key.startswith("addition/")) for key in group_keys(eval_shard)}
    sample = half["samples"][0]
    assert sample["hit"] and h.TOKENIZER.decode(sample["generated_ids"]) == eval_shard.rows[0]["answer"]


def test_a_limit_scores_every_task_and_source_in_turn(tmp_path):
    """A held-out file sorted by task: its first prompts would be one task's, so a limit takes the tasks in turn,
    each task's prompts in file order; a mixture's sources alternate within every round."""
    by_task = sorted(h.chat_examples(), key=lambda example: example.meta["task"]) + [h.two_turn_example()]
    shard = open_shard(h.write_shard(tmp_path / "sorted", by_task), "eval", vocab_size=h.VOCAB)
    tasks = [row["task"] for row in shard.rows]
    assert tasks == ["addition"] * 3 + ["reverse"] * 2 + ["dialog"]
    assert [tasks[i] for i in scored_examples(shard, 5)] == ["addition", "reverse", "dialog", "addition", "reverse"]
    assert scored_examples(shard, 5)[3] == 1  # the second addition prompt in file order
    assert scored_examples(shard, None).tolist() == scored_examples(shard, 60).tolist() == list(range(6))
    other = open_shard(h.write_shard(tmp_path / "other", [h.two_turn_example()] * 2), "eval", vocab_size=h.VOCAB)
    mixed = MixedPartition([shard, other], ["sorted", "other"])
    assert scored_examples(mixed, 2).tolist() == [0, 6]  # one prompt of each source
    assert [tasks[i] if i < 6 else "other" for i in scored_examples(mixed, 5)] == [
        "addition", "other", "reverse", "dialog", "addition"]


def test_an_answer_that_runs_on_past_its_eos_is_no_hit(eval_shard):
    result = score_answers(eval_shard, answers(eval_shard, right={"addition", "reverse"}, run_on={"addition"}))
    assert result["exact_match"]["addition"] == 0.0 and result["exact_match"]["reverse"] == 1.0


def old_exact_match_loop(model, shard, batch_size: int) -> dict[int, list[int]]:
    """Exact match's decoding before the KV cache, kept as the reference: prompts of equal length batched,
    one full forward per new token, as many new tokens as the answer has."""
    by_prompt_length = defaultdict(list)
    for index in range(len(shard)):
        prompt, target = final_turn(*shard[index])
        by_prompt_length[prompt.numel()].append((index, prompt, target))
    generated = {}
    with torch.no_grad():
        for items in by_prompt_length.values():
            for start in range(0, len(items), batch_size):
                chunk = items[start:start + batch_size]
                tokens = torch.stack([prompt for _, prompt, _ in chunk])
                for _ in range(max(target.numel() for _, _, target in chunk)):
                    last = model(tokens)[:, -1]
                    next_token = (last @ model.head_weight.t().to(last.dtype)).argmax(-1)
                    tokens = torch.cat([tokens, next_token[:, None]], dim=1)
                for row, (index, prompt, target) in enumerate(chunk):
                    generated[index] = tokens[row, prompt.numel():prompt.numel() + target.numel()].tolist()
    return generated


@pytest.mark.parametrize("batch_size", [64, 3])
def test_exact_match_decodes_as_the_loop_without_a_cache(eval_shard, batch_size):
    model = trained_model([example.input_ids for example in h.chat_examples()], h.VOCAB, steps=25)
    model.train()
    reference = old_exact_match_loop(model, eval_shard, batch_size)
    result = exact_match(model, eval_shard, batch_size=batch_size)
    assert model.training
    hits = [reference[i] == final_turn(*eval_shard[i])[1].tolist() for i in range(len(eval_shard))]
    assert 0 < sum(hits) < len(hits)  # a model half right: both kinds of answer are compared
    assert [s["generated_ids"] for s in result["samples"]] == [reference[i] for i in range(len(result["samples"]))]
    assert [s["hit"] for s in result["samples"]] == hits[:len(result["samples"])]
    assert result["exact_match"]["overall"] == pytest.approx(sum(hits) / len(hits))
    assert exact_match(model, eval_shard, limit=3)["examples"] == 3
