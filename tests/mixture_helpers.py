"""Shard roots of the embedded tasks, one per task, converted as a user converts data, and roots of chats of varied
lengths written directly (`varied_root`): the sources of the mixture tests (not a conftest).

The embedded examples are written as chat JSON Lines (`messages`, `task`, `group`, `difficulty`; no `id`, so every
root numbers its examples train-00000000, ... as the converter does) and converted
by `cflib.data.convert` with the byte tokenizer and the default role markers: each root's manifest then carries
the conversion block a mixture checks (vocabulary, EOS, tokenizer, chat template).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from sft_shard_helpers import TOKENIZER, write_shard

from cflib.data.convert import ConvertSpec, convert
from cflib.data.marker_template import ChatTemplate
from cflib.data.shards import Example
from cflib.data.tasks import generate

TASKS = ("addition", "uppercase")


def chat_row(example: Example) -> dict:
    meta = example.meta
    return {"messages": [{"role": "user", "content": meta["prompt"]},
                         {"role": "assistant", "content": meta["answer"]}],
            "task": meta["task"], "group": meta["group"], "difficulty": meta["difficulty"]}


def write_jsonl(path: Path, examples: list[Example]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(chat_row(example)) + "\n" for example in examples))
    return path


def task_root(folder: Path, task: str, train: int, held_out: int, seed: int = 3,
              template: ChatTemplate | None = None) -> Path:
    """folder/<task>: the first `train` and `held_out` embedded examples of `task`, converted."""
    train_examples, eval_examples = generate(seed=seed)
    chats = folder / "chats" / task
    spec = ConvertSpec(train=str(write_jsonl(chats / "train.jsonl",
                                             [e for e in train_examples if e.meta["task"] == task][:train])),
                       eval=str(write_jsonl(chats / "eval.jsonl",
                                            [e for e in eval_examples if e.meta["task"] == task][:held_out])),
                       out=str(folder / task), max_seq_len=64, template=template or ChatTemplate())
    convert(spec)
    return folder / task


def task_roots(folder: Path, train: dict[str, int], held_out: int, seed: int = 3) -> dict[str, Path]:
    """One converted root per embedded task: {task: root}."""
    return {task: task_root(folder, task, count, held_out, seed) for task, count in train.items()}


def mixture(roots: dict[str, Path], weights: dict[str, float]) -> list[dict]:
    """`data` for a mixture of these roots at these weights."""
    return [{"path": str(roots[task]), "weight": weight} for task, weight in weights.items()]


def varied_root(folder: Path, count: int, shortest: int, longest: int, seed: int) -> Path:
    """A shard root of `count` chats whose prompts take from `shortest` to `longest` characters, each answered "ok",
    its first 4 held out too. The embedded tasks' examples are all about as long, so each epoch's draw of them packs
    into as many windows; a mixture of these packs into other numbers each epoch."""
    rng = np.random.default_rng(seed)
    examples = []
    for index in range(count):
        ids, labels = TOKENIZER.encode_chat("x" * int(rng.integers(shortest, longest + 1)), "ok")
        examples.append(Example(ids, labels, {"example_id": f"{folder.name}-{index}", "task": folder.name,
                                              "group": "varied"}))
    return write_shard(folder, examples, examples[:4], max_seq_len=64)
