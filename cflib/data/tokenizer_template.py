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

A token is taught when its characters overlap a taught span. What the
template loses is refused, naming the turn: a row's tools it does not render,
an assistant's tool call missing from its turn, a taught turn that does not end
with the tokenizer's `eos_token` (generation stops there, so a model taught
another end never stops), and a conversation the template fails on. A
`developer` turn reaches a template that names that role as it is; any other
template gets it as the system turn it stands for.

The template's
SHA-256 goes to the shard's manifest; the chat and the exported bundle render
with the same template.
"""
from __future__ import annotations

import hashlib
import json
import re
from bisect import bisect_left

from cflib.data.conversation import Conversation, ConvertError
from cflib.data.reasoning import blocks_within, reasons
from cflib.data.shards import IGNORE_INDEX
from cflib.data.tokenizer import PretrainedTokenizer

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
DEVELOPER_ROLE = re.compile(r"""['"]developer['"]""")  # a template that handles the role names it as a string
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")

Span = tuple[int, int]  # [start, end) characters of the rendered text
USE_A_TOOL_TEMPLATE = ("choose a chat template that renders tools and tool calls (the model's own, if it was "
                       "trained to call tools), or leave the tools out of these rows")


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
        sources = [template] if isinstance(template, str) else list(template.values())  # or named templates
        self.knows_developer = any(DEVELOPER_ROLE.search(str(source)) for source in sources)
        # Special and added tokens: what a template ends its turns with, where it ends them with a token at all.
        self.added_ids = set(self.hf.get_added_vocab().values()) | set(self.hf.all_special_ids)
        from jinja2 import TemplateError  # with transformers (the data extra), as a tokenizer folder needs

        # What Jinja raises on a row the template fails on: TypeError where it adds a string to something else.
        self.template_errors = (TemplateError, TypeError)

    def record(self) -> dict:
        return {"kind": "tokenizer", "sha256": self.template_sha256,
                "file": next((name for name in TEMPLATE_FILES if (self.tokenizer.path / name).is_file()), None),
                "taught_spans": "generation blocks" if self.generation_blocks else "rendered prefixes"}

    def reference_ids(self, conversation: Conversation) -> list[int]:
        """apply_chat_template's own token ids for the conversation: what every example must equal."""
        return list(self._apply(conversation.messages, conversation.tools, tokenize=True,
                                return_dict=True)["input_ids"])

    def render_prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """The conversation, then the template's generation prompt: what the model answers."""
        return list(self._apply(messages, tools, add_generation_prompt=True, tokenize=True,
                                return_dict=True)["input_ids"])

    def _text(self, messages: list[dict], tools: list | None, generation_prompt: bool = False) -> str:
        return self._apply(messages, tools, add_generation_prompt=generation_prompt, tokenize=False)

    def _apply(self, messages: list[dict], tools: list | None, **options) -> object:
        """apply_chat_template on the messages as this template takes them. A template that fails on a row
        (reads a field the row lacks, raises on what it holds) is a ConvertError the caller names the row in,
        not a traceback: Jinja raises TemplateError, and TypeError where it adds a string to something else."""
        try:
            return self.hf.apply_chat_template(self._as_template_takes(messages), tools=tools, **options)
        except self.template_errors as err:
            raise ConvertError(f"the chat template cannot render this conversation ({type(err).__name__}: {err}); "
                               "it reads a field the row lacks (content on a tool-call turn, say) or refuses what "
                               "the row holds: give the row what the template expects, or choose a template that "
                               "handles it") from None

    def _as_template_takes(self, messages: list[dict]) -> list[dict]:
        """The messages with a developer turn as the system turn it stands for, unless the template names the
        developer role: another template would render it as a role the model never saw, or add its default
        system turn in front of it."""
        if self.knows_developer or not any(m["role"] == "developer" for m in messages):
            return messages
        return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]

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
        self._check_tools_rendered(conversation, text, dict(zip(answers, spans)))
        turns = conversation.taught_turns(self.supervise)
        taught = [spans[answers.index(turn)] for turn in turns]
        self._check_turn_ends(ids, offsets, text, dict(zip(turns, taught)))
        masked = self._masked_reasoning([conversation.messages[turn] for turn in turns], text, taught)
        supervised = [_overlaps((start, end), taught) and not _overlaps((start, end), masked)
                      for start, end in offsets]
        labels = [ids[j + 1] if supervised[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)]
        return ids, labels + [IGNORE_INDEX]

    def _check_tools_rendered(self, conversation: Conversation, text: str, spans: dict[int, Span]) -> None:
        """A template without a place for tools drops them without a word: the model would learn to call
        functions it was never shown, or an empty turn where the row called one."""
        if conversation.tools and text == self._text(conversation.messages, None):
            raise ConvertError(f"the chat template does not render the row's tools (the conversation renders the "
                               f"same with and without its {len(conversation.tools)} tool(s)), so the model would "
                               f"never see what it may call; {USE_A_TOOL_TEMPLATE}")
        for turn, (start, end) in spans.items():
            for call in conversation.messages[turn].get("tool_calls") or []:
                name = (call.get("function") or call)["name"]
                if name not in text[start:end]:
                    where = " inside its {% generation %} block" if self.generation_blocks else ""
                    raise ConvertError(f"message {turn}: the chat template renders this assistant turn without its "
                                       f"call of {name!r}{where} (its part reads {text[start:end][:80]!r}); "
                                       f"{USE_A_TOOL_TEMPLATE}")

    def _check_turn_ends(self, ids: list[int], offsets: list[Span], text: str, taught: dict[int, Span]) -> None:
        """Each taught turn's last token (the whitespace after it aside) must be the tokenizer's eos_token: the
        chat and the exported model stop generating at that id, so a model taught to end its turns with
        another token talks on past them."""
        starts = [a for a, _ in offsets]  # in order: the last token of a span is found by bisection, not a scan
        for turn, (start, end) in taught.items():
            last = bisect_left(starts, start + len(text[start:end].rstrip())) - 1
            while last >= 0 and offsets[last][1] <= offsets[last][0]:  # a token of no text (a BOS) ends nothing
                last -= 1
            end_id = ids[last] if last >= 0 and offsets[last][1] > start else None
            if end_id == self.eos_token_id:
                continue
            ending = "nothing" if end_id is None else repr(self.hf.convert_ids_to_tokens(end_id))
            raise ConvertError(f"message {turn}: the chat template ends this assistant turn with {ending}, not the "
                               f"tokenizer's eos_token {self.hf.eos_token!r}, so the model would never learn to "
                               f"stop (generation stops at eos_token); {self._turn_end_fix(end_id)}")

    def _turn_end_fix(self, end_id: int | None) -> str:
        """How to make the template's turn end and the eos_token agree, for the token the turns end with."""
        token = None if end_id is None else self.hf.convert_ids_to_tokens(end_id)
        if end_id in self.added_ids:  # a special token the template ends every turn with, as ChatML's <|im_end|>
            return (f"set \"eos_token\": {json.dumps(token)} in {self.tokenizer.path / 'tokenizer_config.json'} "
                    f"(the token this template ends turns with), or choose a template that ends each assistant "
                    f"turn with {self.hf.eos_token!r}")
        return (f"no end-of-turn token ends the taught part of the turn (the template writes none, or writes it "
                f"outside its {{% generation %}} block): choose a template that ends each assistant turn with "
                f"{self.hf.eos_token!r}, inside the generation block where it has one")

    def _generation_spans(self, conversation: Conversation) -> tuple[list[int], list[Span], list[Span]]:
        """apply_chat_template's ids, their character offsets, and its generation blocks as character spans."""
        out = self._apply(conversation.messages, conversation.tools, tokenize=True, return_dict=True,
                          return_assistant_tokens_mask=True, tokenizer_kwargs={"return_offsets_mapping": True})
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
