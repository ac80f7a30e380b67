"""Tokenizer folders as users bring them, made here: a byte-level BPE trained with `tokenizers`, its
tokenizer_config.json, and a Jinja chat template modelled on the released model's (every message's content
trimmed, `</s>` ending each turn), with or without `{% generation %}` blocks around the assistant's part."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
THINK = ["<think>", "</think>"]  # added tokens, not special: written in content and read back as text


def released_like_template(generation: bool = False) -> str:
    """A role header and a newline before each turn, its content trimmed, `</s>` and a newline after it; the
    tools as JSON in a system turn first; an assistant's reasoning_content as <think>...</think> before its
    content, its tool calls as <tool_call>JSON</tool_call> after it."""
    begin, end = ("{%- generation -%}", "{%- endgeneration -%}") if generation else ("", "")
    return (
        "{%- if tools -%}{{- '<|system|>\\n' + (tools | tojson) + '</s>\\n' -}}{%- endif -%}"
        "{%- for message in messages -%}"
        "{%- if message.role == 'assistant' -%}"
        "{{- '<|assistant|>\\n' -}}" + begin +
        "{%- if message.reasoning_content is defined -%}"
        "{{- '<think>' + (message.reasoning_content | trim) + '</think>' -}}{%- endif -%}"
        "{%- if message.content is defined -%}{{- message.content | trim -}}{%- endif -%}"
        "{%- if message.tool_calls is defined -%}{%- for call in message.tool_calls -%}"
        "{{- '<tool_call>' + (call.function | tojson) + '</tool_call>' -}}{%- endfor -%}{%- endif -%}"
        "{{- '</s>' -}}" + end + "{{- '\\n' -}}"
        "{%- else -%}"
        "{{- '<|' + message.role + '|>\\n' + (message.content | trim) + '</s>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}")


CORPUS = ["the capital of France is Paris", "reverse abc cba dog god", "12+34=46 58+67=125 what is",
          "think step by step weather in Paris sunny", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
          "Hello, how are you? I am fine. Translate: bonjour means hello"]


def train_bpe(vocab_size: int = 420) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK])
    return tokenizer


def tokenizer_folder(folder: Path, generation: bool = False, template_file: bool = False,
                     template: str | None = None) -> Path:
    """A folder AutoTokenizer.from_pretrained loads: tokenizer.json, tokenizer_config.json and the chat template
    in the config (or, with template_file, in chat_template.jinja)."""
    folder.mkdir(parents=True, exist_ok=True)
    train_bpe().save(str(folder / "tokenizer.json"))
    template = released_like_template(generation) if template is None else template
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "</s>", "unk_token": None, "model_max_length": 512, "clean_up_tokenization_spaces": False}
    if template_file:
        (folder / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def turn(role: str, content: str, **fields) -> dict:
    return {"role": role, "content": content, **fields}
