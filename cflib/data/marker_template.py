"""The marker template: role markers and turn ends, rendered token by token (the byte tokenizer's, the embedded data's).

    every turn:       <role marker> content
    system/user turn: ... followed by turn_end
    assistant turn:   ... followed by eos  (the shard's EOS token)

Content is encoded as plain text, so text in a message that looks like a
special token stays text: a user cannot forge a turn marker. Content is
written as it is, spaces included (the released tokenizer's own template,
cflib.data.tokenizer_template, trims each message). An assistant's
`reasoning_content` is written before its content as `<think>...</think>`.
The template has no place for tools: a conversation with tools, tool calls or
tool turns renders through the tokenizer's own template instead. A `developer`
turn is written as the system turn it stands for.

Markers the model could not read are refused before any row: an empty user
or assistant marker (an empty system marker suits data without system turns,
and refuses a row that has one), two roles with the same marker, an eos that is also in a role marker,
and a piece that looks like a special token (`<|user|>`) the tokenizer does not
have, which would be written as several tokens of plain text that any message
can spell.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, fields
from itertools import combinations

from cflib.data.conversation import Conversation, ConvertError
from cflib.data.reasoning import BLOCK, CLOSE, OPEN
from cflib.data.shards import IGNORE_INDEX
from cflib.data.tokenizer import ByteTokenizer, JsonTokenizer, PretrainedTokenizer

MARKED_ROLES = ("system", "user", "assistant")
SPECIAL_LOOKING = re.compile(r"<\|[^<>|\s]+\|>")  # <|user|>, <|im_start|>: written as one special token
CHATML = ("system '<|im_start|>system\\n', user '<|im_start|>user\\n', assistant '<|im_start|>assistant\\n', "
          "turn_end '<|im_end|>\\n', eos '<|im_end|>'")


@dataclass(frozen=True)
class ChatTemplate:
    """Role markers and turn ends, as text; special tokens in them are recognised by the tokenizer.

    The default matches the byte tokenizer and the embedded data. ChatML, for a
    tokenizer.json that has its specials: system "<|im_start|>system\\n", user
    "<|im_start|>user\\n", assistant "<|im_start|>assistant\\n", turn_end
    "<|im_end|>\\n", eos "<|im_end|>".
    """

    system: str = "<|system|>"
    user: str = "<|user|>"
    assistant: str = "<|assistant|>"
    turn_end: str = ""  # after each system and user turn
    eos: str = "<|eos|>"  # one token, after each assistant turn; the shard's EOS

    def __post_init__(self) -> None:
        """Role markers that cannot tell the turns apart, refused when the template is made: at conversion, not
        only when the chat later needs the assistant's."""
        for role in ("user", "assistant"):  # an empty system marker is a template for data with no system turn
            if not getattr(self, role):
                raise ConvertError(f"the template names no {role} marker ({role}: ''): nothing tells the model "
                                   f"where the {role}'s turn begins")
        for first, second in combinations(MARKED_ROLES, 2):
            if getattr(self, first) and getattr(self, first) == getattr(self, second):
                raise ConvertError(f"the template's {first} and {second} markers are the same "
                                   f"({getattr(self, first)!r}): the model could not tell whose turn it is")

    @classmethod
    def from_dict(cls, raw: dict, source: str = "template") -> "ChatTemplate":
        known = [f.name for f in fields(cls)]
        if not isinstance(raw, dict):
            raise ConvertError(f"{source}: a template is a mapping of {', '.join(known)}, or 'tokenizer'")
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConvertError(f"{source}: unknown template key(s) {unknown}; known: {known}")
        if not all(isinstance(value, str) for value in raw.values()):
            raise ConvertError(f"{source}: template values are strings")
        try:
            return cls(**raw)
        except ConvertError as err:
            raise ConvertError(f"{source}: {err}") from None


