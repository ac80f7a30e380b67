"""Where conversations come from: local files, folders of them, saved datasets, and the Hugging Face Hub.

A source is one of

    data/chat.jsonl, data/chat.json, data/chat.parquet, data/chat.arrow, data/chat.csv   a file
    data/chats/                          a folder: every such file in it and below, in name order
    data/saved/                          a folder written by `datasets`' save_to_disk (one split)
    hub:NAME[:CONFIG]:SPLIT[@REVISION]   a data set on the Hub (needs network access)

and is read streaming, one row at a time, so memory stays flat in the number of
rows. Parquet, Arrow, CSV, saved datasets and the Hub are read through the
`datasets` library (memory-mapped Arrow, or files read in blocks), a CSV with
every column as text (so "46" stays the string it was, and "NA" too). JSON
Lines are read line by line with Python's json, every row exactly as written:
`datasets`' JSON loader unifies each field's type over the rows and, where
they differ, falls back to pandas, which turned one row's "46" into the
number 46 and so blamed the wrong row; read as written, a row that is not
valid names itself. A `.json` file holding one array is read an element at a
time, each bounded as a JSON Lines row is, so the memory a dump of hundreds
of MB in one array takes follows its largest row, not the file. What
`datasets` keeps while it reads (its lock files) goes to the conversion's
scratch folder in its staging output, removed when reading ends, never to
the user's cache. A Hub source is resolved to the commit it names (or the
newest) before any row is read, and fails at once, naming it, when the Hub
cannot be reached. Each source is recorded with the SHA-256 of every file
read, or the Hub commit.
"""
from __future__ import annotations

import codecs
import csv
import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO, Iterator

from cflib import jsonio
from cflib.data.conversation import ConvertError
from cflib.data.shards import sha256_file
from cflib.jsonio import json_lines, read_json

HUB = "hub:"
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
SAVED_MARKERS = ("state.json", "dataset_info.json")  # what save_to_disk writes beside its Arrow files
SAVED_DICT = "dataset_dict.json"  # save_to_disk of several splits
ARRAY_CHUNK = 2**20  # bytes read at a time from a .json array
_WHITESPACE = re.compile(r"[ \t\r\n]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Source:
    spec: str  # as given: a path or hub:NAME[:CONFIG]:SPLIT[@REVISION]
    name: str  # each example's `source` where its row names none
    format: str = "auto"  # auto: detected from the first row (cflib.data.formats)
    named: bool = False  # the name was given, not taken from the path
    # {field: column} renamed before the format is detected (cflib.data.formats); None: the conversion's
    columns: dict | None = field(default=None, hash=False)

    @property
    def is_hub(self) -> bool:
        return self.spec.startswith(HUB)


def parse_source(entry: object, role: str) -> Source:
    """A source from a path or hub string, or a mapping {path, name, format, columns}; ConvertError naming `role`
    (the format and columns are checked with the conversion's settings)."""
    columns = None
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"path", "name", "format", "columns"})
        if unknown or not isinstance(entry.get("path"), str):
            raise ConvertError(f"{role}: a source is a path, hub:NAME[:CONFIG]:SPLIT[@REVISION], or a mapping of "
                               f"path (and optional name, format, columns); got {entry!r}")
        spec, name, fmt, columns = entry["path"], entry.get("name"), entry.get("format", "auto"), entry.get("columns")
    elif isinstance(entry, str) and entry:
        spec, name, fmt = entry, None, "auto"
    else:
        raise ConvertError(f"{role}: a source is a path or hub:NAME[:CONFIG]:SPLIT[@REVISION], got {entry!r}")
    if spec.startswith(HUB):
        hub_parts(spec)  # refuses a malformed one now
        default = hub_parts(spec)[0]
    else:
        default = Path(spec).stem if Path(spec).suffix in BUILDERS else Path(spec).name
    if name is not None and (not isinstance(name, str) or not name):
        raise ConvertError(f"{role}: {spec}: a source's name is a non-empty string, got {name!r}")
    return Source(spec, name or default, fmt, named=name is not None, columns=columns)


def distinct_names(sources: list[Source]) -> list[Source]:
    """The sources, two inputs whose names come from paths that share them (a/train.jsonl, b/train.jsonl) named
    by their paths (a Hub source by NAME:CONFIG:SPLIT) instead, so each example's `source` tells them apart. Names given stay: sources given one
    name are one source to the manifest and to each example."""
    counts = Counter(source.name for source in sources)
    return [replace(source, name=source.spec[len(HUB):] if source.is_hub else str(Path(source.spec).with_suffix("")))
            if counts[source.name] > 1 and not source.named else source for source in sources]


