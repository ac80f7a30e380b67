"""The tokenizer files of a Hub bundle: `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`.

The built-in byte tokenizer gets a `tokenizer.json` of its own, built with the
`tokenizers` library to encode and decode exactly as cflib.data's
ByteTokenizer does. A local `tokenizer.json` (or a folder holding one) is
copied, with the two JSON companions written when it has none; its chat
template (`chat_template.jinja`, else `chat_template` in
tokenizer_config.json, as transformers reads them) goes along unchanged, and
its SHA-256 is what a shard converted through that template recorded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cflib.data import ByteTokenizer, chat_template_sha256
from cflib.errors import shown
from cflib.jsonio import MAX_BYTES, parse_json, read_bounded

BYTE = "byte"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_MAP_FILE = "special_tokens_map.json"
TEMPLATE_FILE = "chat_template.jinja"
COMPANIONS = (CONFIG_FILE, SPECIAL_MAP_FILE, TEMPLATE_FILE)
TOKENIZER_BYTES = 512 * 2**20  # a tokenizer.json of a few hundred thousand tokens is tens of MB
ROLES = ("bos", "eos", "pad", "unk")
# Tried in order when a tokenizer.json comes without a tokenizer_config.json saying which token is which.
USUAL_NAMES = {
    "bos": ("<s>", "<bos>", "<|begin_of_text|>", "<|startoftext|>"),
    "eos": ("<|eos|>", "<|im_end|>", "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"),
    "pad": ("<pad>", "<|pad|>"),
    "unk": ("<unk>", "<|unk|>"),
}
# The byte tokenizer's chat layout, as cflib.data.convert renders conversations through its default markers
# (cflib.data.marker_template): a role marker before each turn, an assistant's reasoning_content as a
# <think>...</think> block right before its content, the end-of-sequence token after each assistant turn. What an
# assistant writes sits in a {% generation %} block: transformers' return_assistant_tokens_mask, and so TRL's
# assistant_only_loss, supervise exactly those tokens, as the converter's all_assistant_turns does.
BYTE_CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' }}"
                      "{% set think = '<think>' + message['reasoning_content'] + '</think>' "
                      "if message['reasoning_content'] is string else '' %}"
                      "{% if message['role'] == 'assistant' %}"
                      "{% generation %}{{ think + message['content'] + '<|eos|>' }}{% endgeneration %}"
                      "{% else %}{{ think + message['content'] }}{% endif %}"
                      "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


class TokenizerExportError(ValueError):
    """A tokenizer that cannot go with the model; the message names it."""


@dataclass
class TokenizerFiles:
    files: dict[str, bytes]  # file name in the bundle -> its bytes
    tokens: dict[str, str | None]  # bos/eos/pad/unk -> token text
    ids: dict[str, int | None]  # bos/eos/pad/unk -> token id
    num_ids: int  # one past the largest id it can produce
    description: str
    notes: list[str] = field(default_factory=list)

    @property
    def chat_template_sha256(self) -> str | None:
        """SHA-256 of the chat template the bundle's tokenizer renders with (None: it has none)."""
        if TEMPLATE_FILE in self.files:
            return chat_template_sha256(self.files[TEMPLATE_FILE].decode("utf-8"))
        template = json.loads(self.files[CONFIG_FILE]).get("chat_template") if CONFIG_FILE in self.files else None
        return chat_template_sha256(template) if template else None


def _json(document: dict) -> bytes:
    return (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode()


def byte_alphabet() -> list[str]:
    """The character the ByteLevel pre-tokenizer maps each byte 0..255 to (GPT-2's table): printable
    Latin-1 bytes stand for themselves, every other byte for the next character from U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    alphabet, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            alphabet.append(chr(byte))
        else:
            alphabet.append(chr(256 + shifted))
            shifted += 1
    return alphabet


def byte_tokenizer_json() -> str:
    """tokenizer.json of ByteTokenizer: specials at ids 0..3, byte b at id 4 + b, no merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_tok = ByteTokenizer()
    vocab = dict(byte_tok.special_tokens)
    vocab.update({char: byte_tok.num_special + byte for byte, char in enumerate(byte_alphabet())})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # One piece per text (no regex split, no prefix space): every UTF-8 byte becomes one token.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in byte_tok.special_tokens])
    return tokenizer.to_str(pretty=True)


def byte_tokenizer_files(model_max_length: int) -> TokenizerFiles:
    byte_tok = ByteTokenizer()
    eos = "<|eos|>"
    tokens = {"bos": None, "eos": eos, "pad": eos, "unk": None}  # batches are padded with EOS, as in training
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos, "pad_token": eos,
              "unk_token": None, "model_max_length": model_max_length, "padding_side": "left",
              "clean_up_tokenization_spaces": False, "chat_template": BYTE_CHAT_TEMPLATE}
    files = {TOKENIZER_FILE: byte_tokenizer_json().encode(), CONFIG_FILE: _json(config),
             SPECIAL_MAP_FILE: _json({"eos_token": eos, "pad_token": eos})}
    ids = {role: None if token is None else byte_tok.special_tokens[token] for role, token in tokens.items()}
    return TokenizerFiles(files, tokens, ids, byte_tok.vocab_size, "the built-in byte tokenizer")


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _parsed(data: bytes, path: Path) -> dict:
    """A tokenizer file's JSON object, from the bytes the bundle gets (the file is read once)."""
    document = parse_json(data, str(path), TokenizerExportError)
    if not isinstance(document, dict):
        raise TokenizerExportError(f"{path}: expected a JSON object")
    return document


