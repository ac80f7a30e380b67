"""Preflight: a shard checked against its manifest and the model, once, before any training step.

Always fatal: anything the format forbids (cflib.data: offsets, token ids and
labels outside the vocabulary, misaligned labels, an example over the cap or
seq_len, a vocabulary larger than the model's, an EOS outside it, a
loss_metadata.jsonl whose example ids differ from the index's) and a file
whose SHA-256 differs from the one sft.idx.json recorded. Findings that a
foreign writer may leave (no hashes or cap recorded, a smaller vocabulary
than the model's, supervised-token counts that disagree with labels.bin,
examples that neither end with EOS nor teach it last, declared truncations) are warnings, and
fatal with `require_release_ready`.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from cflib.data.shards import IGNORE_INDEX, ShardError, ShardPartition, open_shard

HASHED_FILES = ("input_ids.bin", "labels.bin", "examples.jsonl")


def manifest_findings(shard: ShardPartition, model_vocab_size: int) -> list[str]:
    """What in the shard falls short of its manifest or of a release-ready shard."""
    index, findings = shard.index, []
    unhashed = [name for name in HASHED_FILES if name not in (index.get("sha256") or {})]
    if unhashed:
        findings.append(f"sft.idx.json records no sha256 for {unhashed}: they cannot be verified")
    if shard.max_seq_len is None:
        findings.append("sft.idx.json records no sequence cap")
    if shard.vocab_size != model_vocab_size:
        findings.append(f"shard vocab_size {shard.vocab_size} differs from the model's {model_vocab_size}")
    if "supervised_tokens" in index and index["supervised_tokens"] != shard.supervised_tokens():
        findings.append(f"sft.idx.json says supervised_tokens {index['supervised_tokens']}, labels.bin "
                        f"supervises {shard.supervised_tokens()}")
    declared = np.array([row.get("supervised_tokens", -1) for row in shard.rows])
    disagree = np.flatnonzero((declared >= 0) & (declared != shard.supervised_counts))
    if disagree.size:
        findings.append(f"{disagree.size} rows of examples.jsonl miscount supervised_tokens (first: row "
                        f"{disagree[0]})")
    unended = unended_examples(shard)
    if unended.size:
        first = int(unended[0])
        findings.append(f"{unended.size} examples neither end with EOS {shard.eos_token_id} nor teach it last "
                        f"(first: row {first}, example_id {shard.rows[first].get('example_id', '?')!r}): "
                        "truncated or sliced?")
    truncated = index.get("truncated_examples", (index.get("conversion") or {}).get("stats", {}).get(
        "truncated_examples", 0))
    if truncated:
        dropped = (index.get("conversion") or {}).get("overflow") == "drop_turns"
        findings.append(f"sft.idx.json declares {truncated} truncated examples" + (
            " (conversations kept without their last turns: overflow drop_turns)" if dropped else ""))
    return findings


def unended_examples(shard: ShardPartition) -> np.ndarray:
    """The rows whose example is cut short: its last token is not EOS, and neither is the last token it teaches.
    A chat template may put text after the end of a turn (ChatML's newline after <|im_end|>): such an example
    teaches EOS last and is whole."""
    eos = shard.eos_token_id
    candidates = np.flatnonzero(shard.input_ids[shard.offsets + shard.lengths - 1] != eos)
    cut = []
    for row in candidates:  # the rows a template's trailing text leaves; each read alone, memory stays flat
        start = shard.offsets[row]
        labels = np.asarray(shard.labels[start:start + shard.lengths[row]])
        taught = np.flatnonzero(labels != IGNORE_INDEX)
        if not taught.size or labels[taught[-1]] != eos:
            cut.append(row)
    return np.asarray(cut, dtype=np.int64)


def preflight(root: str | Path, partition: str, *, vocab_size: int, seq_len: int | None,
              require_release_ready: bool = False, seq_len_remedy: str = "drop them") -> tuple[ShardPartition, dict]:
    """Open and check one partition; returns it and a report for the run record. seq_len None: any length up to the
    shard's own cap (the caller leaves the longer examples out); seq_len_remedy: what an error for examples over
    seq_len offers besides raising it."""
    shard = open_shard(root, partition, vocab_size=vocab_size, seq_len=seq_len, seq_len_remedy=seq_len_remedy)
    # After the token checks, so a damaged file is named by what is wrong in it rather than by its hash.
    verified = shard.check_hashes()
    findings = manifest_findings(shard, vocab_size)
    where = shard.directory / "sft.idx.json"
    if findings and require_release_ready:
        raise ShardError(f"{where}: not release-ready (require_release_ready: true): " + "; ".join(findings))
    for finding in findings:
        warnings.warn(f"{where}: {finding}", stacklevel=2)
    report = {"partition": partition, "examples": len(shard), "tokens": int(shard.lengths.sum()),
              "supervised_tokens": shard.supervised_tokens(), "vocab_size": shard.vocab_size,
              "eos_token_id": shard.eos_token_id, "max_seq_len": shard.max_seq_len, "sha256_verified": verified,
              "findings": findings, "release_ready": not findings,
              "loss_metadata": shard.metadata_fields}  # the sidecar's fields, its ids checked on opening; None: none
    return shard, report
