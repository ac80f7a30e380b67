"""The renderer a conversion (and a chat) uses: a tokenizer with a marker template, or with its own template.

    template: a ChatTemplate (markers; the default)  -> cflib.data.marker_template.ChatRenderer
    template: "tokenizer"                            -> cflib.data.tokenizer_template.TemplateRenderer

Both give `render(conversation) -> (input_ids, labels)`, `render_prompt(messages,
tools) -> ids`, `eos_token_id`, `tokenizer` and `record()` (what the manifest
and the chat's record say of the template).
"""
from __future__ import annotations

from pathlib import Path

from cflib.data.conversation import ConvertError
from cflib.data.marker_template import ChatRenderer, ChatTemplate
from cflib.data.shards import sha256_file
from cflib.data.tokenizer import ByteTokenizer, JsonTokenizer, PretrainedTokenizer, load_tokenizer
from cflib.data.tokenizer_template import TemplateRenderer

TOKENIZER_TEMPLATE = "tokenizer"  # template: tokenizer renders through the tokenizer folder's chat template
Renderer = ChatRenderer | TemplateRenderer
TOKENIZER_FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def make_renderer(tokenizer: str, template: ChatTemplate | str, supervise: str, reasoning: str = "supervise"
                  ) -> Renderer:
    """The renderer for `tokenizer` ("byte", a tokenizer.json, or a folder) and `template`, or ConvertError."""
    try:
        loaded = load_tokenizer(tokenizer)
    except (FileNotFoundError, ValueError) as err:
        raise ConvertError(f"tokenizer: {err}") from None
    if template != TOKENIZER_TEMPLATE:
        return ChatRenderer(loaded, template, supervise, reasoning)
    if not isinstance(loaded, PretrainedTokenizer):
        raise ConvertError(f"template: tokenizer renders through a tokenizer folder's chat template; tokenizer "
                           f"{tokenizer!r} is not a folder (give the folder AutoTokenizer.from_pretrained loads)")
    return TemplateRenderer(loaded, supervise, reasoning)


def tokenizer_record(tokenizer: ByteTokenizer | JsonTokenizer | PretrainedTokenizer) -> dict:
    """What the manifest records of a tokenizer: its kind, path and the SHA-256 of its files."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte", "path": None, "sha256": None}
    if isinstance(tokenizer, JsonTokenizer):
        return {"kind": "tokenizer.json", "path": str(tokenizer.path), "sha256": sha256_file(tokenizer.path)}
    folder = Path(tokenizer.path)
    return {"kind": "folder", "path": str(folder),
            "sha256": {name: sha256_file(folder / name) for name in TOKENIZER_FOLDER_FILES
                       if (folder / name).is_file()}}
