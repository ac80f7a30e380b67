"""A conversation as the converter holds it, and the checks every one passes before it is rendered.

Every input format (cflib.data.formats) becomes a `Conversation`: OpenAI-style
messages (`role`, `content`, and where they occur an assistant's `tool_calls`,
`reasoning_content` and `weight`, a tool turn's `name` and `tool_call_id`), the
`tools` the conversation may call, how many leading messages are context
only (a prompt-completion row's prompt), and the row's metadata. Plain text
(continued pretraining) is a `Conversation` with `text` set and no messages.

A content given as OpenAI's list of parts (`[{"type": "text", "text": ...}]`)
is held as one string, its text parts joined; any other part (an image, audio,
a file) is refused, since a shard holds text. `developer` is OpenAI's newer
name for the system turn and stands where a system turn may. An assistant
turn's `weight` is OpenAI's fine-tuning switch: 0 leaves the turn untaught
(context only), 1 teaches it as `--supervise` says.

The order of turns: an optional system (or developer) turn, then a user
turn; after a user turn the assistant answers; after an assistant turn comes
the user, or, when it called tools, their results (`tool` turns), after which
the assistant speaks again. A conversation to convert ends with the assistant turn it
teaches; one to answer ends before the assistant's turn.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from cflib.data import loss_metadata

ROLES = ("system", "developer", "user", "assistant", "tool")
SYSTEM_ROLES = ("system", "developer")  # `developer`: OpenAI's newer name for the system turn
WEIGHTS = (0, 1)  # an assistant turn's weight: 0 not taught, 1 taught
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
        """Indices of the assistant messages whose tokens the loss teaches: the final one or all of them, less
        those with weight 0 (a final turn of weight 0 leaves nothing taught rather than teaching an earlier one)."""
        answers = [i for i, m in enumerate(self.messages) if m["role"] == "assistant" and i >= self.context_turns]
        chosen = answers[-1:] if supervise == "final_turn" else answers
        return [i for i in chosen if self.messages[i].get("weight", 1) != 0]

    def has_empty_answer(self, supervise: str) -> bool:
        """Nothing to teach: no taught assistant turn (every one of weight 0), or one with nothing in it (no
        text, no tool call, no reasoning)."""
        if self.text is not None:
            return False
        turns = self.taught_turns(supervise)
        return not turns or any(not str(self.messages[i].get("content") or "").strip()
                                and not self.messages[i].get("tool_calls")
                                and not self.messages[i].get("reasoning_content") for i in turns)


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
    messages = [_joined_parts(message, f"{where}: message {turn}") for turn, message in enumerate(messages)]
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


def _joined_parts(message: object, where: str) -> object:
    """The message with a content of OpenAI parts as one string, its text parts joined as the templates that
    take parts render them (one after the other): every renderer, and the checks on empty answers and
    reasoning, read content as text."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for index, part in enumerate(message["content"]):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise ConvertError(f"{where} content part {index} is {kind!r}: a shard holds text, so only text parts "
                               '({"type": "text", "text": "..."}) are read; leave images, audio and files out of '
                               "the rows")
        if not isinstance(part.get("text"), str):
            raise ConvertError(f"{where} content part {index}: a text part needs a string 'text', got "
                               f"{str(part)[:80]}")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


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
    if "weight" in message:
        _check_weight(message, where)


def _check_weight(message: dict, where: str) -> None:
    """OpenAI's weight: 0 or 1 on an assistant turn. Anything else (0.5, "0", a weight on a user turn) would be
    read as a loss weight or a taught user turn, neither of which the converter does."""
    weight = message["weight"]
    if message["role"] != "assistant":
        raise ConvertError(f"{where} weight: only an assistant turn has a weight (0: not taught, 1: taught); "
                           f"this is a {message['role']!r} turn, which is never taught")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in WEIGHTS:
        raise ConvertError(f"{where} weight: 0 (not taught) or 1 (taught), got {weight!r}")


def _check_turn_order(messages: list[dict], where: str) -> None:
    """An answer with no question before it, or two questions in a row, would teach the template a
    conversation it never sees."""
    previous = None
    for turn, message in enumerate(messages):
        role = message["role"]
        if role in SYSTEM_ROLES and turn > 0:
            what = f"a {role} turn after the first message"
        elif role == "tool" and previous not in ("assistant", "tool"):
            what = "a tool turn that follows no assistant tool call"
        elif role == "tool" and previous == "assistant" and not messages[turn - 1].get("tool_calls"):
            what = "a tool turn after an assistant turn that called no tool"
        elif role in ("user", "assistant") and role != _expected(previous):
            what = f"{role!r} where the {_expected(previous)!r} turn belongs"
        else:
            previous = role
            continue
        raise ConvertError(f"{where}: message {turn} is {what}; a conversation is an optional system (or "
                           "developer) turn, then user and assistant turns in turn, starting with the user (tool "
                           "results after the assistant turn that called them)")


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
