"""Collation: a list of samples to a batch of right-padded LongTensors."""

from __future__ import annotations

import torch

from mtune.data.common import IGNORE_INDEX
from mtune.modules.packed_attention import longest_document


def collate_padded(
    batch: list[dict[str, list[int]]],
    pad_id: int,
    ignore_index: int = IGNORE_INDEX,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor | int]:
    """Pad every sample on the right to the longest in the batch (rounded up to `pad_to_multiple_of`, e.g. 8 for
    tensor cores).

    Returns LongTensors `[b, s]`: `tokens` (padded with `pad_id`), `labels` (padded with `ignore_index`), and for
    packed samples `input_pos` (the padding counts from 0, as its own document) and `document_ids` (the padding
    gets a document id of its own, so no real token attends to it), with ``longest_document``: an int, the longest
    document's length, padding's included (the model's varlen attention sizes its work by it, a value the device
    would have to synchronise for). ``num_tokens`` (a 0-d LongTensor) counts the tokens before padding, for
    throughput metrics.
    """
    length = max(len(sample["tokens"]) for sample in batch)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    out: dict[str, torch.Tensor] = {}
    for key in batch[0]:
        rows = []
        for sample in batch:
            values = sample[key]
            pad = length - len(values)
            if key == "tokens":
                fill = [pad_id] * pad
            elif key == "labels":
                fill = [ignore_index] * pad
            elif key == "input_pos":
                fill = list(range(pad))
            elif key == "document_ids":
                fill = [max(values) + 1] * pad
            else:
                raise KeyError(f"collate_padded: unexpected sample field {key!r}")
            rows.append(list(values) + fill)
        out[key] = torch.tensor(rows, dtype=torch.long)
    if "document_ids" in out:
        out["longest_document"] = longest_document(out["document_ids"])
    out["num_tokens"] = torch.tensor(sum(len(sample["tokens"]) for sample in batch), dtype=torch.long)
    return out
