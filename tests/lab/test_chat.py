"""cflib.lab.chat and chat_box: prompts formatted as in training, answers through the decoder, bad input refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import cflib.jsonio
from cflib.data import ChatRenderer, ChatTemplate, Conversation, ConvertError, chat_template_sha256
from cflib.data.shards import sha256_file
from cflib.errors import ParamError
from cflib.lab.chat import (
    Chat,
    ChatParams,
    ChatSession,
    answer_prompts,
    find_checkpoint,
    headline,
    prepare_chat,
    read_conversations,
    show_answers_of,
)
from cflib.lab.chat_box import ChatBox
from cflib.export.peft import describe_base, load_merged
from cflib.model import CheckpointError, TRMoEModel, load_checkpoint, preset, save_checkpoint
from cflib.model.generate import Decoder, GenerationError, Sampling
from cflib.model.lora import LoraSettings, adapter_state_dict, attach_lora
from cflib.train.adapters import LoraRun

try:
    import sft_shard_helpers as h
    from chat_tokenizers import tokenizer_folder, turn
    from test_readers import refused_without_waiting
    from tiny_models import tiny_model, trained_model
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests import sft_shard_helpers as h
    from tests.chat_tokenizers import tokenizer_folder, turn
    from tests.test_readers import refused_without_waiting
    from tests.tiny_models import tiny_model, trained_model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run folder whose checkpoints/best is a tiny model half-trained on the chat examples (64 positions)."""
    run = tmp_path_factory.mktemp("run")
    model = trained_model([e.input_ids for e in h.chat_examples()] + [h.two_turn_example().input_ids], h.VOCAB,
                          steps=25)
    save_checkpoint(model, run / "checkpoints" / "best")
    return run


@pytest.fixture(scope="module")
def session(run_dir):
    return ChatSession(run_dir, device="cpu")


def word_tokenizer(path, words: int) -> str:
    """A tokenizer.json of `words` plain words plus the chat specials."""
    specials = ["<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {token: index for index, token in enumerate(specials + ["[UNK]"] + [f"w{i}" for i in range(words)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(path))
    return str(path)


def test_prompts_render_as_the_training_data(session):
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "reverse dog"}]
    first, _ = h.TOKENIZER.encode_chat("hi", "hello")
    assert session.prompt_ids([conversation], 4) == [first + h.TOKENIZER.encode_prompt("reverse dog")]
    assert session.prompt_ids([conversation[:1]], 4) == [h.TOKENIZER.encode_prompt("hi")]


def test_answers_come_from_the_decoder_and_are_written_with_a_record(session, run_dir, tmp_path):
    params = ChatParams.from_dict({"checkpoint": str(run_dir), "prompts": ["12+34=", "reverse planet", {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                     {"role": "user", "content": "reverse dog"}]}], "max_new_tokens": 8, "device": "cpu"})
    conversations = read_conversations(params.prompts)
    record = answer_prompts(Chat(session, conversations, tmp_path, trained_here=False), params)
    rows = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    expected = Decoder(session.model).generate(session.prompt_ids(conversations, 8), 8, eos_token_id=h.EOS)
    assert [row["answer_ids"] for row in rows] == expected
    assert [row["answer"] for row in rows] == [h.TOKENIZER.decode([t for t in ids if t != h.EOS]) for ids in expected]
    assert rows[2]["messages"] == conversations[2]
    assert {row["stopped_by"] for row in rows} <= {"eos", "max_new_tokens"}
    saved = json.loads((tmp_path / "record.json").read_text())
    assert saved["checkpoint"]["sha256"] == sha256_file(run_dir / "checkpoints" / "best" / "model.safetensors")
    assert saved["checkpoint"]["path"] == str(run_dir / "checkpoints" / "best")
    assert saved["timing"]["new_tokens"] == sum(map(len, expected)) and saved["timing"]["tokens_per_s"] > 0
    assert saved["generation"]["max_new_tokens"] == 8 and saved["tokenizer"]["kind"] == "byte"
    assert saved["decoder"]["kernel_path"]["attention"] == "sdpa_kv_cache"
    assert headline(record).startswith("3 conversations answered (greedy, up to 8 new tokens) by a ")


