"""Tokenizers: a built-in byte-level one with chat specials, local Hugging Face `tokenizer.json` files, and
tokenizer folders as `transformers` loads them.

Real data brings its own `tokenizer.json` (the `tokenizers` library reads it),
or a folder `AutoTokenizer.from_pretrained` loads (tokenizer.json,
tokenizer_config.json, and the chat template there or in
chat_template.jinja): local files only, nothing downloaded, no code run. The
byte tokenizer exists so the default job needs no file at all: every UTF-8
string encodes, ids are stable.

All offer the same encodings: `encode` for message content, where text that
looks like a special token stays plain text (a user cannot forge a turn
marker); `encode_template` for chat-template text, where special tokens are
recognised, and its inverse `decode_template`; and `token_id` for one special
token.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from cflib.data.shards import IGNORE_INDEX, ShardPartition


def id_space(count: int, ids: Iterable[int]) -> int:
    """The vocabulary size a shard declares for a tokenizer: one past its largest id. A tokenizer's ids may leave
    gaps (a special token added at 5000 beside 1,608 tokens), so its number of tokens alone can fall short, and
    the shard reader refuses an id at or past vocab_size."""
    return max(count, max(ids, default=-1) + 1)


class ByteTokenizer:
    eos_token_id = 0  # EOS is id 0, as in the released shard
    user_token_id = 1
    assistant_token_id = 2
    system_token_id = 3
    num_special = 4
    vocab_size = num_special + 256
    special_tokens = {"<|eos|>": 0, "<|user|>": 1, "<|assistant|>": 2, "<|system|>": 3}
    _special_pattern = re.compile("(" + "|".join(re.escape(token) for token in special_tokens) + ")")
    description = "byte"

    def encode(self, text: str) -> list[int]:
        return [self.num_special + byte for byte in text.encode("utf-8")]

    def encode_template(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._special_pattern.split(text):
            ids.extend([self.special_tokens[piece]] if piece in self.special_tokens else self.encode(piece))
        return ids

    def token_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - self.num_special for i in ids if self.num_special <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def decode_template(self, ids: list[int]) -> str:
        """Text with special tokens written out, the inverse of encode_template."""
        names = {i: token for token, i in self.special_tokens.items()}
        pieces, run = [], []
        for i in ids:
            if i in names:
                pieces += [self.decode(run), names[i]]
                run = []
            else:
                run.append(i)
        return "".join(pieces) + self.decode(run)

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


class JsonTokenizer:
    """A local Hugging Face `tokenizer.json`, through the `tokenizers` library."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such tokenizer.json")
        try:
            self._template = Tokenizer.from_file(str(self.path))
            self._content = Tokenizer.from_file(str(self.path))
        except Exception as err:  # the Rust library raises its own exception type
            raise ValueError(f"{self.path}: not a readable tokenizer.json ({err})") from None
        self._content.encode_special_tokens = True
        self.vocab_size = id_space(self._template.get_vocab_size(with_added_tokens=True),
                                   self._template.get_vocab(with_added_tokens=True).values())
        self.description = str(self.path)

    def encode(self, text: str) -> list[int]:
        return self._content.encode(text, add_special_tokens=False).ids

    def encode_template(self, text: str) -> list[int]:
        return self._template.encode(text, add_special_tokens=False).ids

    def token_id(self, token: str) -> int | None:
        return self._template.token_to_id(token)

    def decode(self, ids: list[int]) -> str:
        return self._template.decode(ids, skip_special_tokens=False)

    decode_template = decode  # special tokens are always written out


class PretrainedTokenizer:
    """A tokenizer folder, loaded by `transformers.AutoTokenizer` from its local files; `hf` is that tokenizer."""

    def __init__(self, folder: str | Path) -> None:
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as transformers_logging
        except ModuleNotFoundError:
            raise ValueError(f"{folder}: a tokenizer folder is read by the transformers library: "
                             "pip install 'cflib[data]'") from None
        self.path = Path(folder)
        # A Hub bundle's folder holds the model's config.json too, of a model type transformers does not know
        # without the bundle's code: it warns about instantiating a model, which loading a tokenizer never does.
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True, trust_remote_code=False)
        except Exception as err:  # transformers raises many kinds for a folder it cannot load
            raise ValueError(f"{self.path}: not a tokenizer folder AutoTokenizer loads ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''})") from None
        finally:
            transformers_logging.set_verbosity(verbosity)
        self._vocab = self.hf.get_vocab()
        self.vocab_size = id_space(len(self.hf), self._vocab.values())
        self.description = str(self.path)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def encode_template(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    decode_template = decode  # special tokens are always written out


def load_tokenizer(spec: str | Path) -> ByteTokenizer | JsonTokenizer | PretrainedTokenizer:
    """"byte" for the built-in tokenizer, a tokenizer folder, or the path of a tokenizer.json."""
    if str(spec) == "byte":
        return ByteTokenizer()
    return PretrainedTokenizer(spec) if Path(spec).is_dir() else JsonTokenizer(spec)


def shard_tokenizer_spec(shard: ShardPartition) -> str | None:
    """The tokenizer a shard was converted with, when its index names one ("byte", a tokenizer.json or a
    tokenizer folder); "byte" for the embedded tasks (no conversion block, its vocabulary); None when unknown."""
    named = shard.index.get("conversion", {}).get("tokenizer", {})
    if named.get("kind") == "tokenizer.json" and named.get("path") and Path(named["path"]).is_file():
        return named["path"]
    if named.get("kind") == "folder" and named.get("path") and Path(named["path"]).is_dir():
        return named["path"]
    if named.get("kind") == "byte" or (not named and shard.vocab_size == ByteTokenizer.vocab_size):
        return "byte"
    return None


def shard_chat_template_sha256(shard: ShardPartition) -> str | None:
    """The SHA-256 of the tokenizer's own chat template the shard was rendered through; None for the marker
    template (or a shard that names none)."""
    template = shard.index.get("conversion", {}).get("template", {})
    return template.get("sha256") if template.get("kind") == "tokenizer" else None