def hub_parts(spec: str) -> tuple[str, str | None, str, str | None]:
    """(name, config, split, revision) of hub:NAME[:CONFIG]:SPLIT[@REVISION]."""
    body, _, revision = spec[len(HUB):].partition("@")
    parts = body.split(":")
    if len(parts) not in (2, 3) or not all(parts) or (spec.count("@") and not revision):
        raise ConvertError(f"{spec}: a Hub source is hub:NAME[:CONFIG]:SPLIT[@REVISION], e.g. "
                           "hub:HuggingFaceH4/ultrachat_200k:train_sft")
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    return name, config, split, revision or None


def local_files(source: Source) -> list[Path]:
    """The files a local source reads: itself, a saved dataset's Arrow files, or a folder's data files."""
    path = Path(source.spec)
    if path.is_file():
        if path.suffix not in BUILDERS:
            raise ConvertError(f"{path}: not a data file this reads ({', '.join(BUILDERS)})")
        return [path]
    if not path.is_dir():
        raise ConvertError(f"{path}: no such file or folder (a source is a data file, a folder of them, a saved "
                           "dataset, or hub:NAME[:CONFIG]:SPLIT[@REVISION])")
    if (path / SAVED_DICT).is_file():
        index = read_json(path / SAVED_DICT, ConvertError, "saved dataset's index")
        splits = index.get("splits", []) if isinstance(index, dict) else []
        raise ConvertError(f"{path}: a saved DatasetDict; name one split's folder ({', '.join(map(str, splits))})")
    if is_saved_dataset(path):
        return sorted(path.glob("*.arrow")) + [path / name for name in SAVED_MARKERS]
    files = sorted(file for file in path.rglob("*") if file.suffix in BUILDERS and file.is_file()
                   and file.name not in (*SAVED_MARKERS, SAVED_DICT)  # a saved dataset's own bookkeeping
                   and not any(part.startswith(".") for part in file.relative_to(path).parts))
    if not files:
        raise ConvertError(f"{path}: a folder with no data file in it ({', '.join(BUILDERS)})")
    return files


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and all((path / name).is_file() for name in SAVED_MARKERS)


def describe(source: Source, hub_commit: str | None = None) -> dict:
    """What the manifest records of a source: its format and the columns it renamed, its files with their SHA-256,
    or the Hub commit read."""
    record = {"name": source.name, "spec": source.spec, "format": source.format, "columns": source.columns or {}}
    if source.is_hub:
        name, config, split, revision = hub_parts(source.spec)
        return {**record, "hub": {"name": name, "config": config, "split": split, "revision": revision,
                                  "commit": hub_commit}}
    return {**record, "files": [{"path": str(file), "sha256": sha256_file(file)} for file in local_files(source)]}


class SourceReader:
    """Rows of sources through `datasets`, its cache files in `scratch` (a folder its caller removes)."""

    def __init__(self, scratch: Path) -> None:
        self._scratch = scratch
        self.hub_commits: dict[str, str] = {}

    def rows(self, source: Source) -> Iterator[tuple[str, dict]]:
        """(where, row) of each row, `where` naming the file (or source) and the row number from 1."""
        if source.is_hub:
            yield from _numbered(self._hub_dataset(source), source.spec)
            return
        path = Path(source.spec)
        if is_saved_dataset(path):
            yield from _numbered(self._saved_dataset(path), str(path))
            return
        for file in local_files(source):
            if BUILDERS[file.suffix] == "json":
                yield from json_rows(file)
            else:
                yield from _numbered(self._file_dataset(file), str(file))

    def _file_dataset(self, file: Path):
        datasets = _datasets()

        options = {}
        if BUILDERS[file.suffix] == "csv":  # every column as text, as written: no numbers, no missing values
            options = {"features": datasets.Features({name: datasets.Value("string") for name in _csv_header(file)}),
                       "na_filter": False}
        return datasets.load_dataset(BUILDERS[file.suffix], data_files=str(file), split="train", streaming=True,
                                     cache_dir=str(self._scratch), **options)

    @staticmethod
    def _saved_dataset(path: Path):
        datasets = _datasets()

        try:
            return datasets.load_from_disk(str(path))
        except Exception as err:  # datasets raises many kinds
            raise ConvertError(f"{path}: not a readable saved dataset ({err})") from None

    def _hub_dataset(self, source: Source):
        """The Hub data set at the commit its revision names, streamed; fails at once when the Hub is out of
        reach (offline, or HF_HUB_OFFLINE set), naming the source.

        The revision is resolved once per reader, so the commit recorded is the one read (a conversion reads each
        source once, eval_fraction's eval partition from what the train partition kept).
        """
        datasets = _datasets()

        name, config, split, revision = hub_parts(source.spec)
        _refuse_local_shadow(source.spec, name)
        if source.spec not in self.hub_commits:
            self.hub_commits[source.spec] = _hub_commit(source.spec, name, revision)
        commit = self.hub_commits[source.spec]
        try:
            return datasets.load_dataset(name, config, split=split, revision=commit, streaming=True,
                                         cache_dir=str(self._scratch))
        except Exception as err:
            raise ConvertError(f"{source.spec}: datasets could not open it ({err})") from None


