"""A conversation as the converter holds it, and the checks every one passes before it is rendered.

Every input format (cflib.data.formats) becomes a `Conversation`: OpenAI-style
messages (`role`, `content`, and where they occur an assistant's `tool_calls`
and `reasoning_content`, a tool turn's `name` and `tool_call_id`), the
`tools` the conversation may call, how many leading messages are context
only (a prompt-completion row's prompt), and the row's metadata. Plain text
(continued pretraining) is a `Conversation` with `text` set and no messages.

The order of turns: an optional system turn, then a user turn; after a user
turn the assistant answers; after an assistant turn comes the user, or, when
it called tools, their results (`tool` turns), after which the assistant
speaks again. A conversation to convert ends with the assistant turn it
teaches; one to answer ends before the assistant's turn.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from cflib.data import loss_metadata

ROLES = ("system", "user", "assistant", "tool")
SUPERVISE = ("final_turn", "all_assistant_turns")
# String fields of a row copied to each example: into examples.jsonl, the semantic ones to loss_metadata.jsonl.
METADATA = ("task", "group", "source", *loss_metadata.FIELDS)


class ConvertError(ValueError):
    """Input that cannot become a shard; the message names the source, row and field, or the setting."""


@dataclass
class Conversation:
    messages: list[dict] = field(default_factory=list)
    tools: list | None = None
    context_turns: int = 0  # leading messages that are context only (a prompt), never supervised
    meta: dict = field(default_factory=dict)
    text: str | None = None  # plain text: every token supervised, no template

    def taught_turns(self, supervise: str) -> list[int]:
        """Indices of the assistant messages whose tokens the loss teaches."""
        answers = [i for i, m in enumerate(self.messages) if m["role"] == "assistant" and i >= self.context_turns]
        return answers[-1:] if supervise == "final_turn" else answers

    def has_empty_answer(self, supervise: str) -> bool:
        """A taught assistant turn with nothing in it: no text, no tool call, no reasoning."""
        return any(not str(self.messages[i].get("content") or "").strip() and not self.messages[i].get("tool_calls")
                   and not self.messages[i].get("reasoning_content") for i in self.taught_turns(supervise))


def without_nulls(value: object) -> object:
    """`value` with every mapping's null entries left out, at any depth: a columnar file (Parquet, Arrow) gives
    each row every field any row has, null where it had none, and a template must see what the row said."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def check_text(text: object, where: str) -> str:
    if not isinstance(text, str):
        raise ConvertError(f"{where}: must be a string, got {str(text)[:80]}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate escape ("\ud800") is valid JSON but no text
        raise ConvertError(f"{where}: not encodable text (character {text[err.start]!r} at {err.start}: "
                           f"{err.reason})") from None
    return text


def check_messages(messages: object, where: str, to_answer: bool = False) -> list[dict]:
    """The messages, each checked, in a valid order; ConvertError naming `where`, the message and the field."""
    if not isinstance(messages, list) or not messages:
        raise ConvertError(f"{where}: needs a non-empty list of messages")
    for turn, message in enumerate(messages):
        _check_message(message, f"{where}: message {turn}")
    _check_turn_order(messages, where)
    last = messages[-1]["role"]
    if to_answer and last == "assistant":
        raise ConvertError(f"{where}: the last message is the assistant's; a conversation to answer ends with "
                           "a user, system or tool turn")
    if not to_answer and last != "assistant":
        raise ConvertError(f"{where}: the last message is {last!r}; a conversation ends with the assistant turn "
                           "it teaches")
    return messages


def _check_message(message: object, where: str) -> None:
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ConvertError(f"{where} needs a role in {ROLES} and a string content, got {str(message)[:80]}")
    calls = message.get("tool_calls")
    if "content" in message or not calls:  # an assistant's tool call may come without text
        if not isinstance(message.get("content"), str):
            raise ConvertError(f"{where} needs a role in {ROLES} and a string content, got {str(message)[:80]}")
        check_text(message["content"], f"{where} content")
    if calls is not None:
        if message["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(call, dict) and isinstance((call.get("function") or call).get("name"), str)
                for call in calls):
            raise ConvertError(f"{where} tool_calls: an assistant's list of calls, each with a function name "
                               f"(function.name), got {str(calls)[:80]}")
    if "reasoning_content" in message:
        if message["role"] != "assistant":
            raise ConvertError(f"{where} reasoning_content: only an assistant turn reasons")
        check_text(message["reasoning_content"], f"{where} reasoning_content")


def _check_turn_order(messages: list[dict], where: str) -> None:
    """An answer with no question before it, or two questions in a row, would teach the template a
    conversation it never sees."""
    previous = None
    for turn, message in enumerate(messages):
        role = message["role"]
        if role == "system" and turn > 0:
            what = "a system turn after the first message"
        elif role == "tool" and previous not in ("assistant", "tool"):
            what = "a tool turn that follows no assistant tool call"
        elif role == "tool" and previous == "assistant" and not messages[turn - 1].get("tool_calls"):
            what = "a tool turn after an assistant turn that called no tool"
        elif role in ("user", "assistant") and role != _expected(previous):
            what = f"{role!r} where the {_expected(previous)!r} turn belongs"
        else:
            previous = role
            continue
        raise ConvertError(f"{where}: message {turn} is {what}; a conversation is an optional system turn, then "
                           "user and assistant turns in turn, starting with the user (tool results after the "
                           "assistant turn that called them)")


def _expected(previous: str | None) -> str:
    """The user or assistant turn that belongs after `previous`."""
    return "assistant" if previous in ("user", "tool") else "user"


def check_metadata(row: dict, where: str) -> dict:
    """The row's metadata fields (strings), a null one left out."""
    meta = {}
    for key in METADATA:
        value = row.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConvertError(f"{where}: {key!r} must be a string, got {value!r}")
        meta[key] = value
    return meta


def conversation_digest(conversation: Conversation) -> int:
    """64 bits of BLAKE2b over everything rendered (messages, tools, text): a signed SQLite integer."""
    canonical = json.dumps([conversation.text, conversation.messages, conversation.tools,
                            conversation.context_turns], ensure_ascii=False, sort_keys=True)
    return int.from_bytes(hashlib.blake2b(canonical.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def conversation_to_answer(row: object, where: str) -> list[dict]:
    """The messages of {"messages": [...]} ending before the assistant's turn, or ConvertError naming `where`."""
    if not isinstance(row, dict):
        raise ConvertError(f"{where}: not a JSON object")
    if "messages" not in row:
        raise ConvertError(f"{where}: needs a non-empty list 'messages'")
    return check_messages(without_nulls(row["messages"]), where, to_answer=True)
