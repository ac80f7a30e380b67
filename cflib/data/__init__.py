"""data: SFT token shards, from chat JSONL to the batches a step consumes.

Owns the shard format (`shards`), chat conversion (`convert`, `tokenizer`),
the checks before a run (`preflight`), packing, 2-D loss weighting and the
embedded tasks. Imports the foundation modules only; `python -m cflib.data
convert` runs the converter.
"""
from cflib.data.convert import (
    ChatRenderer,
    ChatTemplate,
    ConvertError,
    ConvertSpec,
    conversation_to_answer,
    convert,
    show_example,
)
from cflib.data.convert import summary as conversion_summary
from cflib.data.shards import IGNORE_INDEX, Example, ShardError, ShardPartition, collate, open_shard, write_partition
from cflib.data.tokenizer import ByteTokenizer, JsonTokenizer, load_tokenizer

__all__ = ["IGNORE_INDEX", "ByteTokenizer", "ChatRenderer", "ChatTemplate", "ConvertError", "ConvertSpec", "Example",
           "JsonTokenizer", "ShardError", "ShardPartition", "collate", "conversation_to_answer", "conversion_summary",
           "convert", "load_tokenizer", "open_shard", "show_example", "write_partition"]
