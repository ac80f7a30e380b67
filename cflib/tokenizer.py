"""A byte-level tokenizer with chat specials, for the embedded data and tests.

Real data brings its own Hugging Face `tokenizer.json`; this one exists so the
default job needs no download: every UTF-8 string encodes, ids are stable.
"""
from __future__ import annotations

IGNORE_INDEX = -100


class ByteTokenizer:
    eos_token_id = 0  # EOS is id 0, as in the released shard
    user_token_id = 1
    assistant_token_id = 2
    num_special = 4  # id 3 is reserved
    vocab_size = num_special + 256

    def encode(self, text: str) -> list[int]:
        return [self.num_special + byte for byte in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.num_special for i in ids if self.num_special <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def encode_prompt(self, prompt: str) -> list[int]:
        """The tokens a model sees before it answers: user turn, then the assistant marker."""
        return [self.user_token_id] + self.encode(prompt) + [self.assistant_token_id]

    def encode_chat(self, prompt: str, answer: str) -> tuple[list[int], list[int]]:
        """One single-turn example with causally aligned labels: answer and EOS supervised."""
        prompt_ids = self.encode_prompt(prompt)
        answer_ids = self.encode(answer) + [self.eos_token_id]
        input_ids = prompt_ids + answer_ids
        # labels[j] is the target of position j: the next token when it is answer or EOS.
        labels = [IGNORE_INDEX] * (len(prompt_ids) - 1) + answer_ids + [IGNORE_INDEX]
        return input_ids, labels