def test_a_reply_streams_its_text_and_the_chat_box_keeps_the_conversation(session):
    generation = ChatParams(prompts=["x"], max_new_tokens=6).generation()
    shown: list[str] = []
    messages = [{"role": "user", "content": "reverse abc"}]
    answer = session.reply(messages, generation, on_text=shown.append)
    assert shown and shown[-1] == answer and all(b.startswith(a) for a, b in zip(shown, shown[1:]))

    box = ChatBox(session, generation, system="be brief")
    assert box.send("reverse abc") == session.reply([{"role": "system", "content": "be brief"}, *messages],
                                                    generation, on_text=lambda _: None)
    second = box.send("12+34=")
    assert [m["role"] for m in box.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert box.messages[-1]["content"] == second and "12+34=" in box.transcript.value
    assert box.send("x" * 80) is None  # past the model's 64 positions: said in the box, the turn not kept
    assert "max_position_embeddings 64" in box.transcript.value and len(box.messages) == 5
    box.restart()
    assert box.messages == [{"role": "system", "content": "be brief"}]


def test_find_checkpoint_takes_a_checkpoint_or_a_run_folder(run_dir, tmp_path):
    assert find_checkpoint(run_dir) == find_checkpoint(run_dir / "checkpoints" / "best") == \
        run_dir / "checkpoints" / "best"
    with pytest.raises(CheckpointError, match="neither a checkpoint folder"):
        find_checkpoint(tmp_path)
    adapters = tmp_path / "lora-run" / "checkpoints" / "best"
    adapters.mkdir(parents=True)
    (adapters / "adapter_config.json").write_text("{}")
    assert find_checkpoint(tmp_path / "lora-run") == adapters


def test_a_run_without_a_best_checkpoint_answers_with_its_last_else_its_newest_numbered_one(tmp_path):
    """The rule export and evaluate follow (run_checkpoint), for models and for LoRA adapters alike."""
    from cflib.export.publish import resolve_adapters

    checkpoints = tmp_path / "run" / "checkpoints"
    for name in ("step-9", "step-12", "epoch-1"):
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "adapter_config.json").write_text("{}")
    assert find_checkpoint(tmp_path / "run") == resolve_adapters(tmp_path / "run") == checkpoints / "epoch-1"
    (checkpoints / "epoch-1" / "adapter_config.json").unlink()
    assert find_checkpoint(tmp_path / "run") == resolve_adapters(tmp_path / "run") == checkpoints / "step-12"
    save_checkpoint(TRMoEModel(preset("smoke")), checkpoints / "last")
    assert find_checkpoint(tmp_path / "run") == checkpoints / "last"
    assert resolve_adapters(tmp_path / "run") == checkpoints / "step-12"  # last/ holds a model, not adapters


def test_a_lora_run_answers_with_its_adapters_merged_into_their_base(run_dir, session, tmp_path):
    settings = LoraSettings(rank=2, alpha=4)
    model = attach_lora(load_checkpoint(run_dir / "checkpoints" / "best"), settings)
    with torch.no_grad():
        for param in adapter_state_dict(model).values():
            param.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(0))
    LoraRun(settings, describe_base(run_dir / "checkpoints" / "best")).save(model, tmp_path / "run" / "checkpoints"
                                                                          / "best")
    lora = ChatSession(tmp_path / "run", device="cpu")
    prompts = session.prompt_ids([[{"role": "user", "content": "12+34="}]], 8)
    assert lora.decoder.generate(prompts, 8) == Decoder(load_merged(tmp_path / "run" / "checkpoints" / "best")
                                                        ).generate(prompts, 8)
    described = lora.describe()["checkpoint"]
    assert described["lora_adapters_merged"] is True and described["sha256"] == sha256_file(
        tmp_path / "run" / "checkpoints" / "best" / "adapter_model.safetensors")
    assert described["base_matches_training"] is True


def test_adapters_merged_into_a_base_changed_since_their_training_are_said_to_be(run_dir, tmp_path):
    """Training and resume refuse a changed base, and export merge notes it: the chat warns and records it."""
    base = save_checkpoint(load_checkpoint(run_dir / "checkpoints" / "best"), tmp_path / "base")
    settings = LoraSettings(rank=2, alpha=4)
    model = attach_lora(load_checkpoint(base), settings)
    LoraRun(settings, describe_base(base)).save(model, tmp_path / "adapters")
    changed = load_checkpoint(base)
    with torch.no_grad():
        changed.norm.weight.mul_(1.5)
    save_checkpoint(changed, base)
    with pytest.warns(UserWarning, match="has changed since they were trained"):
        session = ChatSession(tmp_path / "adapters", device="cpu")
    assert session.describe()["checkpoint"]["base_matches_training"] is False


