"""The row formats the converter reads, each to a `Conversation` (cflib.data.conversation).

    messages           {"messages": [{"role": "user", "content": "..."}, ...]}            OpenAI chat
    sharegpt           {"conversations": [{"from": "human", "value": "..."}, ...]}        ShareGPT
    prompt_completion  {"prompt": "..." or [messages], "completion": "..." or [messages]}
    alpaca             {"instruction": "...", "input": "...", "output": "..."}            Alpaca
    text               {"text": "..."}                                                    every token taught

`auto` takes a source's format from its first row's fields, in that order;
every later row of the source must have the same. Alpaca comes before text
because Alpaca dumps often carry a `text` column, the whole prompt and answer
in Alpaca's own template: read as text it would teach the prompt too. An
alpaca row's user turn is its instruction, then a newline and its input where
the input is not blank (LLaMA-Factory's alpaca format joins them so; no
"### Instruction:" scaffolding, the chat template marks the turns); its
output is the assistant turn, and an optional `system` string the system
turn. A source's `columns` ({field: column}) renames its columns to the
fields read here before the format is detected (Dolly's context and
response: {input: context, output: response}). ShareGPT's roles: `human`
is the user, `gpt` the assistant, `system` the system; `tool`, `function` and
`observation` are tool results, and `function_call` an assistant's tool call
(its value the call's JSON). A string prompt is one user turn, a string
completion one assistant turn; only the completion is taught. Any row may
carry `tools` (a list of JSON schemas, or that list as a JSON string) and the
metadata `task`, `group`, `source`, `domain`, `mode`, `difficulty` (strings)
and `id` (a string or an integer, kept as the example's `row_id`). A field of
messages given as a JSON string (a CSV cell) is decoded. A row that does not
fit is refused, naming where it stands and the field.
"""
from __future__ import annotations

from cflib.data.conversation import (METADATA, Conversation, ConvertError, check_messages, check_metadata, check_text,
                                     without_nulls)
from cflib.jsonio import parse_json

FORMATS = ("messages", "sharegpt", "prompt_completion", "alpaca", "text")
FIELDS = {"messages": ("messages",), "sharegpt": ("conversations",), "prompt_completion": ("prompt", "completion"),
          "alpaca": ("instruction", "output"), "text": ("text",)}
# Every field a row is read by, and so what `columns` may rename a source's column to.
MAPPABLE = tuple(dict.fromkeys([*(key for keys in FIELDS.values() for key in keys), "input", "system", "tools", "id",
                                *METADATA]))
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function": "tool", "observation": "tool", "function_call": "assistant"}


def detect(row: object, where: str) -> str:
    """The format whose fields the row has."""
    if isinstance(row, dict):
        for name in FORMATS:
            if all(row.get(key) is not None for key in FIELDS[name]):
                return name
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise ConvertError(f"{where}: no format's fields ({'; '.join('+'.join(f) for f in FIELDS.values())}) in this "
                       f"row (it has {keys}); rename its columns to a format's fields with columns (--columns "
                       "prompt=question,completion=answer, or a source's columns: {prompt: question, ...})")


def check_columns(columns: object, where: str) -> dict[str, str]:
    """A `columns` mapping {field: the source's column it is in} ({} for None), or ConvertError naming `where`."""
    if columns is None:
        return {}
    if not isinstance(columns, dict) or not all(isinstance(key, str) and key and isinstance(value, str) and value
                                                for key, value in columns.items()):
        raise ConvertError(f"{where}: a mapping of field: column, each a non-empty string ({{prompt: question}}), "
                           f"got {str(columns)[:80]}")
    unknown = [key for key in columns if key not in MAPPABLE]
    if unknown:
        raise ConvertError(f"{where}: {unknown[0]!r} is no field a format reads ({', '.join(MAPPABLE)}); columns "
                           "maps such a field to the column that holds it ({prompt: question})")
    return dict(columns)


def columns_from_text(text: str, where: str) -> dict[str, str]:
    """FIELD=COLUMN[,FIELD=COLUMN ...] (a flag's or papermill's text) as a columns mapping, or ConvertError."""
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if not pairs or any(not sep or not field.strip() or not column.strip() for field, sep, column in pairs):
        raise ConvertError(f"{where}: FIELD=COLUMN pairs separated by commas (prompt=question,completion=answer), "
                           f"got {text[:80]!r}")
    return check_columns({field.strip(): column.strip() for field, _, column in pairs}, where)


def renamed(row: object, columns: dict[str, str], where: str) -> object:
    """The row with each mapped column under its field's name, the column's own name gone (so a swap works), before
    its format is detected; ConvertError naming the row and the column a row lacks."""
    if not columns or not isinstance(row, dict):
        return row
    for field, column in columns.items():
        if column not in row:
            raise ConvertError(f"{where}: no column {column!r}, which columns maps to {field!r} (the row has "
                               f"{sorted(row)})")
    return {**{key: value for key, value in row.items() if key not in columns.values()},
            **{field: row[column] for field, column in columns.items()}}


