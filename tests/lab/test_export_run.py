"""The train_sft notebook's last steps: a few answers, and the run's Hub bundle with the tokenizer its data was
converted with."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from sft_shard_helpers import chat_examples, write_shard

from cflib.lab.report import export_run, show_answers
from cflib.train import train


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> dict:
    shard = write_shard(tmp_path_factory.mktemp("shard"), chat_examples() * 4)
    return train({"model": "smoke", "data": str(shard), "out_dir": str(tmp_path_factory.mktemp("runs") / "run"),
                  "seq_len": 48, "micro_batch_per_rank": 4, "global_batch": 4, "max_steps": 2,
                  "eval_at_start": False, "exact_match_limit": 0, "device": "cpu"}, progress=False)


def test_a_run_on_byte_tokenized_data_exports_its_best_checkpoint_with_the_byte_tokenizer(record, capsys):
    bundle = export_run(record)
    assert bundle == Path(record["out_dir"]) / "hub"
    assert json.loads((bundle / "config.json").read_text())["eos_token_id"] == 0
    assert (bundle / "tokenizer.json").is_file() and (bundle / "modeling_tr_hash_moe.py").is_file()
    assert "exported" in capsys.readouterr().out


def test_data_of_an_unknown_tokenizer_gets_the_command_that_names_one(record, tmp_path, capsys):
    eval_index = Path(record["data"]["root"]) / "eval" / "sft.idx.json"
    index = json.loads(eval_index.read_text())
    eval_index.write_text(json.dumps({**index, "vocab_size": 32000}))  # no conversion block, not the byte vocabulary
    try:
        assert export_run(record, tmp_path / "bundle") is None
    finally:
        eval_index.write_text(json.dumps(index))
    assert not (tmp_path / "bundle").exists()
    assert f"python -m cflib.export hub {record['out_dir']} {tmp_path / 'bundle'} --tokenizer" in capsys.readouterr().out


def test_a_lora_run_answers_and_is_merged_into_its_base_then_exported(record, tmp_path_factory, capsys):
    lora = train({"model": "smoke", "data": record["data"]["root"], "init_checkpoint": record["checkpoints"]["best"],
                  "out_dir": str(tmp_path_factory.mktemp("runs") / "lora"), "full_parameter": False, "lora_rank": 4,
                  "lora_alpha": 8, "seq_len": 48, "micro_batch_per_rank": 4, "global_batch": 4, "max_steps": 2,
                  "eval_at_start": False, "exact_match_limit": 0, "device": "cpu"}, progress=False)
    show_answers(lora, n=2)  # its best checkpoint holds adapters: answered by the base with them merged in
    shown = capsys.readouterr().out
    assert f"best checkpoint {lora['checkpoints']['best']}, greedy, 2 held-out prompts" in shown
    assert shown.count("expected") == 2
    bundle = export_run(lora)
    assert (Path(lora["out_dir"]) / "merged" / "model.safetensors").is_file()
    assert (bundle / "model.safetensors").is_file() and (bundle / "tokenizer.json").is_file()
