"""The card already in an export folder, read back: whatever README.md holds, a folder without cflib's card.

`python -m cflib.export hub RUN OUT --push ORG/NAME` reads OUT's README.md to see whether OUT already holds the
publication (an interrupted push is resumed); a README.md someone else wrote, in another encoding, or hostile, is
no card cflib wrote, never a traceback.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import cflib.export.model_card
from cflib.export.model_card import CARD_FILE, data_manifests, published, published_checkpoint
from cflib.export.publish import holds_publication

CARD = {"library_name": "transformers", "cflib": {"kind": "bundle", "repo_id": None,
                                                    "checkpoint": {"name": "best", "run": "run", "sha256": "0" * 64}}}


def card(body: str = "# A model\n") -> str:
    return f"---\n{yaml.safe_dump(CARD)}---\n\n{body}"


def test_a_card_cflib_wrote_is_read_back(tmp_path: Path) -> None:
    (tmp_path / CARD_FILE).write_text(card())
    assert published(tmp_path) == CARD["cflib"]
    assert published_checkpoint(tmp_path) == CARD["cflib"]["checkpoint"]


@pytest.mark.parametrize("content", [
    "---\nlicense: mit\n---\n".encode("utf-16"),  # saved by an editor as UTF-16
    card().encode() + b"\xff\xfe caf\xe9\n",  # cflib's card, then a Latin-1 line someone added
    b"\x89PNG\r\n\x1a\n\x00\x00",  # not text at all
    b"---\n" + b"[" * 100_000 + b"\n---\n",  # front matter nested past PyYAML's recursion
], ids=["utf-16", "latin-1-line", "binary", "deep-yaml"])
def test_a_readme_that_is_no_readable_card_is_no_card(tmp_path: Path, content: bytes) -> None:
    (tmp_path / CARD_FILE).write_bytes(content)
    assert published(tmp_path) == {}
    assert published_checkpoint(tmp_path) is None
    # The folder then holds no publication: export refuses it as an existing folder, by name, instead of crashing.
    assert not holds_publication(tmp_path, tmp_path / "best", "bundle")


def test_a_readme_past_the_bound_is_not_read_whole(tmp_path: Path) -> None:
    """A card is kilobytes; a README.md of gigabytes is not read into memory to find out it is no card."""
    (tmp_path / CARD_FILE).write_text(card("x" * cflib.export.model_card.CARD_BYTES))
    assert published(tmp_path) == {}


def test_a_source_held_out_only_is_named_by_its_eval_partition_alone(tmp_path: Path) -> None:
    """A source of weight 0 is never trained on and may hold no train/: the card names its eval/ alone."""
    for root, partitions in (("trained", ("train", "eval")), ("held_out", ("eval",))):
        for partition in partitions:
            (tmp_path / root / partition).mkdir(parents=True)
            (tmp_path / root / partition / "sft.idx.json").write_text('{"examples": 3, "sha256": {"a": "b"}}')
    plan = [{"name": "trained", "weight": 1.0, "root": str(tmp_path / "trained")},
            {"name": "held_out", "weight": 0.0, "root": str(tmp_path / "held_out")}]
    trained, held_out = data_manifests({"data": {"mixture": {"sources": plan}}})["sources"]
    assert set(trained) == {"name", "weight", "root", "train", "eval"}
    assert set(held_out) == {"name", "weight", "root", "eval"} and held_out["eval"]["examples"] == 3
    meta = {"checkpoint": {"name": "best", "sha256": "0" * 64}, "base": {"source": "preset smoke", "sha256": None},
            "data": {"sources": [trained, held_out]}, "throughput": {}}
    rows = [row for row in cflib.export.model_card._training(meta).splitlines() if " data | " in row]
    assert rows == ["| train data | 3 examples of trained (weight 1); manifest SHA-256: a `b` |",
                    "| eval data | 3 examples of trained (weight 1); manifest SHA-256: a `b` |",
                    "| eval data | 3 examples of held_out (held out only: weight 0); manifest SHA-256: a `b` |"]


@pytest.mark.parametrize("warmup, recipe", [
    ({"warmup_ratio": 0.05, "warmup_steps": 50}, "lr 0.001, warmup_steps 50, lr_schedule cosine"),
    ({"warmup_ratio": 0.05, "warmup_steps": None}, "lr 0.001, warmup_ratio 0.05, lr_schedule cosine"),
    ({"warmup_ratio": 0.05, "warmup_steps": None, "lora_plus_ratio": 16.0},  # LoRA+'s ratio, where a run set one
     "lora_plus_ratio 16.0, lr 0.001, warmup_ratio 0.05, lr_schedule cosine"),
    ({"warmup_steps": 5, "loss_type": "sft_cross_entropy", "adam_epsilon": 1e-8, "overlong_examples": "error"},
     "lr 0.001, warmup_steps 5, lr_schedule cosine"),  # at their defaults: not named
    ({"warmup_steps": 5, "seq_len": 8192, "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": None,
      "max_position_embeddings": None},  # a longer context, where a run set one
     "seq_len 8192, rope_scaling {'rope_type': 'linear', 'factor': 4.0}, lr 0.001, warmup_steps 5, lr_schedule cosine"),
    ({"warmup_steps": 5, "loss_type": "dft", "adam_epsilon": 1e-6, "overlong_examples": "drop",
      "frozen_modules": ["experts"], "frozen_layers": [0, 1]},
     "frozen_modules ['experts'], frozen_layers [0, 1], loss_type dft, overlong_examples drop, lr 0.001, "
     "adam_epsilon 1e-06, warmup_steps 5, lr_schedule cosine"),
    ({"warmup_steps": 5, "teacher_checkpoint": None, "distill_ratio": 0.5, "distill_temperature": 1.0},
     "lr 0.001, warmup_steps 5, lr_schedule cosine"),  # no teacher: nothing distilled, the ratio not named
    ({"warmup_steps": 5, "teacher_checkpoint": "/runs/big/checkpoints/best", "distill_ratio": 0.5,
      "distill_temperature": 2.0},  # a teacher: its ratio and temperature named, whatever their values
     "teacher_checkpoint /runs/big/checkpoints/best, distill_ratio 0.5, distill_temperature 2.0, lr 0.001, "
     "warmup_steps 5, lr_schedule cosine"),
])
def test_the_recipe_names_the_warm_up_the_run_took_and_what_it_set(warmup, recipe):
    """warmup_steps, where set, wins over warmup_ratio: the card's recipe leaves the unused ratio out; the loss, the
    frozen weights, the overlong examples' fate, AdamW's epsilon and a teacher are named where a run set them."""
    meta = {"checkpoint": {"name": "best", "sha256": "0" * 64}, "base": {"source": "preset smoke", "sha256": None},
            "data": {"sources": []}, "throughput": {},
            "training_parameters": {"lr": 0.001, **warmup, "lr_schedule": "cosine"}}
    rows = [row for row in cflib.export.model_card._training(meta).splitlines() if row.startswith("| recipe |")]
    assert rows == [f"| recipe | {recipe} |"]