def json_tokenizer_files(path: str | Path, model_max_length: int) -> TokenizerFiles:
    """A local tokenizer.json, or a folder holding one, with its companions when it has them."""
    from tokenizers import Tokenizer

    path = Path(path)
    tokenizer_file = path / TOKENIZER_FILE if path.is_dir() else path
    if not tokenizer_file.is_file():
        raise TokenizerExportError(f"{tokenizer_file}: no such tokenizer file (give a tokenizer.json, a folder "
                                   "holding one, or 'byte')")
    # Read once, bounded, and parsed from those bytes: what the bundle gets is what was checked.
    files = {TOKENIZER_FILE: read_bounded(tokenizer_file, TOKENIZER_BYTES, TokenizerExportError, "tokenizer.json")}
    try:
        tokenizer = Tokenizer.from_str(files[TOKENIZER_FILE].decode("utf-8"))
    except Exception as err:  # the Rust library raises its own exception type; a UnicodeDecodeError too
        raise TokenizerExportError(f"{tokenizer_file}: not a readable tokenizer.json ({err})") from None
    # Companions belong to a tokenizer.json only in its own folder, under the usual names.
    folder = tokenizer_file.parent if tokenizer_file.name == TOKENIZER_FILE else None
    for name in COMPANIONS:
        if folder is not None and (folder / name).is_file():
            files[name] = read_bounded(folder / name, MAX_BYTES, TokenizerExportError, name)
    config = _parsed(files[CONFIG_FILE], folder / CONFIG_FILE) if CONFIG_FILE in files else None
    if config is not None:
        _refuse_own_code(config, folder / CONFIG_FILE)
    special_map = _parsed(files[SPECIAL_MAP_FILE], folder / SPECIAL_MAP_FILE) if SPECIAL_MAP_FILE in files else None
    notes = []
    if config is not None or special_map is not None:
        named = {**(special_map or {}), **(config or {})}
        tokens = {role: _token_text(named.get(f"{role}_token")) for role in ROLES}
    else:
        tokens = _guess_special_tokens(tokenizer, _parsed(files[TOKENIZER_FILE], tokenizer_file))
        notes.append("no tokenizer_config.json beside the tokenizer: special tokens taken by their usual names ("
                     + ", ".join(f"{role} {token!r}" for role, token in tokens.items() if token) + ")")
    if tokens["eos"] is None:
        raise TokenizerExportError(f"{tokenizer_file}: cannot tell which token ends a sequence; put a "
                                   "tokenizer_config.json naming eos_token beside it")
    ids = {}
    for role, token in tokens.items():
        ids[role] = None if token is None else tokenizer.token_to_id(token)
        if token is not None and ids[role] is None:
            raise TokenizerExportError(f"{tokenizer_file}: its {role}_token {token!r} is not in its vocabulary")
    if config is None:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                  "clean_up_tokenization_spaces": False, **{f"{role}_token": tokens[role] for role in ROLES}}
        files[CONFIG_FILE] = _json(config)
    if special_map is None:
        files[SPECIAL_MAP_FILE] = _json({f"{role}_token": token for role, token in tokens.items() if token})
    num_ids = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    return TokenizerFiles(files, tokens, ids, num_ids, str(tokenizer_file), notes)


def _refuse_own_code(config: dict, path: Path) -> None:
    """A bundle's tokenizer loads with transformers' own classes: a tokenizer_config.json that maps code of its
    own (auto_map) would make anyone loading the bundle with trust_remote_code, lm-eval's scoring among them,
    fetch and run that code; a tokenizer_class transformers lacks could only come from such code."""
    if "auto_map" in config:
        raise TokenizerExportError(f"{path}: auto_map names tokenizer code of its own ({shown(config['auto_map'])}); "
                                   "cflib's bundles load their tokenizer with transformers' classes and run no code "
                                   "they did not ship: remove auto_map (a tokenizer.json needs none)")
    name = config.get("tokenizer_class")
    try:
        import transformers
    except ImportError:  # nothing here loads the bundle; where transformers does, it is installed
        return
    if name is not None and (not isinstance(name, str) or getattr(transformers, name, None) is None):
        raise TokenizerExportError(f"{path}: tokenizer_class {shown(name)} is not a tokenizer class transformers "
                                   "has; set it to PreTrainedTokenizerFast (or remove it)")


def _guess_special_tokens(tokenizer, document: dict) -> dict[str, str | None]:
    specials = {token["content"] for token in document.get("added_tokens", []) if token.get("special")}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    tokens: dict[str, str | None] = {}
    for role in ROLES:
        pool = specials if role != "unk" else set(vocab)
        tokens[role] = next((name for name in USUAL_NAMES[role] if name in pool), None)
    model_unk = (document.get("model") or {}).get("unk_token")
    if isinstance(model_unk, str) and model_unk in vocab:
        tokens["unk"] = model_unk
    tokens["pad"] = tokens["pad"] or tokens["eos"]
    return tokens


def tokenizer_files(spec: str | Path | None, vocab_size: int, model_max_length: int) -> TokenizerFiles:
    """The files for `spec` ("byte", a tokenizer.json or its folder; None: the byte tokenizer when the
    model's vocabulary is the byte tokenizer's), refused when it yields ids the model has no row for."""
    if spec is None:
        if vocab_size != ByteTokenizer.vocab_size:
            raise TokenizerExportError(
                f"the model's vocab_size is {vocab_size}, not the byte tokenizer's {ByteTokenizer.vocab_size}: "
                "give its tokenizer (a tokenizer.json or its folder), or 'byte' to export the byte tokenizer anyway")
        spec = BYTE
    files = (byte_tokenizer_files(model_max_length) if str(spec) == BYTE
             else json_tokenizer_files(spec, model_max_length))
    if files.num_ids > vocab_size:
        raise TokenizerExportError(f"{files.description} produces ids up to {files.num_ids - 1}, but the model's "
                                   f"vocab_size is {vocab_size}: it is not this model's tokenizer")
    return files