def _hub_commit(spec: str, name: str, revision: str | None) -> str:
    """The commit a Hub data set's revision names now."""
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(name, revision=revision, timeout=10).sha
    except Exception as err:  # no network, offline mode, no such data set or revision
        raise ConvertError(f"{spec}: cannot reach it on the Hugging Face Hub ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); a hub: source needs network "
                           "access: without it, name the files or a saved dataset folder") from None


def _refuse_local_shadow(spec: str, name: str) -> None:
    """`datasets.load_dataset(name)` reads a local folder or file `name` (relative to the working directory) in
    preference to the Hub, while the manifest would record the Hub commit: refuse such a source, never guess."""
    local = Path(name)
    if local.exists():
        raise ConvertError(f"{spec}: {local.resolve()} exists, and datasets would read it instead of the Hub data "
                           f"set {name}; to read that folder, give it as a local source ({name}), not hub:; to read "
                           "the Hub, run from another working directory or rename the folder")


def _datasets():
    """The `datasets` library (the `data` extra), or ConvertError saying how to install it."""
    try:
        import datasets
    except ModuleNotFoundError:
        raise ConvertError("reading Parquet, Arrow, CSV, saved datasets and the Hub takes the datasets library: "
                           "pip install 'cflib[data]'") from None
    return datasets


def _csv_header(file: Path) -> list[str]:
    """The column names of a CSV file's first row, read by Python's csv (the rows after it are read by
    `datasets`, without csv's field limit)."""
    with open(file, newline="", encoding="utf-8", errors="replace") as handle:
        reader = csv.reader(handle)
        try:
            header = next(reader, None)
        except csv.Error as err:  # a field past csv.field_size_limit(), mostly a quote left open
            raise ConvertError(f"{file} header row: not readable as CSV ({err}, by line {reader.line_num}); a "
                               "column name is never that long: is a quote left open?") from None
    if not header:
        raise ConvertError(f"{file}: a CSV file starts with a header naming its columns")
    return header


def _numbered(dataset, label: str) -> Iterator[tuple[str, dict]]:
    """Each row with where it stands; a row `datasets` cannot read stops here, naming the file."""
    rows = iter(dataset)
    number = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as err:  # Arrow's and pandas' parse errors, a schema that changes between rows
            raise ConvertError(f"{label}: datasets could not read row {number + 1} or after "
                               f"({type(err).__name__}: {err})") from None
        number += 1
        yield f"{label} row {number}", row


def json_rows(file: Path) -> Iterator[tuple[str, object]]:
    """The rows of a JSON Lines file, one line at a time (or of a .json file holding one array, one element at a
    time), each as written; a row that is not valid JSON names itself."""
    if file.suffix == ".json" and _first_byte(file) == b"[":
        with open(file, "rb") as handle:
            yield from ((f"{file} row {n}", row) for n, row in enumerate(JsonArray(file, handle), start=1))
        return
    number = 0  # rows, not lines: a blank line is no row
    for _, row in json_lines(file, ConvertError, where=lambda line: f"{file} row {number + 1}"):
        number += 1
        yield f"{file} row {number}", row