def read_row(row: object, fmt: str, where: str) -> Conversation:
    """The row as a Conversation, or ConvertError naming `where` and the field."""
    if not isinstance(row, dict):
        raise ConvertError(f"{where}: not a JSON object")
    missing = [key for key in FIELDS[fmt] if row.get(key) is None]
    if missing:
        raise ConvertError(f"{where}: no {missing[0]!r} field, which the {fmt} format needs (the source's "
                           f"first row was {fmt})")
    meta = check_metadata(row, where)
    if (row_id := _row_id(row.get("id"))) is not None:
        meta["row_id"] = row_id
    if fmt == "text":
        return Conversation(text=check_text(row["text"], f"{where}: text"), meta=meta)
    tools = _tools(row.get("tools"), where)
    if fmt == "messages":
        messages = without_nulls(_decoded(row["messages"], where, "messages"))
        return Conversation(check_messages(messages, f"{where}: messages"), tools, meta=meta)
    if fmt == "sharegpt":
        return Conversation(_sharegpt(row, where), tools, meta=meta)
    if fmt == "alpaca":
        return Conversation(_alpaca(row, where), tools, meta=meta)
    prompt = _side(row["prompt"], "user", where, "prompt")
    messages = prompt + _side(row["completion"], "assistant", where, "completion")
    return Conversation(check_messages(messages, f"{where}: prompt + completion"), tools, len(prompt), meta)


def _row_id(value: object) -> str | int | None:
    """The row's own `id` (a string or an integer), kept beside the example's `example_id`, never as it: data sets
    repeat ids (two files each numbered from 0, a dump that splits one conversation in parts), and a shard's
    example_id must name one example."""
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def _decoded(value: object, where: str, key: str) -> object:
    if not isinstance(value, str):
        return value
    return parse_json(value, f"{where}: {key}: a string here must be JSON, and is", ConvertError)


def _tools(value: object, where: str) -> list | None:
    if value is None:
        return None
    tools = without_nulls(_decoded(value, where, "tools"))
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ConvertError(f"{where}: tools: a list of JSON schemas (objects), got {str(tools)[:80]}")
    return tools or None


def _side(value: object, role: str, where: str, key: str) -> list[dict]:
    """A prompt or completion: a string is one turn of `role`, a list is messages."""
    if isinstance(value, str):
        return [{"role": role, "content": check_text(value, f"{where}: {key}")}]
    value = without_nulls(value)
    if not isinstance(value, list) or not value:
        raise ConvertError(f"{where}: {key}: a string or a non-empty list of messages, got {str(value)[:80]}")
    return value


def _alpaca(row: dict, where: str) -> list[dict]:
    """An optional system turn, the instruction (and a non-blank input after a newline) as the user turn, the output
    as the assistant's."""
    if row.get("history"):  # LLaMA-Factory's earlier turns: refused, never silently left out of the conversation
        raise ConvertError(f"{where}: history: an alpaca row's earlier turns are not read; give such rows as "
                           "messages")
    user = check_text(row["instruction"], f"{where}: instruction")
    if row.get("input") is not None and check_text(row["input"], f"{where}: input").strip():
        user = f"{user}\n{row['input']}"
    system = row.get("system")
    messages = [{"role": "system", "content": check_text(system, f"{where}: system")}] if system else []
    messages += [{"role": "user", "content": user},
                 {"role": "assistant", "content": check_text(row["output"], f"{where}: output")}]
    return check_messages(messages, f"{where}: instruction + output")


def _sharegpt(row: dict, where: str) -> list[dict]:
    turns = without_nulls(_decoded(row["conversations"], where, "conversations"))
    if not isinstance(turns, list) or not turns:
        raise ConvertError(f"{where}: conversations: needs a non-empty list of turns")
    messages = []
    if isinstance(row.get("system"), str) and row["system"]:
        messages.append({"role": "system", "content": row["system"]})
    for index, turn in enumerate(turns):
        at = f"{where}: conversations {index}"
        if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES or not isinstance(
                turn.get("value"), str):
            raise ConvertError(f"{at} needs 'from' in {sorted(SHAREGPT_ROLES)} and a string 'value', "
                               f"got {str(turn)[:80]}")
        if turn["from"] == "function_call":
            messages.append({"role": "assistant", "tool_calls": _calls(turn["value"], at)})
        else:
            messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return check_messages(messages, f"{where}: conversations")


def _calls(value: str, where: str) -> list[dict]:
    """A ShareGPT function_call's value ({"name", "arguments"}, or a list of them) as OpenAI tool_calls."""
    calls = _decoded(value, where, "value")
    calls = calls if isinstance(calls, list) else [calls]
    if not all(isinstance(call, dict) and isinstance(call.get("name"), str) for call in calls):
        raise ConvertError(f"{where} value: a function call is JSON with a 'name' (and 'arguments'), "
                           f"got {value[:80]!r}")
    return [{"type": "function", "function": call} for call in calls]
