"""Small shared helpers for the tests that write shards (not a conftest)."""
from __future__ import annotations

import json
from pathlib import Path

from cflib.data.shards import IGNORE_INDEX, Example, write_partition
from cflib.data.tasks import generate
from cflib.data.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
VOCAB = TOKENIZER.vocab_size  # 260
EOS = TOKENIZER.eos_token_id
MAX_SEQ_LEN = 48

# (task, group, prompt, answer): answers have no two equal adjacent characters,
# so labels written unshifted can never happen to look causally aligned.
CHATS = [
    ("addition", "no-carry", "12+34=", "46"),
    ("reverse", "short", "reverse abc", "cba"),
    ("addition", "carry", "58+67=", "125"),
    ("reverse", "long", "reverse planet", "tenalp"),
    ("addition", "carry", "909+181=", "1090"),
]


def chat_example(index: int, task: str, group: str, prompt: str, answer: str) -> Example:
    input_ids, labels = TOKENIZER.encode_chat(prompt, answer)
    meta = {"example_id": f"{task}-{index:03d}", "task": task, "group": group, "prompt": prompt, "answer": answer}
    return Example(input_ids, labels, meta)


def chat_examples() -> list[Example]:
    return [chat_example(i, *chat) for i, chat in enumerate(CHATS)]


def two_turn_example(example_id: str = "dialog-000") -> Example:
    """user, assistant, user, assistant: both answers (and their EOS) supervised."""
    ids1, labels1 = TOKENIZER.encode_chat("hi", "hello")
    ids2, labels2 = TOKENIZER.encode_chat("reverse dog", "god")
    return Example(ids1 + ids2, labels1 + labels2, {"example_id": example_id, "task": "dialog", "group": "two-turn"})


def write_shard(root: Path, train: list[Example], eval_: list[Example] | None = None, *,
                vocab_size: int = VOCAB, max_seq_len: int = MAX_SEQ_LEN) -> Path:
    """A shard root with train/ and eval/ (eval defaults to a copy of train)."""
    for partition, examples in (("train", train), ("eval", train if eval_ is None else eval_)):
        write_partition(root / partition, examples, vocab_size=vocab_size, eos_token_id=EOS,
                        max_seq_len=max_seq_len)
    return root


def task_shard(root: Path, train: int, eval_: int, seed: int = 2) -> Path:
    """A shard of the first `train` and `eval_` embedded-task examples of generate(seed), rows up to 64 tokens."""
    train_examples, eval_examples = generate(seed=seed)
    return write_shard(root, train_examples[:train], eval_examples[:eval_], max_seq_len=64)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def supervised_count(example: Example) -> int:
    return sum(1 for label in example.labels if label != IGNORE_INDEX)
