"""Packing: several samples share one sequence of `max_seq_len` tokens, each seeing only itself.

Each pack carries, per token, `input_pos` (the position within its own sample, so rotary embeddings restart at 0)
and `document_ids` (which sample of the pack the token belongs to, from which the model builds a block-causal
mask). The tail of a pack is padding: `pad_id` tokens, `IGNORE_INDEX` labels, its own document id. Samples are
packed greedily in dataset order; shuffling happens on packs, in the loader.
"""

from __future__ import annotations

from tqdm import tqdm

from mtune.data.common import IGNORE_INDEX, is_local_main_process


def pack_samples(
    tokens: list[list[int]], labels: list[list[int]], max_seq_len: int, pad_id: int
) -> tuple[dict[str, list[list[int]]], dict[str, int]]:
    """Pack samples (each at most `max_seq_len` long) into sequences of exactly `max_seq_len` tokens.

    Returns `({"tokens", "labels", "input_pos", "document_ids"}: one list per pack, stats)` where stats holds
    `packs`, `padding` (pad tokens in the packs) and `padding_unpacked` (pad tokens had every sample been padded
    to `max_seq_len`).
    """
    packs: dict[str, list[list[int]]] = {"tokens": [], "labels": [], "input_pos": [], "document_ids": []}
    current: dict[str, list[int]] = {k: [] for k in packs}
    doc = 0

    def close() -> None:
        nonlocal current, doc
        pad = max_seq_len - len(current["tokens"])
        if pad:
            current["tokens"] += [pad_id] * pad
            current["labels"] += [IGNORE_INDEX] * pad
            current["input_pos"] += list(range(pad))
            current["document_ids"] += [doc] * pad
        for k in packs:
            packs[k].append(current[k])
        current = {k: [] for k in packs}
        doc = 0

    progress = tqdm(zip(tokens, labels), total=len(tokens), desc="packing", disable=not is_local_main_process())
    for sample_tokens, sample_labels in progress:
        n = len(sample_tokens)
        if len(current["tokens"]) + n > max_seq_len:
            close()
        current["tokens"] += sample_tokens
        current["labels"] += sample_labels
        current["input_pos"] += list(range(n))
        current["document_ids"] += [doc] * n
        doc += 1
    if current["tokens"]:
        close()
    real = sum(map(len, tokens))
    stats = {
        "packs": len(packs["tokens"]),
        "padding": len(packs["tokens"]) * max_seq_len - real,
        "padding_unpacked": len(tokens) * max_seq_len - real,
    }
    return packs, stats


def pack_pairs(lengths: list[tuple[int, int]], row_len: int) -> list[list[int]]:
    """Preference pairs packed whole into rows of ``row_len`` tokens: the indices of the pairs in each row, greedily
    in dataset order (a pair that does not fit the current row starts the next). ``lengths``: each pair's
    ``(chosen tokens, rejected tokens)``; a pair longer than ``row_len`` is an error."""
    rows: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, (chosen, rejected) in enumerate(lengths):
        size = chosen + rejected
        if size > row_len:
            raise ValueError(f"pair {index}: {size} tokens do not fit a packed row of {row_len}")
        if current and used + size > row_len:
            rows.append(current)
            current, used = [], 0
        current.append(index)
        used += size
    if current:
        rows.append(current)
    return rows
