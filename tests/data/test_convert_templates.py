"""`template: tokenizer`: every example is apply_chat_template's tokens, token for token, and teaches exactly the
assistant's part and its end token; tools, tool calls and reasoning pass through the template; the manifest
records the template's SHA-256."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from cflib.data.conversation import Conversation, ConvertError, conversation_digest
from cflib.data.convert import IDENTITY_SAMPLE, ConvertSpec, convert, held_out
from cflib.data.marker_template import ChatTemplate
from cflib.data.reasoning import BLOCK_AND_SPACE
from cflib.data.shards import IGNORE_INDEX, open_shard
from cflib.data.tokenizer import ByteTokenizer
from cflib.data.tokenizer_template import TemplateRenderer

datasets = pytest.importorskip("datasets", reason="the data extra (pip install cflib[data])")

try:
    from chat_tokenizers import released_like_template, tokenizer_folder, train_bpe, turn
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests.chat_tokenizers import released_like_template, tokenizer_folder, train_bpe, turn


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The released-like template in tokenizer_config.json (taught spans by rendered prefixes), and with
    {% generation %} blocks in chat_template.jinja."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {"prefixes": tokenizer_folder(root / "prefixes"),
            "generation": tokenizer_folder(root / "generation", generation=True, template_file=True)}


# Content with spaces around it: the template trims it, so the taught text is the stripped content.
SHAREGPT = [{"conversations": [{"from": "human", "value": f" What is {i} plus {i}? "},
                               {"from": "gpt", "value": f" It is {2 * i}. "}]
             + ([{"from": "human", "value": "And twice that?"}, {"from": "gpt", "value": f"{4 * i}"}] if i % 2 else []),
             "system": "Be brief." if i % 3 == 0 else None, "task": "sums"} for i in range(12)]
COMPLETIONS = [{"prompt": [{"role": "user", "content": f"Translate bonjour {i}"}],
                "completion": [{"role": "assistant", "content": f"hello {i}"}], "task": "translate"}
               for i in range(12)]


def sharegpt_messages(row: dict) -> list[dict]:
    roles = {"human": "user", "gpt": "assistant"}
    system = [turn("system", row["system"])] if row["system"] else []
    return system + [turn(roles[t["from"]], t["value"]) for t in row["conversations"]]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(tmp_path: Path, folder: Path, train: list[str], name: str = "shard", **spec) -> dict:
    held = write_jsonl(tmp_path / "held.jsonl", [{"messages": [turn("user", "Hello"), turn("assistant", "Hi")]}])
    return convert(ConvertSpec(train=train, eval=str(held), out=str(tmp_path / name), tokenizer=str(folder),
                               template="tokenizer", **{"max_seq_len": 256, **spec}))


def taught_text(hf, labels: list[int]) -> str:
    return hf.decode([t for t in labels if t != IGNORE_INDEX])


@pytest.mark.parametrize("kind", ["prefixes", "generation"])
def test_every_row_is_apply_chat_templates_tokens_and_teaches_exactly_the_answers(tmp_path, folders, kind):
    parquet = tmp_path / "sharegpt.parquet"
    datasets.Dataset.from_list(SHAREGPT).to_parquet(str(parquet))
    saved = tmp_path / "completions"
    datasets.Dataset.from_list(COMPLETIONS).save_to_disk(str(saved))
    indexes = run(tmp_path, folders[kind], [str(parquet), str(saved)], supervise="all_assistant_turns")
    hf = AutoTokenizer.from_pretrained(folders[kind])
    conversations = [sharegpt_messages(row) for row in SHAREGPT] + [r["prompt"] + r["completion"] for r in COMPLETIONS]
    shard = open_shard(tmp_path / "shard", "train", verify_hashes=True)
    assert len(shard) == len(conversations) == 24
    for index, messages in enumerate(conversations):
        ids, labels = (tensor.tolist() for tensor in shard[index])
        assert ids == hf.apply_chat_template(messages, tokenize=True)["input_ids"], index
        assert taught_text(hf, labels) == "".join(m["content"].strip() + "</s>" for m in messages
                                                  if m["role"] == "assistant"), index
    assert indexes["train"]["eos_token_id"] == hf.convert_tokens_to_ids("</s>")
    assert indexes["train"]["vocab_size"] == len(hf)
    assert indexes["train"]["conversion"]["stats"]["examples_per_source"] == {"completions": 12, "sharegpt": 12}


def test_the_final_turn_alone_is_taught_when_asked(tmp_path, folders):
    rows = [{"messages": sharegpt_messages(SHAREGPT[1])}]
    run(tmp_path, folders["prefixes"], [str(write_jsonl(tmp_path / "a.jsonl", rows))], supervise="final_turn")
    hf = AutoTokenizer.from_pretrained(folders["prefixes"])
    assert taught_text(hf, open_shard(tmp_path / "shard", "train")[0][1].tolist()) == "4</s>"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
AGENT = [turn("user", "What is the weather in Paris?"), {"role": "assistant", "tool_calls": [CALL]},
         turn("tool", "sunny", tool_call_id="call-1"),
         turn("assistant", "It is sunny in Paris.", reasoning_content="The tool says sunny.")]
THINKER = [turn("user", "What is 12+34?"), turn("assistant", "<think>12 and 34 make 46</think>\n46")]


@pytest.mark.parametrize("kind", ["prefixes", "generation"])
@pytest.mark.parametrize("reasoning, taught", [
    ("supervise", ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call></s>'
                   "<think>The tool says sunny.</think>It is sunny in Paris.</s>",
                   "<think>12 and 34 make 46</think>\n46</s>"]),
    ("mask", ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call></s>'
              "It is sunny in Paris.</s>", "\n46</s>"]),
    ("strip", ['<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call></s>'
               "It is sunny in Paris.</s>", "46</s>"]),
])
def test_tool_calls_and_reasoning_pass_through_the_template(tmp_path, folders, kind, reasoning, taught):
    rows = [{"messages": AGENT, "tools": TOOLS}, {"messages": THINKER}]
    run(tmp_path, folders[kind], [str(write_jsonl(tmp_path / "agent.jsonl", rows))], reasoning=reasoning,
        supervise="all_assistant_turns")
    hf = AutoTokenizer.from_pretrained(folders[kind])
    shard = open_shard(tmp_path / "shard", "train")
    for index, (messages, tools) in enumerate([(AGENT, TOOLS), (THINKER, None)]):
        if reasoning == "strip":
            messages = [{k: (BLOCK_AND_SPACE.sub("", v) if k == "content" else v) for k, v in m.items()
                         if k != "reasoning_content"} for m in messages]
        ids, labels = (tensor.tolist() for tensor in shard[index])
        assert ids == hf.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"]
        assert taught_text(hf, labels) == taught[index]
    assert '"description": "the weather in a city"' in hf.decode(shard[0][0].tolist())


def test_the_manifest_records_the_template_and_tokenizer_files(tmp_path, folders):
    indexes = run(tmp_path, folders["generation"], [str(write_jsonl(tmp_path / "a.jsonl", [{"messages": THINKER}]))])
    conversion = indexes["train"]["conversion"]
    template = (folders["generation"] / "chat_template.jinja").read_text()
    assert conversion["template"] == {"kind": "tokenizer", "file": "chat_template.jinja",
                                      "sha256": hashlib.sha256(template.encode()).hexdigest(),
                                      "taught_spans": "generation blocks"}
    assert conversion["tokenizer"]["kind"] == "folder"
    assert set(conversion["tokenizer"]["sha256"]) == {"tokenizer.json", "tokenizer_config.json",
                                                      "chat_template.jinja"}


def test_a_template_that_renders_turns_unlike_its_prefixes_needs_generation_blocks(tmp_path):
    # The generation prompt says "<|assistant|>\n" but an assistant turn begins "<|assistant|> ".
    odd = released_like_template().replace("{{- '<|assistant|>\\n' -}}{%- if message.reasoning",
                                           "{{- '<|assistant|> ' -}}{%- if message.reasoning")
    folder = tokenizer_folder(tmp_path / "odd", template=odd)
    source = str(write_jsonl(tmp_path / "a.jsonl", [{"messages": THINKER}]))
    with pytest.raises(ConvertError, match=r"a.jsonl row 1: message 1: the template renders this conversation's "
                                           r"turns differently from its prefixes.*\{% generation %\}"):
        run(tmp_path, folder, [source])
    assert not (tmp_path / "shard").exists()


def checked_prompts(monkeypatch) -> list[str]:
    """The first user turn of each conversation checked against apply_chat_template, as the checks go."""
    checked = []
    original = TemplateRenderer.reference_ids

    def counted(self, conversation):
        checked.append(conversation.messages[0]["content"])
        return original(self, conversation)

    monkeypatch.setattr(TemplateRenderer, "reference_ids", counted)
    return checked


def test_the_first_rows_of_each_source_are_checked_against_apply_chat_template(tmp_path, folders, monkeypatch):
    rows = [{"messages": [turn("user", f"Hello {i}"), turn("assistant", f"Hi {i}")]} for i in range(40)]
    source = str(write_jsonl(tmp_path / "a.jsonl", rows))
    original = TemplateRenderer.reference_ids
    checked = checked_prompts(monkeypatch)
    run(tmp_path, folders["prefixes"], [source])
    assert checked == [f"Hello {i}" for i in range(IDENTITY_SAMPLE)] + ["Hello"]  # train's sample, then eval's
    monkeypatch.setattr(TemplateRenderer, "reference_ids", lambda self, conversation: original(
        self, conversation)[:-1])  # a renderer that drifts from apply_chat_template
    with pytest.raises(ConvertError, match="a.jsonl row 1: the rendered ids differ from apply_chat_template's"):
        run(tmp_path, folders["prefixes"], [source], name="drifted")
    assert not (tmp_path / "drifted").exists()


def test_under_eval_fraction_the_first_rows_of_each_source_are_checked_in_each_partition(tmp_path, folders,
                                                                                         monkeypatch):
    """The eval partition, read from what the train partition kept, checks the first rows of each source as when
    it read the sources itself."""
    names = {"a": [f"Hello {i}" for i in range(40)], "b": [f"Bye {i}" for i in range(40)]}
    sources = [str(write_jsonl(tmp_path / f"{name}.jsonl", [{"messages": [turn("user", text), turn("assistant", "Hi")]}
                                                            for text in texts])) for name, texts in names.items()]
    checked = checked_prompts(monkeypatch)
    convert(ConvertSpec(train=sources, eval_fraction=0.5, seed=1, out=str(tmp_path / "shard"), tokenizer=str(
        folders["prefixes"]), template="tokenizer", max_seq_len=256))
    side = {text: held_out(conversation_digest(Conversation([turn("user", text), turn("assistant", "Hi")])), 1, 0.5)
            for texts in names.values() for text in texts}
    assert checked == [text for to_eval in (False, True) for texts in names.values()
                       for text in [text for text in texts if side[text] == to_eval][:IDENTITY_SAMPLE]]

def test_plain_text_through_a_tokenizer_folder_is_taught_whole(tmp_path, folders):
    run(tmp_path, folders["prefixes"], [str(write_jsonl(tmp_path / "t.jsonl", [{"text": "Hello </s> world"}]))])
    hf = AutoTokenizer.from_pretrained(folders["prefixes"])
    ids, labels = (tensor.tolist() for tensor in open_shard(tmp_path / "shard", "train")[0])
    assert ids == hf.encode("Hello </s> world", add_special_tokens=False, split_special_tokens=True) + [hf.eos_token_id]
    assert labels == ids[1:] + [IGNORE_INDEX]


def test_the_marker_template_keeps_the_spaces_the_released_template_trims(tmp_path, folders):
    """The same conversation, the same tokenizer: role markers write content as it is, the released template
    trims it, so they differ exactly where a message has leading or trailing spaces."""
    messages = [turn("user", "  What is 2 plus 2?  "), turn("assistant", " It is 4. ")]
    source = str(write_jsonl(tmp_path / "a.jsonl", [{"messages": messages}]))
    markers = ChatTemplate(system="<|system|>\n", user="<|user|>\n", assistant="<|assistant|>\n", turn_end="</s>\n",
                           eos="</s>")
    run(tmp_path, folders["prefixes"], [source], name="template")  # writes held.jsonl too
    convert(ConvertSpec(train=source, eval=str(tmp_path / "held.jsonl"), out=str(tmp_path / "markers"),
                        tokenizer=str(folders["prefixes"]), template=markers, max_seq_len=256))
    hf = AutoTokenizer.from_pretrained(folders["prefixes"])
    marked = open_shard(tmp_path / "markers", "train")[0][0].tolist()
    templated = open_shard(tmp_path / "template", "train")[0][0].tolist()
    assert hf.decode(marked) == "<|user|>\n  What is 2 plus 2?  </s>\n<|assistant|>\n It is 4. </s>"
    assert hf.decode(templated) == "<|user|>\nWhat is 2 plus 2?</s>\n<|assistant|>\nIt is 4.</s>\n"
    assert len(marked) > len(templated)


def variant(old: str, new: str, generation: bool = False) -> str:
    """The released-like template with one piece of it changed."""
    template = released_like_template(generation)
    assert template.count(old) == 1, old
    return template.replace(old, new)


TOOLS_PART = "{%- if tools -%}{{- '<|system|>\\n' + (tools | tojson) + '</s>\\n' -}}{%- endif -%}"
CALLS_PART = ("{%- if message.tool_calls is defined -%}{%- for call in message.tool_calls -%}"
              "{{- '<tool_call>' + (call.function | tojson) + '</tool_call>' -}}{%- endfor -%}{%- endif -%}")


@pytest.mark.parametrize("template, words", [
    (variant(TOOLS_PART + "{%- for", "{%- for").replace(CALLS_PART, ""),
     "agent.jsonl row 1: the chat template does not render the row's tools"),
    (variant(CALLS_PART, ""), "agent.jsonl row 1: message 1: the chat template renders this assistant turn without "
                              "its call of 'get_weather'"),
], ids=["no-tools", "no-tool-calls"])
def test_a_template_that_drops_the_tools_or_a_tool_call_is_refused(tmp_path, template, words):
    """Else the model is taught an empty turn where the row called a tool, or calls to tools it never saw."""
    folder = tokenizer_folder(tmp_path / "tok", template=template)
    source = str(write_jsonl(tmp_path / "agent.jsonl", [{"messages": AGENT, "tools": TOOLS}]))
    with pytest.raises(ConvertError, match=re.escape(words) + ".*choose a chat template that renders tools"):
        run(tmp_path, folder, [source], supervise="all_assistant_turns")
    assert not (tmp_path / "shard").exists()


UNGUARDED = ("{%- for message in messages -%}{{- '<|' + message.role + '|>\\n' + message.content + '</s>\\n' -}}"
             "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}")
NO_SYSTEM = ("{%- if messages[0].role == 'system' -%}{{- raise_exception('this template has no system role') -}}"
             "{%- endif -%}" + released_like_template())


@pytest.mark.parametrize("template, messages, words", [
    (UNGUARDED, AGENT, "(UndefinedError: 'dict object' has no attribute 'content')"),
    (NO_SYSTEM, [turn("system", "Be brief."), *THINKER], "(TemplateError: this template has no system role)"),
], ids=["reads-a-missing-field", "raises"])
def test_a_template_that_fails_on_a_row_names_the_row(tmp_path, template, messages, words):
    folder = tokenizer_folder(tmp_path / "tok", template=template)
    source = str(write_jsonl(tmp_path / "a.jsonl", [{"messages": messages}]))
    with pytest.raises(ConvertError, match=r"a.jsonl row 1: the chat template cannot render this conversation " +
                       re.escape(words)):
        run(tmp_path, folder, [source])
    assert not (tmp_path / "shard").exists()


CHATML = ("{%- for message in messages -%}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
          "'<|im_end|>\\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
          "{%- endif -%}")


def chatml_folder(folder: Path, eos_token: str) -> Path:
    """A ChatML tokenizer folder as base models ship it: turns end with <|im_end|>, the config names eos_token."""
    tokenizer_folder(folder, template=CHATML)
    tokenizer = train_bpe()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos_token}))
    return folder


ANSWER = [{"messages": [turn("user", "What is 12+34?"), turn("assistant", "46")]}]


@pytest.mark.parametrize("template, words", [
    (variant("{{- '</s>' -}}", ""), "no end-of-turn token ends the taught part"),
    (variant("{{- '</s>' -}}{%- endgeneration -%}", "{%- endgeneration -%}{{- '</s>' -}}", generation=True),
     "outside its {% generation %} block"),
], ids=["no-end-token", "end-token-outside-the-generation-block"])
def test_a_template_whose_taught_turn_does_not_end_with_eos_is_refused(tmp_path, template, words):
    """The chat and the exported model stop at eos_token: a model taught to end its turns otherwise never stops."""
    folder = tokenizer_folder(tmp_path / "tok", template=template)
    with pytest.raises(ConvertError, match="a.jsonl row 1: message 1: the chat template ends this assistant turn "
                                           "with '46', not the tokenizer's eos_token '</s>'.*" + re.escape(words)):
        run(tmp_path, folder, [str(write_jsonl(tmp_path / "a.jsonl", ANSWER))])
    assert not (tmp_path / "shard").exists()


def test_a_chatml_folder_whose_eos_token_is_not_its_turn_end_is_refused_until_it_is(tmp_path):
    """A base model's folder (Qwen's): turns end with <|im_end|>, eos_token is <|endoftext|>. Refused, naming the
    token; set as the message says, the conversion teaches it."""
    folder = chatml_folder(tmp_path / "tok", "<|endoftext|>")
    source = str(write_jsonl(tmp_path / "a.jsonl", ANSWER))
    with pytest.raises(ConvertError, match=re.escape(
            "a.jsonl row 1: message 1: the chat template ends this assistant turn with '<|im_end|>', not the "
            "tokenizer's eos_token '<|endoftext|>', so the model would never learn to stop (generation stops at "
            f"eos_token); set \"eos_token\": \"<|im_end|>\" in {folder / 'tokenizer_config.json'}")):
        run(tmp_path, folder, [source])
    assert not (tmp_path / "shard").exists()
    chatml_folder(folder, "<|im_end|>")
    indexes = run(tmp_path, folder, [source])
    hf = AutoTokenizer.from_pretrained(folder)
    assert taught_text(hf, open_shard(tmp_path / "shard", "train")[0][1].tolist()) == "46<|im_end|>"
    assert indexes["train"]["eos_token_id"] == hf.convert_tokens_to_ids("<|im_end|>")


WEIGHTED = [turn("user", "What is 1 plus 1?"), turn("assistant", "It is 3.", weight=0), turn("user", "Sure?"),
            turn("assistant", "It is 2.", weight=1)]


def test_an_assistant_turn_of_weight_0_is_read_not_taught(tmp_path, folders):
    """OpenAI's fine-tuning weight: the turn stays in the conversation, its tokens carry no label; a row whose
    taught turn has weight 0 has nothing to teach and is rejected as an empty answer."""
    rows = [{"messages": WEIGHTED}, {"messages": WEIGHTED[:2]}]
    indexes = run(tmp_path, folders["prefixes"], [str(write_jsonl(tmp_path / "a.jsonl", rows))],
                  supervise="all_assistant_turns")
    hf = AutoTokenizer.from_pretrained(folders["prefixes"])
    shard = open_shard(tmp_path / "shard", "train")
    ids, labels = (tensor.tolist() for tensor in shard[0])
    assert len(shard) == 1 and ids == hf.apply_chat_template(WEIGHTED, tokenize=True)["input_ids"]
    assert taught_text(hf, labels) == "It is 2.</s>"
    assert indexes["train"]["conversion"]["stats"]["rejected"]["empty_answer"] == 1
    convert(ConvertSpec(train=str(tmp_path / "a.jsonl"), eval=str(tmp_path / "held.jsonl"),
                        out=str(tmp_path / "markers"), supervise="all_assistant_turns"))
    labels = open_shard(tmp_path / "markers", "train")[0][1].tolist()
    assert ByteTokenizer().decode_template([t for t in labels if t != IGNORE_INDEX]) == "It is 2.<|eos|>"


PARTS = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
         {"role": "user", "content": [{"type": "text", "text": "What is 2 plus 2?"}]},
         {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]
PLAIN = [turn("system", "Be brief."), turn("user", "What is 2 plus 2?"), turn("assistant", "4")]
NAMES_DEVELOPER = variant("{%- else -%}", "{%- elif message.role == 'developer' -%}{{- '<|system|>\\n(developer) ' "
                                          "+ message.content + '</s>\\n' -}}{%- else -%}")


def test_text_parts_are_joined_and_a_developer_turn_is_the_system_turn(tmp_path, folders):
    """OpenAI's content parts and developer role: the same tokens as the plain conversation with a system turn,
    through the tokenizer's template and through markers; a template that names the developer role gets it."""
    source = str(write_jsonl(tmp_path / "a.jsonl", [{"messages": PARTS}]))
    run(tmp_path, folders["prefixes"], [source])
    hf = AutoTokenizer.from_pretrained(folders["prefixes"])
    assert open_shard(tmp_path / "shard", "train")[0][0].tolist() == hf.apply_chat_template(PLAIN)["input_ids"]
    convert(ConvertSpec(train=source, eval=str(tmp_path / "held.jsonl"), out=str(tmp_path / "markers")))
    assert ByteTokenizer().decode_template(open_shard(tmp_path / "markers", "train")[0][0].tolist()) == (
        "<|system|>Be brief.<|user|>What is 2 plus 2?<|assistant|>4<|eos|>")
    knows = tokenizer_folder(tmp_path / "knows", template=NAMES_DEVELOPER)
    run(tmp_path, knows, [source], name="developer")
    ids = open_shard(tmp_path / "developer", "train")[0][0].tolist()
    assert hf.decode(ids).startswith("<|system|>\n(developer) Be brief.</s>")
