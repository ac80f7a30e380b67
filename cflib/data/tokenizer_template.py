"""The tokenizer's own chat template: conversations rendered by its Jinja `chat_template`, as at inference.

Every conversation renders through `transformers`' `apply_chat_template`, so
the input ids of an example are exactly those that
`apply_chat_template(messages, tools=tools, tokenize=True)` gives: tools,
tool calls, tool turns and reasoning reach the template as the row has them.
The taught positions are the assistant spans:

- where the template marks them with `{% generation %}` blocks, those blocks
  (transformers' `return_assistant_tokens_mask`);
- else by rendering prefixes: an assistant turn's span is what rendering the
  conversation up to that turn adds to rendering the turns before it with the
  generation prompt, without the whitespace the template puts after it. A
  template whose prefixes do not render as prefixes of the whole conversation
  (one that rewrites earlier turns) is refused: give it generation blocks.

A token is taught when its characters overlap a taught span. The template's
SHA-256 goes to the shard's manifest; the chat and the exported bundle render
with the same template.
"""
from __future__ import annotations

import hashlib
import json
import re

from cflib.data.conversation import Conversation, ConvertError
from cflib.data.reasoning import blocks_within, reasons
from cflib.data.shards import IGNORE_INDEX
from cflib.data.tokenizer import PretrainedTokenizer

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")

Span = tuple[int, int]  # [start, end) characters of the rendered text


def chat_template_sha256(template: str | dict) -> str:
    """SHA-256 of a chat template's text (of its JSON, keys sorted, for a set of named templates)."""
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class TemplateRenderer:
    """Conversations to (input_ids, labels) through a tokenizer folder's chat template."""

    def __init__(self, tokenizer: PretrainedTokenizer, supervise: str, reasoning: str = "supervise") -> None:
        self.tokenizer, self.supervise, self.reasoning = tokenizer, supervise, reasoning
        self.hf = tokenizer.hf
        template = self.hf.chat_template
        if not template:
            raise ConvertError(f"{tokenizer.path}: no chat template (chat_template.jinja, or chat_template in "
                               "tokenizer_config.json); template: tokenizer needs one")
        self.template_sha256 = chat_template_sha256(template)
        self.generation_blocks = bool(GENERATION_BLOCK.search(json.dumps(template)))
        self.eos_token_id = self.hf.eos_token_id
        if self.eos_token_id is None:
            raise ConvertError(f"{tokenizer.path}: its tokenizer_config.json names no eos_token, which ends "
                               "every example")

    def record(self) -> dict:
        return {"kind": "tokenizer", "sha256": self.template_sha256,
                "file": next((name for name in TEMPLATE_FILES if (self.tokenizer.path / name).is_file()), None),
                "taught_spans": "generation blocks" if self.generation_blocks else "rendered prefixes"}

    def reference_ids(self, conversation: Conversation) -> list[int]:
        """apply_chat_template's own token ids for the conversation: what every example must equal."""
        return list(self.hf.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True,
                                                return_dict=True)["input_ids"])

    def render_prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """The conversation, then the template's generation prompt: what the model answers."""
        return list(self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"])

    def _text(self, messages: list[dict], tools: list | None, generation_prompt: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                           tokenize=False)

    def render(self, conversation: Conversation) -> tuple[list[int], list[int]]:
        """Causally aligned ids and labels: labels[j] is the target of position j, -100 where not taught."""
        if conversation.text is not None:
            ids = self.tokenizer.encode(conversation.text) + [self.eos_token_id]
            return ids, ids[1:] + [IGNORE_INDEX]
        text = self._text(conversation.messages, conversation.tools)  # the characters the offsets count
        if self.generation_blocks:
            ids, offsets, spans = self._generation_spans(conversation)
        else:
            encoded = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
            spans = self._prefix_spans(conversation, text)
        answers = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        if len(spans) != len(answers):
            raise ConvertError(f"the template marks {len(spans)} assistant span(s) for {len(answers)} assistant "
                               "turn(s): it must render each assistant turn in one generation block")
        turns = conversation.taught_turns(self.supervise)
        taught = [spans[answers.index(turn)] for turn in turns]
        masked = self._masked_reasoning([conversation.messages[turn] for turn in turns], text, taught)
        supervised = [_overlaps((start, end), taught) and not _overlaps((start, end), masked)
                      for start, end in offsets]
        labels = [ids[j + 1] if supervised[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)]
        return ids, labels + [IGNORE_INDEX]

    def _generation_spans(self, conversation: Conversation) -> tuple[list[int], list[Span], list[Span]]:
        """apply_chat_template's ids, their character offsets, and its generation blocks as character spans."""
        out = self.hf.apply_chat_template(conversation.messages, tools=conversation.tools, tokenize=True,
                                          return_dict=True, return_assistant_tokens_mask=True,
                                          tokenizer_kwargs={"return_offsets_mapping": True})
        offsets, mask = out["offset_mapping"], out["assistant_masks"]
        spans: list[Span] = []
        for index, marked in enumerate(mask):
            if marked and (index == 0 or not mask[index - 1]):
                spans.append((offsets[index][0], offsets[index][1]))
            elif marked:
                spans[-1] = (spans[-1][0], offsets[index][1])
        return list(out["input_ids"]), offsets, spans

    def _prefix_spans(self, conversation: Conversation, text: str) -> list[Span]:
        """Each assistant turn's span: what rendering up to it adds to the generation prompt before it."""
        spans = []
        for turn, message in enumerate(conversation.messages):
            if message["role"] != "assistant":
                continue
            before = self._text(conversation.messages[:turn], conversation.tools, generation_prompt=True)
            through = self._text(conversation.messages[:turn + 1], conversation.tools)
            if not (through.startswith(before) and text.startswith(through)):
                raise ConvertError(f"message {turn}: the template renders this conversation's turns differently "
                                   "from its prefixes (it rewrites earlier turns, or its generation prompt is not "
                                   "how an assistant turn begins); mark the assistant turns with {% generation %} "
                                   "blocks in the template")
            spans.append((len(before), len(through.rstrip())))
        return spans

    def _masked_reasoning(self, taught_turns: list[dict], text: str, taught: list[Span]) -> list[Span]:
        """Under `mask`, the <think> blocks inside the taught spans: read, not taught."""
        if self.reasoning != "mask" or not any(map(reasons, taught_turns)):
            return []
        blocks = blocks_within(text, taught)
        if not blocks:
            raise ConvertError("reasoning mask: the template rendered no <think>...</think> block inside a taught "
                               "assistant turn, so nothing tells which tokens are reasoning")
        return blocks


def _overlaps(token: Span, spans: list[Span]) -> bool:
    start, end = token
    return end > start and any(end > span_start and start < span_end for span_start, span_end in spans)
