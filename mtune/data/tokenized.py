"""Eager tokenization (and packing) of a whole dataset, cached on disk, behind a map-style dataset.

Everything is done once, up front, so the sample count, truncations and padding are known (and logged once)
before training starts. The result is cached under `$MTUNE_CACHE_DIR/data` (default `~/.cache/mtune/data`), keyed
by the data's fingerprint, the tokenizer's fingerprint and every setting that changes the samples; a second run
loads it instead of tokenizing. In a distributed run the first process of each node builds it while the others
wait at a barrier.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from typing import Any, Callable

import torch
from tqdm import tqdm

from mtune.data.common import (
    IGNORE_INDEX, DataError, barrier, cache_dir, is_local_main_process, is_main_process, log,
)
from mtune.data.packing import pack_samples
from mtune.data.sources import RowSource

CACHE_FORMAT = 3  # bump when the stored layout or the tokenization rules change (2: Qwen reasoning_content read;
# 3: files read without a byte-order mark, CSV rows past the header and empty answers refused, mapped columns checked,
# blank texts dropped)


class MissingColumn(Exception):
    """Raised by a row converter: `column` (the data's name) is absent; `role` is the builder's name for it."""

    def __init__(self, role: str, column: str):
        super().__init__(column)
        self.role, self.column = role, column


class RowError(Exception):
    """Raised by a row converter for any other problem with one row (the message is prefixed with the row)."""


# A row converter turns one row into (tokens, labels, truncated).
RowToSample = Callable[[dict[str, Any]], tuple[list[int], list[int], bool]]


class TokenizedDataset(torch.utils.data.Dataset):
    """Map-style dataset of tokenized samples: `ds[i]` is `{"tokens": list[int], "labels": list[int]}` (labels
    already shifted, IGNORE_INDEX where not trained), plus `input_pos` and `document_ids` when `packed`.

    Stored flat (one int32 tensor per field and an offsets tensor) so that large datasets stay compact.
    """

    def __init__(self, fields: dict[str, torch.Tensor], offsets: torch.Tensor, pad_id: int, stats: dict[str, Any]):
        self.fields, self.offsets, self.pad_id, self.stats = fields, offsets, pad_id, stats
        self.packed = "document_ids" in fields

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return {k: v[start:end].tolist() for k, v in self.fields.items()}


def labels_from_mask(tokens: list[int], trained: list[bool]) -> list[int]:
    """Shifted labels: `labels[i] = tokens[i+1]` where token i+1 is trained, else IGNORE_INDEX (and the last)."""
    return [t if m else IGNORE_INDEX for t, m in zip(tokens[1:], trained[1:])] + [IGNORE_INDEX]


def build_tokenized(
    tokenizer,
    source: RowSource,
    row_to_sample: RowToSample,
    *,
    name: str,
    settings: dict[str, Any],
    max_seq_len: int | None,
    packed: bool,
    cache: bool = True,
) -> TokenizedDataset:
    """Tokenize every row of `source` with `row_to_sample` (and pack when `packed`), through the disk cache."""
    if packed and not max_seq_len:
        raise DataError(f"{name}: packed=true needs max_seq_len (set it on the dataset or the tokenizer)")
    key_parts = {
        "format": CACHE_FORMAT,
        "builder": name,
        "data": source.fingerprint,
        "tokenizer": tokenizer.fingerprint(),
        "settings": settings,
        "max_seq_len": max_seq_len,
        "packed": packed,
    }
    key = hashlib.sha256(json.dumps(key_parts, sort_keys=True, default=str).encode()).hexdigest()[:32]
    path = cache_dir() / "data" / f"{name}-{key}.pt"

    stored = None
    if not cache or is_local_main_process():
        if cache and path.exists():
            stored = torch.load(path, weights_only=True)
        else:
            stored = _build(tokenizer, source, row_to_sample, max_seq_len, packed)
            if cache:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                torch.save(stored, tmp)
                os.replace(tmp, path)  # atomic: a reader never sees half a file
    if cache:
        barrier()
        if stored is None:
            stored = torch.load(path, weights_only=True)
    dataset = TokenizedDataset(stored["fields"], stored["offsets"], tokenizer.pad_id, stored["stats"])
    if is_main_process():
        log.info("%s (%s): %s", name, source.description, describe(dataset.stats, max_seq_len))
    return dataset


def _build(tokenizer, source: RowSource, row_to_sample: RowToSample, max_seq_len, packed) -> dict[str, Any]:
    tokens: list[list[int]] = []
    labels: list[list[int]] = []
    rows = truncated = masked = 0
    for row in tqdm(source.read(), desc="tokenizing", unit=" rows", disable=not is_local_main_process()):
        rows += 1
        try:
            sample_tokens, sample_labels, was_truncated = row_to_sample(row.data)
        except MissingColumn as e:
            if row.first:
                raise DataError(
                    f"{row.where}: no column {e.column!r} (needed as {e.role!r}); available columns: "
                    f"{', '.join(map(str, row.data))}; map one with column_map: {{{e.role}: <column>}}"
                ) from None
            raise DataError(f"{row.where}: missing column {e.column!r}") from None
        except RowError as e:
            raise DataError(f"{row.where}: {e}") from None
        truncated += was_truncated
        if all(label == IGNORE_INDEX for label in sample_labels):
            masked += 1  # nothing to learn from (e.g. truncated before the answer): dropped, counted
            continue
        tokens.append(sample_tokens)
        labels.append(sample_labels)
    if rows == 0:
        raise DataError(f"{source.description}: the dataset is empty")
    if not tokens:
        raise DataError(
            f"{source.description}: all {rows} samples are fully masked (no token has a label): check the "
            "column_map / roles, or raise max_seq_len if truncation cut off the answers"
        )
    stats: dict[str, Any] = {
        "rows": rows,
        "samples": len(tokens),
        "truncated": truncated,
        "dropped_fully_masked": masked,
        "tokens": sum(map(len, tokens)),
        "trained_tokens": sum(label != IGNORE_INDEX for sample in labels for label in sample),
    }
    fields = {"tokens": tokens, "labels": labels}
    if packed:
        fields, pack_stats = pack_samples(tokens, labels, max_seq_len, tokenizer.pad_id)
        stats.update(pack_stats)
    lengths = torch.tensor([0] + [len(t) for t in fields["tokens"]], dtype=torch.int64)
    return {
        "fields": {k: torch.tensor(list(itertools.chain.from_iterable(v)), dtype=torch.int32)
                   for k, v in fields.items()},
        "offsets": torch.cumsum(lengths, 0),
        "stats": stats,
    }


def describe(stats: dict[str, Any], max_seq_len: int | None) -> str:
    """The one log line a dataset prints: samples, truncations, drops and (packed) the padding saved."""
    text = f"{stats['samples']} samples, {stats['tokens']} tokens ({stats['trained_tokens']} trained)"
    if stats["truncated"]:
        text += f"; {stats['truncated']} truncated to max_seq_len={max_seq_len}"
    if stats["dropped_fully_masked"]:
        text += f"; {stats['dropped_fully_masked']} dropped with no trained token"
    if "packs" in stats:
        total = stats["packs"] * max_seq_len
        unpacked = stats["samples"] * max_seq_len
        text += (
            f"; packed into {stats['packs']} sequences of {max_seq_len}: {stats['padding']} padding tokens "
            f"({100 * stats['padding'] / total:.1f}%) instead of {stats['padding_unpacked']} "
            f"({100 * stats['padding_unpacked'] / unpacked:.1f}%) with every sample padded to max_seq_len"
        )
    return text
