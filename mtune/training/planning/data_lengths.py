"""``mtune plan --from-data``: the lengths of the rows a config's dataset really produces, and the longest batch.

The plan's default batch is every row ``tokenizer.max_seq_len`` tokens long, the most the config allows. Here the
config's own data setup (the recipe's `setup_tokenizer` and `setup_data`, the dataset cache included) builds the
training set, and :func:`data_lengths` reports tokens per row (min, median, p95, max; before padding) and the padded
length of the longest batch the loader can make:

- unpacked rows are padded to the longest in their batch, so the longest batch has ``batch_size`` rows of the
  longest sample's length (every batch can hold it);
- packed rows are always ``max_seq_len`` long (their tail is padding), so packing plans as without
  ``--from-data``; the report then shows how full the packs are.

``plan_memory(cfg, seq_len=lengths.longest_batch)`` plans that batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtune.training.data_setup import setup_data, setup_tokenizer
from mtune.training.model_setup import resolve_model_source

__all__ = ["DataLengths", "data_lengths"]


@dataclass(frozen=True)
class DataLengths:
    """Tokens per row of a training set (before padding) and the padded length of its longest batch."""

    rows: int
    packed: bool
    min: int
    median: int
    p95: int
    max: int
    longest_batch: int
    """The row length of the longest batch the loader makes (what the plan uses)."""

    def line(self) -> str:
        what = "packs (real tokens per pack)" if self.packed else "samples (tokens per sample)"
        return (f"data: {self.rows} {what}: min {self.min}, median {self.median}, p95 {self.p95}, max {self.max}; "
                f"longest batch: rows of {self.longest_batch} tokens")


def _row_lengths(dataset, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored, real)`` tokens of every row: its stored length (a pack's includes its padding tail) and its
    non-padding tokens. From a tokenized dataset's flat storage when it has one, else row by row. A pack's
    padding is its ``pad_id`` tokens (packing pads with them; a pad id inside a document is counted too)."""
    pad_id = getattr(dataset, "pad_id", None)
    fields, offsets = getattr(dataset, "fields", None), getattr(dataset, "offsets", None)
    if fields is not None and offsets is not None and "tokens" in fields:
        offsets = offsets.long()
        stored = offsets.diff()
        if not packed or pad_id is None:
            return stored, stored
        real = torch.cat([torch.zeros(1, dtype=torch.long), (fields["tokens"] != pad_id).long().cumsum(0)])
        return stored, real[offsets[1:]] - real[offsets[:-1]]
    rows = [dataset[i]["tokens"] for i in range(len(dataset))]
    stored = torch.tensor([len(row) for row in rows])
    if packed and pad_id is not None:
        return stored, torch.tensor([sum(t != pad_id for t in row) for row in rows])
    return stored, stored


def data_lengths(cfg) -> DataLengths:
    """Build ``cfg``'s training set as a run would (its tokenizer, ``dataset`` node and the recipe's data setup)
    and measure it (see the module docstring)."""
    source = resolve_model_source(cfg.model)
    train_loader, _, _ = setup_data(cfg, setup_tokenizer(cfg.tokenizer, source))
    dataset = train_loader.dataset
    packed = bool(getattr(dataset, "packed", False))
    stored, real = _row_lengths(dataset, packed)
    lengths, n = real.sort().values, len(real)
    return DataLengths(rows=n, packed=packed, min=int(lengths[0]), median=int(lengths[(n - 1) // 2]),
                       p95=int(lengths[min(n - 1, int(0.95 * n))]), max=int(lengths[-1]),
                       longest_batch=int(stored.max()))
