"""data: SFT token shards, from conversations to the batches a step consumes.

Owns the shard format (`shards`), conversion (`convert`: `sources`, `formats`,
`conversation`, `reasoning`, the templates `marker_template` and
`tokenizer_template` chosen by `rendering`, `tokenizer`), the checks before a
run (`preflight`), packing, 2-D loss weighting and the embedded tasks. Imports
the foundation modules only; `python -m cflib.data convert` runs the converter.
"""
from cflib.data.conversation import Conversation, ConvertError, conversation_to_answer
from cflib.data.convert import ConvertSpec, convert, show_example
from cflib.data.convert import summary as conversion_summary
from cflib.data.marker_template import ChatRenderer, ChatTemplate
from cflib.data.rendering import TOKENIZER_TEMPLATE, Renderer, make_renderer
from cflib.data.shards import IGNORE_INDEX, Example, ShardError, ShardPartition, collate, open_shard, write_partition
from cflib.data.tokenizer import (ByteTokenizer, JsonTokenizer, PretrainedTokenizer, load_tokenizer,
                                  shard_chat_template_sha256, shard_tokenizer_spec)
from cflib.data.tokenizer_template import TemplateRenderer, chat_template_sha256

__all__ = ["IGNORE_INDEX", "TOKENIZER_TEMPLATE", "ByteTokenizer", "ChatRenderer", "ChatTemplate", "Conversation",
           "ConvertError", "ConvertSpec", "Example", "JsonTokenizer", "PretrainedTokenizer", "Renderer", "ShardError",
           "ShardPartition", "TemplateRenderer", "chat_template_sha256", "collate", "conversation_to_answer",
           "conversion_summary", "convert", "load_tokenizer", "make_renderer", "open_shard",
           "shard_chat_template_sha256", "shard_tokenizer_spec", "show_example", "write_partition"]
