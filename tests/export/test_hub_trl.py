"""The bundle trained by TRL's SFTTrainer and transformers' Trainer: cflib's loss, exact accumulation, checkpointing."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers  # the test extra, with trl and datasets: the bundle is for them; cflib never imports them

pytest.importorskip("trl")  # test extras that the GPU tier's image may lack
from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from cflib.data.tasks import addition, uppercase
from cflib.export import export_hub
from cflib.model import TRMoEModel, preset, save_checkpoint
from cflib.ops.loss import cross_entropy_mean


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[TRMoEModel, Path]:
    torch.manual_seed(0)
    model = TRMoEModel(preset("smoke")).eval()
    root = tmp_path_factory.mktemp("trl")
    return model, export_hub(save_checkpoint(model, root / "ckpt"), root / "bundle", echo=None)


def conversations(count: int = 16, seed: int = 0) -> Dataset:
    """Chat rows of the embedded tasks, both kinds mixed: answers of unequal lengths (four digits, six letters)
    and prompts of unequal lengths, so micro-batches carry unequal numbers of supervised tokens."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        prompt, answer, _ = (addition if index % 2 else uppercase)(rng)
        if index % 3 == 0:
            prompt = f"please, {prompt}"
        rows.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]})
    return Dataset.from_list(rows)


def load(bundle: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bundle), trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bundle), trust_remote_code=True)
    return model, tokenizer


def record_batches(model) -> list[dict]:
    """Every batch the trainer feeds the model, as it is fed."""
    batches: list[dict] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: batches.append(
        {key: value.clone() for key, value in kwargs.items() if torch.is_tensor(value)}), with_kwargs=True)
    return batches


def cflib_loss(model: TRMoEModel, batch: dict) -> float:
    """cflib's loss of a batch: its decoder's hidden states (packed rows as cflib's packed windows, with document
    ids from the restarting positions), the tied head, the mean over supervised next tokens."""
    ids, labels = batch["input_ids"], batch["labels"]
    documents = None
    if "attention_mask" not in batch:
        documents = (batch["position_ids"] == 0).long().cumsum(-1)
    targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    with torch.no_grad():
        return float(cross_entropy_mean(model(ids, documents), model.head_weight, targets))


def sft_config(out: Path, **overrides) -> SFTConfig:
    settings = dict(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                    logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
                    dataset_num_proc=None, max_length=None, bf16=False)  # fp32: cflib's loss to 1e-5
    return SFTConfig(**{**settings, **overrides})


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_sft_trainer_trains_and_its_first_loss_is_cflibs(pair, tmp_path: Path, padding_free: bool):
    reference, bundle = pair
    model, tokenizer = load(bundle)
    batches = record_batches(model)
    trainer = SFTTrainer(model=model, args=sft_config(tmp_path, padding_free=padding_free),
                         train_dataset=conversations(), processing_class=tokenizer)
    trainer.train()
    first = batches[0]
    if padding_free:  # one row of examples, positions restarting per example: each attends only to itself
        assert first["input_ids"].shape[0] == 1 and "attention_mask" not in first
        assert int((first["position_ids"] == 0).sum()) == 4
    else:
        assert first["input_ids"].shape[0] == 4 and not bool(first["attention_mask"].all())
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    assert losses[0] == pytest.approx(cflib_loss(reference, first), abs=1e-5)


def tokenized(tokenizer) -> Dataset:
    """What a transformers Trainer user feeds: the chat template's ids, the prompt's labels masked."""
    def encode(row: dict) -> dict:
        prompt = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        ids, prompt_ids = tokenizer(full)["input_ids"], tokenizer(prompt)["input_ids"]
        return {"input_ids": ids, "labels": [-100] * len(prompt_ids) + ids[len(prompt_ids):]}
    return conversations().map(encode, remove_columns=["messages"])


def one_sgd_step(bundle: Path, out: Path, micro_batch: int, accumulation: int,
                 checkpointing: bool = False) -> tuple[dict[str, torch.Tensor], float]:
    """The parameters' change after one optimizer step of plain SGD at lr 1 (the step is minus the gradient),
    no clipping, and the step's logged loss."""
    model, tokenizer = load(bundle)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=1, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant",
        max_grad_norm=0.0, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, seed=0,
        gradient_checkpointing=checkpointing, remove_unused_columns=False, bf16=False)
    collator = transformers.DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=tokenized(tokenizer), data_collator=collator)
    trainer.train()
    assert all(getattr(layer, "gradient_checkpointing", False) == checkpointing for layer in model.layers)
    step = {name: param.detach() - before[name] for name, param in model.named_parameters()}
    return step, next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)


def test_trainer_accumulation_of_four_micro_batches_of_one_equals_one_batch_of_four(pair, tmp_path: Path):
    _, bundle = pair
    whole, whole_loss = one_sgd_step(bundle, tmp_path / "a", micro_batch=4, accumulation=1)
    accumulated, accumulated_loss = one_sgd_step(bundle, tmp_path / "b", micro_batch=1, accumulation=4)
    assert accumulated_loss == pytest.approx(whole_loss, abs=1e-5)
    assert max(float(step.abs().max()) for step in whole.values()) > 1e-3  # a step that moved the weights
    for name, step in whole.items():
        torch.testing.assert_close(accumulated[name], step, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_with_gradient_checkpointing_takes_the_same_step(pair, tmp_path: Path):
    _, bundle = pair
    plain, plain_loss = one_sgd_step(bundle, tmp_path / "a", micro_batch=4, accumulation=1)
    checkpointed, checkpointed_loss = one_sgd_step(bundle, tmp_path / "b", micro_batch=4, accumulation=1,
                                                   checkpointing=True)
    assert checkpointed_loss == pytest.approx(plain_loss, abs=1e-6)
    for name, step in plain.items():
        torch.testing.assert_close(checkpointed[name], step, rtol=0, atol=1e-6, msg=name)


def test_assistant_only_loss_supervises_what_the_converter_supervises(pair, tmp_path: Path):
    """The chat template marks each assistant turn (reasoning, answer, end of sequence) as generated: TRL's
    assistant_only_loss trains on the tokens the converter supervises with all_assistant_turns, no prompt token."""
    from cflib.data import ChatTemplate, Conversation
    from cflib.data.rendering import make_renderer

    _, bundle = pair
    model, tokenizer = load(bundle)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+34="},
                {"role": "assistant", "content": "46", "reasoning_content": "6 carry 0"},
                {"role": "user", "content": "reverse ab"}, {"role": "assistant", "content": "ba"}]
    trainer = SFTTrainer(model=model, args=sft_config(tmp_path, assistant_only_loss=True, max_steps=1),
                         train_dataset=Dataset.from_list([{"messages": messages}]), processing_class=tokenizer)
    example = trainer.train_dataset[0]
    ids, labels = make_renderer("byte", ChatTemplate(), "all_assistant_turns").render(Conversation(messages))
    assert example["input_ids"] == ids
    # TRL's labels are the ids where trained (transformers shifts them); the converter's are already shifted.
    assert [j for j, label in enumerate(example["labels"]) if label != -100] == [
        j + 1 for j, label in enumerate(labels) if label != -100]
    trainer.train()  # and it trains on them
