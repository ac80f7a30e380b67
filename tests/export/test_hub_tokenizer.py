"""The tokenizer files of a Hub bundle: the byte tokenizer rebuilt for `tokenizers`, and local tokenizer.json copies."""
from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers  # the bundle is for it; cflib imports it only to read tokenizer folders
from tokenizers import Tokenizer, models, pre_tokenizers

from cflib.data import ByteTokenizer, ConvertSpec, JsonTokenizer, convert, open_shard
from cflib.export import ExportError, TokenizerExportError, export_hub
from cflib.errors import ParamError
from cflib.export.tokenizer_files import byte_alphabet
from cflib.model import ModelConfig, TRMoEModel, preset, save_checkpoint


try:
    from chat_tokenizers import tokenizer_folder, turn
except ImportError:  # pragma: no cover - depends on how pytest is invoked
    from tests.chat_tokenizers import tokenizer_folder, turn

BYTE = ByteTokenizer()
TEXTS = ["hello world", "  two  spaces\n\ttab\r\n", "12+34=46", "naïve café, 漢字, emoji 🙂🚀", "",
         "<|user|>hi<|assistant|>ok<|eos|>", "a <|eos|> inside", "<|eos", "|>"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(TRMoEModel(preset("smoke")), tmp_path_factory.mktemp("ckpt") / "smoke")


@pytest.fixture(scope="module")
def bundle(checkpoint: Path, tmp_path_factory) -> Path:
    return export_hub(checkpoint, tmp_path_factory.mktemp("export") / "bundle", echo=None)


@pytest.fixture(scope="module")
def hub_tokenizer(bundle: Path):
    return transformers.AutoTokenizer.from_pretrained(str(bundle), trust_remote_code=True)


def test_loads_as_a_fast_tokenizer_with_the_byte_specials(bundle: Path, hub_tokenizer):
    plain = transformers.PreTrainedTokenizerFast.from_pretrained(str(bundle))
    for tok in (hub_tokenizer, plain):
        assert isinstance(tok, transformers.PreTrainedTokenizerFast)
        assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (0, 0, None)
        assert len(tok) == BYTE.vocab_size and tok.padding_side == "left"
    assert json.loads((bundle / "special_tokens_map.json").read_text()) == {"eos_token": "<|eos|>",
                                                                            "pad_token": "<|eos|>"}


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_like_the_byte_tokenizer(hub_tokenizer, text: str):
    ids = hub_tokenizer(text)["input_ids"]
    assert ids == BYTE.encode_template(text)  # special tokens in text are recognised, as in chat templates
    assert hub_tokenizer.decode(ids) == BYTE.decode_template(ids) == text
    assert hub_tokenizer.decode(ids, skip_special_tokens=True) == BYTE.decode(ids)


def test_every_id_and_every_two_byte_sequence_decodes_like_the_byte_tokenizer(hub_tokenizer):
    for i in range(BYTE.vocab_size):
        assert hub_tokenizer.decode([i]) == BYTE.decode_template([i]), i
    for lead in range(0xC2, 0xE0):
        pairs = [[BYTE.num_special + lead, BYTE.num_special + follow] for follow in range(0x80, 0xC0)]
        assert hub_tokenizer.batch_decode(pairs) == [BYTE.decode(pair) for pair in pairs]
    rng = random.Random(0)  # mostly invalid UTF-8: both replace the same bytes with U+FFFD
    for _ in range(50):
        ids = [rng.randrange(BYTE.num_special, BYTE.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert hub_tokenizer.decode(ids) == BYTE.decode(ids), ids


def test_the_byte_alphabet_is_the_byte_level_pre_tokenizers():
    assert sorted(byte_alphabet()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    # Printable ASCII stands for itself, so the table is in byte order where it can be read.
    assert [byte_alphabet()[b] for b in range(ord("!"), ord("~") + 1)] == [chr(b) for b in range(33, 127)]


def test_content_encoding_and_cflibs_json_tokenizer_agree(bundle: Path):
    """With special tokens treated as text (message content), and through cflib's own JsonTokenizer, the
    exported tokenizer.json encodes as ByteTokenizer: converting chats with it gives the same shards."""
    content = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    content.encode_special_tokens = True
    cflib_json = JsonTokenizer(bundle / "tokenizer.json")
    assert cflib_json.vocab_size == BYTE.vocab_size
    for text in TEXTS:
        assert content.encode(text, add_special_tokens=False).ids == BYTE.encode(text)
        assert cflib_json.encode(text) == BYTE.encode(text)
        assert cflib_json.encode_template(text) == BYTE.encode_template(text)
    assert [cflib_json.token_id(t) for t in BYTE.special_tokens] == list(BYTE.special_tokens.values())


def test_the_chat_template_renders_as_training_did(hub_tokenizer):
    prompt = hub_tokenizer.apply_chat_template([{"role": "user", "content": "reverse abc"}],
                                               add_generation_prompt=True, tokenize=False)
    assert hub_tokenizer(prompt)["input_ids"] == BYTE.encode_prompt("reverse abc")
    chat = hub_tokenizer.apply_chat_template([{"role": "user", "content": "12+34="},
                                              {"role": "assistant", "content": "46"}], tokenize=False)
    assert hub_tokenizer(chat)["input_ids"] == BYTE.encode_chat("12+34=", "46")[0]


@pytest.mark.parametrize("reasoning", ["supervise", "mask"])
def test_converting_through_the_bundle_s_template_gives_the_marker_converter_s_tokens(bundle, tmp_path, reasoning):
    """Reasoning included: `--tokenizer BUNDLE --template tokenizer` writes the shard the default markers write."""
    rows = tmp_path / "chats.jsonl"
    rows.write_text("\n".join(json.dumps({"messages": messages}) for messages in [
        [turn("user", "12+34="), turn("assistant", "46", reasoning_content="4+2=6, 1+3=4")],
        [turn("user", "up abc"), turn("assistant", "<think>upper case</think>ABC"), turn("user", "and xy"),
         turn("assistant", "XY", reasoning_content="again")]]) + "\n")
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"messages": [turn("user", "1+1="), turn("assistant", "2", reasoning_content="")]}))
    shards = {}
    for name, how in (("markers", {}), ("bundle", {"tokenizer": str(bundle), "template": "tokenizer"})):
        convert(ConvertSpec(train=str(rows), eval=str(held), out=str(tmp_path / name), supervise="all_assistant_turns",
                            reasoning=reasoning, **how))
        shards[name] = open_shard(tmp_path / name, "train")
    assert len(shards["markers"]) == len(shards["bundle"]) == 2
    for index in range(2):
        (ids, labels), (bundle_ids, bundle_labels) = shards["markers"][index], shards["bundle"][index]
        assert ids.tolist() == bundle_ids.tolist() and labels.tolist() == bundle_labels.tolist()
    assert "<think>4+2=6, 1+3=4</think>46" in BYTE.decode(shards["bundle"][0][0].tolist())


def test_a_padded_batch_is_left_padded_with_eos(hub_tokenizer):
    batch = hub_tokenizer(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[0, 0] + BYTE.encode("ab"), BYTE.encode("abcd")]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


# --- a tokenizer.json of one's own ---------------------------------------------------------------
def word_tokenizer(folder: Path, words: int = 100, specials: tuple[str, ...] = ("<unk>", "<|im_end|>", "<pad>")
                   ) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {**{token: i for i, token in enumerate(specials)}, **{f"w{i}": len(specials) + i for i in range(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>" if "<unk>" in specials else None))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(specials))
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_tokenizer_folder_without_config_gets_one(checkpoint: Path, tmp_path: Path):
    source = word_tokenizer(tmp_path / "tok")
    lines: list[str] = []
    out = export_hub(checkpoint, tmp_path / "out", tokenizer=source, echo=lines.append)
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["unk_token_id"], config["bos_token_id"]) == \
        (1, 2, 0, None)
    assert json.loads((out / "special_tokens_map.json").read_text()) == {"eos_token": "<|im_end|>",
                                                                         "pad_token": "<pad>", "unk_token": "<unk>"}
    assert any("special tokens taken by their usual names" in line for line in lines)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    assert tok("w3 w7 <|im_end|>")["input_ids"] == [6, 10, 1] and tok.eos_token_id == 1


def test_a_tokenizer_config_beside_the_file_is_copied_and_followed(checkpoint: Path, tmp_path: Path):
    source = word_tokenizer(tmp_path / "tok")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 77,
                        "eos_token": {"content": "<pad>", "special": True}, "pad_token": "<pad>", "bos_token": None}
    (source / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    out = export_hub(checkpoint, tmp_path / "out", tokenizer=source / "tokenizer.json", echo=None)
    assert (out / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.parametrize("case, message", [
    ("too_many_ids", "produces ids up to 302, but the model's vocab_size is 260"),
    ("no_eos", "cannot tell which token ends a sequence"),
    ("eos_not_in_vocabulary", "its eos_token '</s>' is not in its vocabulary"),
    ("not_a_tokenizer", "not a readable tokenizer.json"),
    ("missing", "no such tokenizer file"),
    ("own_code", "tokenizer_config.json: auto_map names tokenizer code of its own"),
    ("unknown_class", "tokenizer_class 'EvilTokenizer' is not a tokenizer class transformers has"),
])
def test_an_unusable_tokenizer_is_refused_writing_nothing(checkpoint: Path, tmp_path: Path, case: str,
                                                           message: str):
    source = tmp_path / "tok"
    if case == "too_many_ids":
        word_tokenizer(source, words=300)
    elif case == "no_eos":
        word_tokenizer(source, specials=("<unk>",))
    elif case == "eos_not_in_vocabulary":
        word_tokenizer(source)
        (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    elif case == "not_a_tokenizer":
        source.mkdir()
        (source / "tokenizer.json").write_text("{\"model\": 3}")
    elif case in ("own_code", "unknown_class"):  # what would make a loader with trust_remote_code fetch and run code
        word_tokenizer(source)
        evil = {"auto_map": {"AutoTokenizer": ["attacker/evil--tokenization_evil.EvilTokenizer", None]}} \
            if case == "own_code" else {"tokenizer_class": "EvilTokenizer"}
        (source / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", **evil}))
    with pytest.raises(TokenizerExportError, match=re.escape(message)):
        export_hub(checkpoint, tmp_path / "out", tokenizer=source, echo=None)
    assert not (tmp_path / "out").exists()
    if case == "own_code":  # a run scoring eval_tasks on its checkpoints' bundles refuses it before step 1
        from cflib.train.task_scores import TaskScorer
        with pytest.raises(ParamError, match="eval_tasks_every: the data's tokenizer cannot go into .*auto_map"):
            TaskScorer(("embedded_exact",), None, str(source), None, "cpu")


def test_a_model_of_another_vocabulary_needs_its_tokenizer_named(tmp_path: Path):
    model = TRMoEModel(ModelConfig(**{**preset("smoke").to_dict(), "vocab_size": 320}))
    checkpoint = save_checkpoint(model, tmp_path / "ckpt")
    with pytest.raises(TokenizerExportError, match="vocab_size is 320, not the byte tokenizer's 260: give its"):
        export_hub(checkpoint, tmp_path / "out", echo=None)
    # A smaller tokenizer is fine: its ids all have rows.
    export_hub(checkpoint, tmp_path / "out", tokenizer="byte", echo=None)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 320


@pytest.mark.parametrize("template_file", [False, True])
def test_the_bundle_renders_with_the_template_its_data_was_converted_through(tmp_path, template_file):
    folder = tokenizer_folder(tmp_path / "tokenizer", generation=template_file, template_file=template_file)
    rows = tmp_path / "chats.jsonl"
    rows.write_text(json.dumps({"messages": [turn("user", " Hello "), turn("assistant", "Hi")]}) + "\n")
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"messages": [turn("user", "Bye"), turn("assistant", "Bye")]}) + "\n")
    manifest = convert(ConvertSpec(train=str(rows), eval=str(held), out=str(tmp_path / "shard"),
                                   tokenizer=str(folder), template="tokenizer"))["train"]
    sha = manifest["conversion"]["template"]["sha256"]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    torch.manual_seed(0)
    config = ModelConfig(**{**preset("smoke").to_dict(), "vocab_size": manifest["vocab_size"]})
    checkpoint = save_checkpoint(TRMoEModel(config), tmp_path / "ckpt")
    lines: list[str] = []
    bundle = export_hub(checkpoint, tmp_path / "bundle", tokenizer=folder, chat_template_sha256=sha, echo=lines.append)
    assert f"chat template: sha256 {sha}" in lines
    exported = transformers.AutoTokenizer.from_pretrained(str(bundle))
    assert hashlib.sha256(exported.chat_template.encode()).hexdigest() == sha
    conversation = [turn("system", " Be brief. "), turn("user", "What is 2 plus 2?")]
    assert exported.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"] == \
        hf.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
    with pytest.raises(ExportError, match="its chat template .* is not the one the training data was rendered"):
        export_hub(checkpoint, tmp_path / "other", tokenizer="byte", chat_template_sha256=sha, echo=None)
    assert not (tmp_path / "other").exists()


@pytest.mark.slow  # a Python process importing transformers
def test_a_bundle_read_as_a_tokenizer_folder_warns_of_no_model(bundle: Path):
    """Converting through a bundle's tokenizer (--tokenizer BUNDLE) loads a tokenizer, not a model: transformers'
    warning about the bundle's unknown model type would only mislead. In a process of its own: transformers'
    logging writes to the stderr it found when it was first imported."""
    code = ("import sys; from cflib.data.tokenizer import PretrainedTokenizer; "
            "print(PretrainedTokenizer(sys.argv[1]).encode('12+34='))")
    done = subprocess.run([sys.executable, "-c", code, str(bundle)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(BYTE.encode("12+34=")) and "model of type" not in done.stderr