class JsonArray:
    """The elements of the JSON array in a file, read a chunk at a time: memory holds about one element, however
    large the file (ShareGPT dumps are one array of hundreds of MB). Each element is bounded as one JSON document
    is (cflib.jsonio: its size and nesting), and an error names the element as the file's row, from 1."""

    def __init__(self, file: Path, handle: BinaryIO) -> None:
        self.file, self.handle = file, handle
        self.decoder = _json_text_decoder(handle, "surrogatepass")
        self.text, self.pos, self.eof = "", 0, False

    def __iter__(self) -> Iterator[object]:
        self._expect("[", f"{self.file}: not a JSON array: expected '[' at its start")
        number = 0
        if self._peek() != "]":  # an empty array has no row
            while True:
                number += 1
                yield self._element(f"{self.file} row {number}")
                if self._peek() != ",":
                    break
                self.pos += 1
        self._expect("]", f"{self.file}: after row {number}, expected ',' and the next row, or ']' ending the array"
                     if number else "")
        if self._peek():
            raise ConvertError(f"{self.file}: text after the array's closing ']' ({self._seen()}); a .json source "
                               "is one array of rows, or JSON Lines")

    def _more(self, size: int) -> None:
        """About `size` more bytes decoded onto the text held, what was read before `pos` dropped."""
        data = self.handle.read(size)
        self.eof = not data
        try:
            text = self.decoder.decode(data, final=self.eof)
        except UnicodeDecodeError as err:
            raise ConvertError(f"{self.file}: not valid JSON text ({err.reason} near byte {self.handle.tell()}); "
                               "JSON is UTF-8") from None
        self.text, self.pos = self.text[self.pos:] + text, 0

    def _peek(self) -> str:
        """The next character past JSON whitespace ("" at the end of the file), not consumed."""
        while True:
            self.pos = _WHITESPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text) or self.eof:
                return self.text[self.pos:self.pos + 1]
            self._more(ARRAY_CHUNK)

    def _expect(self, char: str, refusal: str) -> None:
        if self._peek() != char:
            raise ConvertError(f"{refusal}; found {self._seen()}")
        self.pos += 1

    def _seen(self) -> str:
        return repr(self.text[self.pos:self.pos + 20]) if self.pos < len(self.text) else "the end of the file"

    def _element(self, where: str) -> object:
        """The value at `pos`, read on until it is whole: the text held grows by doubling, so each byte of a long
        row is decoded a few times at most, never once per chunk."""
        limit = jsonio.MAX_BYTES
        self._peek()  # past the whitespace before it
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.pos)
            except RecursionError:
                raise ConvertError(f"{where}: JSON nested deeper than {jsonio.MAX_DEPTH} levels") from None
            except json.JSONDecodeError as err:
                if self.eof or not _cut_short(err, len(self.text)):
                    raise ConvertError(f"{where}: not valid JSON ({err.msg}, character {err.pos - self.pos + 1} "
                                       "of the row)") from None
                held = len(self.text) - self.pos
                if held > limit:  # characters: at least as many bytes
                    raise ConvertError(f"{where}: more than the {limit:,} bytes cflib reads in one row, or JSON "
                                       "left open (a string or bracket never closed)")
                self._more(max(ARRAY_CHUNK, min(held, limit + 1 - held)))
                continue
            # A number at the end of the text held may go on past it (12|.5): whole once text follows it.
            if self.eof or len(self.text) - end > 2:
                break
            self._more(ARRAY_CHUNK)
        self._check_bounds(where, end, value, limit)
        self.pos = end
        return value

    def _check_bounds(self, where: str, end: int, value: object, limit: int) -> None:
        """The row from `pos` to `end` bounded as jsonio bounds a document: its size in bytes, and its nesting."""
        start, text = self.pos, self.text
        if (end - start) * 4 > limit and len(text[start:end].encode("utf-8", "surrogatepass")) > limit:
            raise ConvertError(f"{where}: more than the {limit:,} bytes cflib reads in one row")
        if text.count("[", start, end) + text.count("{", start, end) > jsonio.MAX_DEPTH and jsonio.too_deep(
                value, jsonio.MAX_DEPTH):
            raise ConvertError(f"{where}: JSON nested deeper than {jsonio.MAX_DEPTH} levels")


def _cut_short(err: json.JSONDecodeError, length: int) -> bool:
    """Whether a decoding error may come from the end of the text held rather than from the JSON: it stopped within
    the few characters of an escape, literal or number of the end, or in a string not yet closed."""
    return err.msg.startswith("Unterminated string") or err.pos >= length - 9  # -Infinity: 9 characters


def _json_text_decoder(handle: BinaryIO, errors: str) -> codecs.IncrementalDecoder:
    """An incremental decoder for the JSON file open at its start, in the encoding JSON's own detection finds
    (UTF-8 with or without a BOM, UTF-16, UTF-32), as json.loads does."""
    encoding = json.detect_encoding(handle.read(4))
    handle.seek(0)
    return codecs.getincrementaldecoder(encoding)(errors)


def _first_byte(file: Path) -> bytes:
    """The file's first character past a byte order mark and JSON's whitespace, as a byte (b"" when there is none):
    an array pretty-printed after a newline, or saved by an editor that writes a BOM (UTF-8, 16 or 32, which JSON's
    own detection reads), is still an array."""
    with open(file, "rb") as handle:
        decoder = _json_text_decoder(handle, "replace")
        while chunk := handle.read(2**16):
            if text := decoder.decode(chunk).lstrip("\ufeff \t\r\n"):
                return text[:1].encode()
    return b""