class ChatRenderer:
    """Conversations to (input_ids, labels) under a marker template, supervising assistant turns."""

    def __init__(self, tokenizer: ByteTokenizer | JsonTokenizer | PretrainedTokenizer, template: ChatTemplate,
                 supervise: str, reasoning: str = "supervise") -> None:
        eos = tokenizer.token_id(template.eos)
        if eos is None:
            raise ConvertError(f"tokenizer {tokenizer.description} has no token {template.eos!r} (the template's "
                               "eos); add it as a special token or set the template's eos to the tokenizer's")
        self.tokenizer, self.template, self.supervise, self.eos_token_id = tokenizer, template, supervise, eos
        self.reasoning = reasoning
        _refuse_unknown_specials(tokenizer, template)
        self.markers = {role: tokenizer.encode_template(getattr(template, role)) for role in MARKED_ROLES}
        self.turn_end = tokenizer.encode_template(template.turn_end)
        for role, ids in self.markers.items():
            if eos in ids:  # the shard's EOS, which ends answers and pads packed rows, would also begin turns
                raise ConvertError(f"the template's eos {template.eos!r} is also in its {role} marker "
                                   f"{getattr(template, role)!r}: the token that ends an answer must not begin a "
                                   "turn; give eos a token of its own")

    def record(self) -> dict:
        return {"kind": "markers", **asdict(self.template)}

    def _content(self, message: dict, taught: bool) -> tuple[list[int], list[bool]]:
        """A turn's content ids and which are taught: under `mask` a <think> block is read, not taught."""
        text = message.get("content", "")
        if "reasoning_content" in message:
            text = OPEN + message["reasoning_content"] + CLOSE + text
        if not (taught and self.reasoning == "mask"):
            ids = self.tokenizer.encode(text)
            return ids, [taught] * len(ids)
        pieces, at = [], 0
        for block in BLOCK.finditer(text):
            pieces += [(text[at:block.start()], True), (block.group(), False)]
            at = block.end()
        ids, flags = [], []
        for piece, piece_taught in pieces + [(text[at:], True)]:
            piece_ids = self.tokenizer.encode(piece) if piece else []
            ids, flags = ids + piece_ids, flags + [piece_taught] * len(piece_ids)
        return ids, flags

    def _turn(self, message: dict, taught: bool) -> tuple[list[int], list[bool]]:
        """A turn's marker, content and end (EOS after the assistant's), and which of them are taught."""
        ids, flags = self._content(message, taught)
        end = [self.eos_token_id] if message["role"] == "assistant" else self.turn_end
        marker = self.markers["system" if message["role"] == "developer" else message["role"]]
        return marker + ids + end, [False] * len(marker) + flags + [taught] * len(end)

    def render(self, conversation: Conversation) -> tuple[list[int], list[int]]:
        """Causally aligned ids and labels: labels[j] is the target of position j, -100 where not taught."""
        if conversation.text is not None:
            ids = self.tokenizer.encode(conversation.text) + [self.eos_token_id]
            return ids, ids[1:] + [IGNORE_INDEX]
        self._refuse_tools(conversation.messages, conversation.tools)
        self._refuse_unmarked_system(conversation.messages)
        taught = set(conversation.taught_turns(self.supervise))
        ids: list[int] = []
        supervised: list[bool] = []
        for turn, message in enumerate(conversation.messages):
            turn_ids, flags = self._turn(message, turn in taught)
            ids, supervised = ids + turn_ids, supervised + flags
        labels = [ids[j + 1] if supervised[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)]
        return ids, labels + [IGNORE_INDEX]

    def render_prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """What a model trained on this template sees before it answers `messages` (see
        conversation_to_answer): every turn as in training, then the assistant marker (never empty: see
        ChatTemplate)."""
        self._refuse_tools(messages, tools)
        self._refuse_unmarked_system(messages)
        ids: list[int] = []
        for message in messages:
            ids += self._turn(message, False)[0]
        return ids + self.markers["assistant"]

    def _refuse_unmarked_system(self, messages: list[dict]) -> None:
        """A template with no system marker (for data without system turns) cannot write one: it would run into
        the turn after it."""
        if not self.template.system and any(m["role"] in ("system", "developer") for m in messages):
            raise ConvertError("the template names no system marker (system: ''), so a system turn would run into "
                               "the turn after it: give the template a system marker, or leave system turns out")

    @staticmethod
    def _refuse_tools(messages: list[dict], tools: list | None) -> None:
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            raise ConvertError("the marker template has no place for tools, tool calls or tool turns: render "
                               "this conversation through the tokenizer's own chat template (template: tokenizer)")


def _refuse_unknown_specials(tokenizer: ByteTokenizer | JsonTokenizer | PretrainedTokenizer,
                             template: ChatTemplate) -> None:
    """A marker piece spelled like a special token must be one: else it is encoded as several tokens of plain
    text, longer, and the same as a message that spells it, so a user could forge a turn."""
    for key, value in asdict(template).items():
        for piece in SPECIAL_LOOKING.findall(value):
            if tokenizer.token_id(piece) is None:
                raise ConvertError(f"template {key} {value!r}: tokenizer {tokenizer.description} has no token "
                                   f"{piece!r}, so it would be written as {len(tokenizer.encode(piece))} tokens of "
                                   "plain text that any message can spell; give every marker the tokenizer's own "
                                   f"special tokens (for ChatML: {CHATML}), or add {piece!r} to the tokenizer")
