"""The steps a W&B run's offline transaction log (`run-<id>.wandb`) holds, read without wandb's service.

A resumed run sends W&B only the steps its earlier offline folders lack (cflib.train.trackers.WandbTracker):
the killed process's service may have written fewer rows than it was handed. wandb keeps no Python reader of
these files, so this one follows leveldb's log format; a file it cannot read yields the steps before the fault,
and the run then sends those steps again rather than lose any.
"""
from __future__ import annotations

import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Iterator

# A .wandb file is a leveldb log (github.com/google/leveldb/blob/main/doc/log_format.md) of W&B Record protobufs
# behind a 7-byte header: wandb 0.31 keeps no Python reader of its own.
_WANDB_LOG_IDENT, _LOG_BLOCK, _LOG_HEADER = b":W&B", 32768, 7
_FULL, _FIRST, _LAST = 1, 2, 4  # and 3, a middle chunk


def wandb_history_steps(path: Path) -> Iterator[int]:
    """The steps of the history rows in a W&B run's transaction log, up to where a kill cut it short."""
    from wandb.proto.wandb_internal_pb2 import Record

    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size <= _LOG_HEADER:
            return
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != _WANDB_LOG_IDENT:
                return
            for entry in _log_entries(data):
                record = Record.FromString(entry)
                if record.WhichOneof("record_type") == "history":
                    yield record.history.step.num


def _log_entries(data: mmap.mmap) -> Iterator[bytes]:
    """The whole entries of a leveldb log; it stops at the first chunk cut short or failing its checksum."""
    at, entry = _LOG_HEADER, b""
    while at + _LOG_HEADER <= len(data):
        left_in_block = _LOG_BLOCK - at % _LOG_BLOCK
        if left_in_block < _LOG_HEADER:  # a block's last bytes are padding
            at += left_in_block
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, at)
        chunk = data[at + _LOG_HEADER:at + _LOG_HEADER + length]
        if len(chunk) < length or zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != checksum:
            return
        at += _LOG_HEADER + length
        entry = chunk if kind in (_FULL, _FIRST) else entry + chunk
        if kind in (_FULL, _LAST):
            yield entry