def test_notebook_parameters_take_the_template_and_prompts_and_refuse_unknown_names():
    namespace = {"prompts": ["a"], "template": {"eos": "<|eos|>"}, "max_new_tokens": 4,  # and what later cells
                 "record": {"a": 1}, "timing": {"seconds": 1.0}, "chat": object(), "params": object()}  # made
    params = ChatParams.from_namespace(namespace)
    assert params.template == {"eos": "<|eos|>"} and params.prompts == ["a"] and params.max_new_tokens == 4
    with pytest.raises(ParamError, match="unknown parameter 'max_new_token'"):  # as papermill's -p injected it
        ChatParams.from_namespace({"prompts": ["a"], "max_new_token": 4, "In": ["# Parameters\nmax_new_token = 4"]})
    with pytest.raises(ParamError, match="prompts"):
        ChatParams.from_dict({"prompts": []})
    with pytest.raises(ParamError, match="top_p must be in"):
        ChatParams.from_dict({"checkpoint": None, "prompts": ["a"], "top_p": 1.5})
    for temperature in ("nan", float("nan"), "inf"):  # NaN scores would make every answer empty
        with pytest.raises(ParamError, match="temperature must be a finite number"):
            ChatParams.from_dict({"checkpoint": None, "prompts": ["a"], "temperature": temperature})
    with pytest.raises(GenerationError, match="temperature must be a finite number >= 0"):
        Sampling(float("nan"))


@pytest.mark.parametrize("change, error, message", [
    ({"template": {"assistant": ""}}, ParamError, "template: the template names no assistant marker"),
    ({"prompts": ["x" * 70]}, GenerationError, "prompt 0: 72 tokens \\+ max_new_tokens 8 exceeds the model's "
                                               "max_position_embeddings 64"),
    ({"prompts": [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]},
     ConvertError, "prompts\\[0\\]: the last message is the assistant's"),
    ({"prompts": [{"messages": [{"role": "robot", "content": "a"}]}]}, ConvertError, "message 0 needs a role"),
    ({"checkpoint": None, "template": {"user": "User: "}}, ParamError, "checkpoint None trains a model here"),
    ({"tokenizer": "missing/tokenizer.json"}, ParamError, "tokenizer: .*no such tokenizer.json"),
])
def test_bad_input_stops_before_anything_is_generated(run_dir, tmp_path, monkeypatch, change, error, message):
    monkeypatch.setattr(Decoder, "generate", lambda *a, **k: pytest.fail("generated despite bad input"))
    params = ChatParams.from_dict({"checkpoint": str(run_dir), "prompts": ["12+34="], "max_new_tokens": 8,
                                   "device": "cpu", "out_dir": str(tmp_path / "chat"), **change})
    with pytest.raises(error, match=message):
        prepare_chat(params)
    assert not (tmp_path / "chat").exists()


def test_an_out_dir_with_answers_is_refused(run_dir, tmp_path):
    (tmp_path / "answers.jsonl").write_text("")
    with pytest.raises(ParamError, match=r"already holds answers \(answers.jsonl\)"):
        prepare_chat(ChatParams.from_dict({"checkpoint": str(run_dir), "prompts": ["a"], "out_dir": str(tmp_path)}))


def test_a_link_in_place_of_the_answers_or_the_trained_model_is_refused(run_dir, tmp_path):
    outside = tmp_path / "outside"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "answers.jsonl").symlink_to(outside / "answers.jsonl")  # dangling: open() would create it
    params = {"checkpoint": str(run_dir), "prompts": ["a"], "out_dir": str(tmp_path / "out")}
    with pytest.raises(ParamError, match=r"already holds answers \(answers.jsonl\)"):
        prepare_chat(ChatParams.from_dict(params))
    (tmp_path / "out" / "answers.jsonl").unlink()
    (tmp_path / "out" / "trained-here").symlink_to(outside)
    with pytest.raises(ParamError, match="trained-here is a symbolic link"):
        prepare_chat(ChatParams.from_dict({**params, "checkpoint": None}))
    assert not outside.exists()


def test_a_second_chat_into_the_same_folder_never_replaces_the_firsts_answers(session, tmp_path):
    params = ChatParams.from_dict({"prompts": ["12+34="], "max_new_tokens": 2, "device": "cpu"})
    first, second = (Chat(session, read_conversations(params.prompts), tmp_path, trained_here=False)
                     for _ in range(2))  # both prepared before either answered
    answer_prompts(first, params)
    written = (tmp_path / "answers.jsonl").read_text()
    with pytest.raises(ParamError, match="answers.jsonl already exists; it was left as it was: another chat"):
        answer_prompts(second, params)
    assert (tmp_path / "answers.jsonl").read_text() == written


def test_a_tokenizer_larger_than_the_model_is_refused(run_dir, tmp_path):
    path = word_tokenizer(tmp_path / "tokenizer.json", words=300)
    with pytest.raises(ParamError, match=f"has 305 tokens, more than the model's vocab_size {h.VOCAB}"):
        ChatSession(run_dir, tokenizer=path, device="cpu")
    small = word_tokenizer(tmp_path / "small.json", words=20)
    session = ChatSession(run_dir, tokenizer=small, device="cpu")
    assert session.prompt_ids([[{"role": "user", "content": "w3 w4"}]], 2) == [[1, 8, 9, 2]]
    assert session.describe()["tokenizer"]["sha256"] == sha256_file(small)


