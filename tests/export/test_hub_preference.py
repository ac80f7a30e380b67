"""Preference training after SFT: TRL's DPOTrainer (its reference model loaded by TRL from the bundle) and
ORPOTrainer on the bundle, on chosen and rejected answers of the embedded tasks."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import transformers

pytest.importorskip("trl")  # test extras that the GPU tier's image may lack
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

from cflib.data.tasks import addition, uppercase
from cflib.export import export_hub
from cflib.model import TRMoEModel, preset, save_checkpoint


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("preference")
    return export_hub(save_checkpoint(TRMoEModel(preset("smoke")).eval(), root / "ckpt"), root / "bundle", echo=None)


def preferences(count: int = 8, seed: int = 0) -> Dataset:
    """Conversational preference rows: the right answer chosen, the same characters reversed rejected."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        prompt, answer, _ = (addition if index % 2 else uppercase)(rng)
        rejected = answer[::-1] if answer[::-1] != answer else answer + answer[-1]
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "chosen": [{"role": "assistant", "content": answer}],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    return Dataset.from_list(rows)


def settings(out: Path) -> dict:
    return dict(output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, seed=0, bf16=False)


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


def test_dpo_loads_its_reference_from_the_bundle_and_separates_chosen_from_rejected(bundle, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bundle), trust_remote_code=True)
    args = DPOConfig(**settings(tmp_path), model_init_kwargs={"trust_remote_code": True})
    trainer = DPOTrainer(model=str(bundle), args=args, train_dataset=preferences(), processing_class=tokenizer)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model  # TRL loaded it from the bundle
    trainer.train()
    losses, margins = logged(trainer, "loss"), logged(trainer, "rewards/margins")
    assert len(losses) == len(margins) == 6
    # Step 1: the policy is its reference, every log-ratio 0, so the loss is -log sigmoid(0).
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5) and margins[0] == pytest.approx(0.0, abs=1e-5)
    assert max(margins[-3:]) > 0.1 and margins[-1] > margins[0]
    assert losses[-1] < losses[0]


def test_dpo_takes_a_loaded_bundle_with_trust_remote_code_in_its_config(bundle, tmp_path):
    """A policy passed as a model: TRL loads the reference from the path the model came from."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bundle), trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bundle), trust_remote_code=True)
    trainer = DPOTrainer(model=model, args=DPOConfig(**settings(tmp_path), trust_remote_code=True),
                         train_dataset=preferences(), processing_class=tokenizer)
    assert type(trainer.ref_model) is type(model) and trainer.ref_model is not model


def test_orpo_trains_the_bundle_without_a_reference(bundle, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bundle), trust_remote_code=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bundle), trust_remote_code=True)
    trainer = ORPOTrainer(model=model, args=ORPOConfig(**settings(tmp_path)), train_dataset=preferences(),
                          processing_class=tokenizer)
    trainer.train()
    margins, odds, nll = (logged(trainer, key) for key in ("rewards/margins", "log_odds_ratio", "nll_loss"))
    assert len(margins) == len(odds) == len(nll) == 6 and all(math.isfinite(value) for value in nll)
    assert margins[-1] > margins[0] and odds[-1] > odds[0]
    assert nll[-1] < nll[0]  # the SFT part of ORPO's loss: the chosen answers' likelihood rises
