"""The embedded default data set: deterministic synthetic instruction tasks.

Two tasks a small model can learn on a CPU in minutes yet not guess:
three-digit addition and upper-casing a word. Each example is tagged with its
`task` and a `group` (a slice worth reading apart), and its sidecar
(loss_metadata.jsonl) gives each a `difficulty`: easy, medium or hard by the
carries an addition needs (an upper-casing is easy). Written once into the
public shard format and then read through the same reader as real data.
"""
from __future__ import annotations

import random
import string
from dataclasses import asdict
from pathlib import Path

from cflib.atomic import write_json_atomic
from cflib.data.marker_template import ChatTemplate
from cflib.data.rendering import tokenizer_record
from cflib.data.shards import Example, ShardError, unchanged_since_written, write_partition
from cflib.data.tokenizer import ByteTokenizer
from cflib.jsonio import read_json

EMBEDDED_VERSION = "embedded-v5"
EVAL_PER_TASK = 100
MAX_SEQ_LEN = 64


def addition(rng: random.Random) -> tuple[str, str, str]:
    """Three-digit addition with zero-padded operands and a four-digit sum.

    Fixed widths put every digit a fixed distance from the digits it depends
    on, which a small model's attention finds in minutes; the carry it must
    still compute.
    """
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    carries = any((a // 10**i % 10) + (b // 10**i % 10) >= 10 for i in range(3))
    return f"{a:03d}+{b:03d}=", f"{a + b:04d}", "carry" if carries else "no-carry"


def uppercase(rng: random.Random) -> tuple[str, str, str]:
    """Upper-case a random six-letter word."""
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
    return f"upper {word}", word.upper(), "repeats" if len(set(word)) < 6 else "distinct"


def difficulty(task: str, prompt: str) -> str:
    """easy, medium or hard: the carries an addition needs (none, one, more); copying a word is easy."""
    if task != "addition":
        return "easy"
    a, b = (int(operand) for operand in prompt.rstrip("=").split("+"))
    carries, carry = 0, 0
    for place in range(3):
        carry = int(a // 10**place % 10 + b // 10**place % 10 + carry >= 10)
        carries += carry
    return ("easy", "medium", "hard")[min(carries, 2)]


# task -> (example maker, train examples); the carry makes addition the harder one.
TASKS = {"addition": (addition, 14_000), "uppercase": (uppercase, 8_000)}


def generate(seed: int = 0) -> tuple[list[Example], list[Example]]:
    """Train and eval examples; eval prompts never occur in train."""
    tokenizer = ByteTokenizer()
    rng = random.Random(seed)
    train, held_out = [], []
    for task, (make, train_count) in TASKS.items():
        seen: set[str] = set()
        rows: list[tuple[str, str, str]] = []
        while len(rows) < train_count + EVAL_PER_TASK:
            prompt, answer, group = make(rng)
            if prompt not in seen:
                seen.add(prompt)
                rows.append((prompt, answer, group))
        for split, chunk in ((held_out, rows[:EVAL_PER_TASK]), (train, rows[EVAL_PER_TASK:])):
            for prompt, answer, group in chunk:
                input_ids, labels = tokenizer.encode_chat(prompt, answer)
                meta = {"example_id": f"{task}-{len(split):06d}", "task": task, "group": group,
                        "source": EMBEDDED_VERSION, "prompt": prompt, "answer": answer,
                        "difficulty": difficulty(task, prompt)}
                split.append(Example(input_ids, labels, meta))
    rng.shuffle(train)
    return train, held_out


def ensure_embedded_shard(data_root: str | Path) -> Path:
    """Write the embedded shard under data_root once; later calls reuse it."""
    root = Path(data_root) / EMBEDDED_VERSION
    if all(unchanged_since_written(root / partition) for partition in ("train", "eval")):
        for partition in ("train", "eval"):  # written before the index recorded its conversion
            _record_conversion(root / partition / "sft.idx.json")
        return root
    # absent or damaged: (re)write it
    train, held_out = generate()
    tokenizer = ByteTokenizer()
    for partition, examples in (("train", train), ("eval", held_out)):
        write_partition(root / partition, examples, vocab_size=tokenizer.vocab_size,
                        eos_token_id=tokenizer.eos_token_id, max_seq_len=MAX_SEQ_LEN,
                        sidecar_fields=("difficulty",), index_extra={"conversion": conversion()})
    return root


def _record_conversion(index_path: Path) -> None:
    """The conversion added to an index that lacks it: the rows and token files, and so the data's hashes (what a
    resumed run checks), stay as they were."""
    index = read_json(index_path, ShardError, "shard index")
    if index.get("conversion") != conversion():
        write_json_atomic(index_path, {**index, "conversion": conversion()})


def conversion() -> dict:
    """The conversion the embedded examples are, as a converted shard's manifest records it: ByteTokenizer's
    encode_chat gives, token for token, what `convert` renders through the byte tokenizer and the default role
    markers, teaching the final turn. Recorded, they mix with data converted that way."""
    return {"tokenizer": tokenizer_record(ByteTokenizer()), "template": {"kind": "markers", **asdict(ChatTemplate())},
            "supervise": "final_turn", "reasoning": "supervise", "format": "embedded", "split": None}