def test_render_prompt_reuses_the_converters_turns():
    template = ChatTemplate(system="S:", user="U:", assistant="A:", turn_end="|", eos="<|eos|>")
    renderer = ChatRenderer(h.TOKENIZER, template, "final_turn")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    full, _ = renderer.render(Conversation(messages + [{"role": "assistant", "content": "b"}]))
    assert renderer.render_prompt(messages) == full[:-2]  # all but the answer "b" and its EOS
    assert h.TOKENIZER.decode_template(renderer.render_prompt(messages)) == "S:s|U:q|A:a<|eos|>U:r|A:"
    with pytest.raises(ConvertError, match="no assistant marker"):
        ChatRenderer(h.TOKENIZER, ChatTemplate(assistant=""), "final_turn").render_prompt(messages)


def test_prompts_from_a_jsonl_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n\n{oops\n")
    with pytest.raises(ConvertError, match="prompts.jsonl:3: not valid JSON"):
        read_conversations(str(path))
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert read_conversations(str(path)) == [[{"role": "user", "content": "hi"}]]
    with pytest.raises(ParamError, match="is not a file"):
        read_conversations(str(tmp_path / "none.jsonl"))
    nested = {"messages": [{"role": "user", "content": "hi"}], "meta": 0}
    path.write_text(json.dumps(nested) + "\n" + json.dumps(nested).replace("0}", "[" * 50_000 + "]" * 50_000 + "}"))
    with pytest.raises(ConvertError, match="prompts.jsonl:2: JSON nested deeper than 64 levels"):
        read_conversations(str(path))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_answers_are_shown_a_bounded_row_at_a_time_and_a_fifo_is_refused(tmp_path, monkeypatch, capsys):
    """show_answers_of takes any path: its rows are read as every JSONL cflib reads, a row past the bound is
    refused by its line and a FIFO at once, never waited on."""
    row = {"messages": [{"role": "user", "content": "hi"}], "answer": "hello", "stopped_by": "eos"}
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "answer": "x" * 200}) + "\n")
    show_answers_of(path, limit=1)  # the second row is never parsed
    assert capsys.readouterr().out.count("'hello'") == 1
    monkeypatch.setattr(cflib.jsonio, "MAX_BYTES", 128)
    with pytest.raises(ParamError, match=f"{path}:2: a line longer than the 128 bytes"):
        show_answers_of(path)
    fifo = tmp_path / "piped.jsonl"
    os.mkfifo(fifo)
    assert str(refused_without_waiting(lambda: show_answers_of(fifo), fifo)).startswith(
        f"{fifo}: not a regular file (a FIFO)")


def test_a_tokenizer_folder_renders_prompts_through_its_own_chat_template(tmp_path):
    from transformers import AutoTokenizer

    folder = tokenizer_folder(tmp_path / "tokenizer", generation=True)
    hf = AutoTokenizer.from_pretrained(folder)
    save_checkpoint(tiny_model(vocab_size=len(hf)), tmp_path / "checkpoint")
    session = ChatSession(tmp_path / "checkpoint", tokenizer=str(folder), template="tokenizer", device="cpu")
    conversation = [turn("system", " Be brief. "), turn("user", "Hello"), turn("assistant", "Hi"),
                    turn("user", "  What is 2 plus 2? ")]
    expected = hf.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
    assert session.prompt_ids([conversation], 4) == [expected]
    assert hf.decode(expected).endswith("<|user|>\nWhat is 2 plus 2?</s>\n<|assistant|>\n")
    rows, _ = session.answer([conversation], ChatParams(prompts=["x"], max_new_tokens=4).generation(), progress=False)
    ids = rows[0]["answer_ids"]
    assert ids == Decoder(session.model).generate([expected], 4, eos_token_id=hf.eos_token_id)[0]
    assert rows[0]["answer"] == hf.decode(ids[:-1] if ids[-1] == hf.eos_token_id else ids)
    described = session.describe()
    assert described["template"]["sha256"] == chat_template_sha256(hf.chat_template)
    assert described["tokenizer"]["kind"] == "folder" and described["eos_token_id"] == hf.eos_token_id
    params = ChatParams.from_dict({"checkpoint": str(tmp_path / "checkpoint"), "prompts": ["a"], "template": "tokenizer"})
    assert params.template == "tokenizer"
    with pytest.raises(ParamError, match="template: tokenizer renders through a tokenizer folder's chat template"):
        ChatSession(tmp_path / "checkpoint", tokenizer="byte", template="tokenizer", device="cpu")
