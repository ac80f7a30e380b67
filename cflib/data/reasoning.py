"""Reasoning in assistant turns: a `<think>...</think>` block in the content, or a `reasoning_content` field.

The policy (`--reasoning`) decides what the loss does with it:

    supervise  the reasoning is rendered and taught, as the rest of the answer
    mask       it is rendered (the model reads it) but not taught: its tokens carry no label
    strip      it is removed before rendering: the model neither reads nor learns it

Under `mask` the rendered text must show the reasoning as a `<think>...</think>`
block inside the assistant's span (the tokenizer's template renders a
`reasoning_content` field so, or the content carries it); otherwise the row is
refused, since nothing would tell which tokens to leave untaught.
"""
from __future__ import annotations

import re
from dataclasses import replace

from cflib.data.conversation import Conversation

POLICIES = ("supervise", "mask", "strip")
OPEN, CLOSE = "<think>", "</think>"
BLOCK = re.compile(re.escape(OPEN) + r".*?" + re.escape(CLOSE), re.S)
# A stripped block takes the whitespace after it along: "<think>x</think>\n\nanswer" becomes "answer".
BLOCK_AND_SPACE = re.compile(BLOCK.pattern + r"\s*", re.S)


def reasons(message: dict) -> bool:
    """An assistant turn with reasoning: a reasoning_content field or a <think> block in its content."""
    return message["role"] == "assistant" and ("reasoning_content" in message
                                               or bool(BLOCK.search(str(message.get("content") or ""))))


def stripped(conversation: Conversation) -> Conversation:
    """The conversation without its reasoning: no reasoning_content, no <think> block in an assistant's content."""
    messages = []
    for message in conversation.messages:
        if message["role"] == "assistant":
            message = {k: v for k, v in message.items() if k != "reasoning_content"}
            if isinstance(message.get("content"), str):
                message["content"] = BLOCK_AND_SPACE.sub("", message["content"])
        messages.append(message)
    return replace(conversation, messages=messages)


def blocks_within(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character ranges of the <think> blocks of `text` that lie inside one of `spans`."""
    return [(m.start(), m.end()) for m in BLOCK.finditer(text)
            if any(start <= m.start() and m.end() <= end for start, end in spans)]
