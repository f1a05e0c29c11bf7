"""Several datasets in one: concatenated, or drawn by weight."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from mtune.data.common import DataError, is_main_process, log


class MixtureDataset(torch.utils.data.Dataset):
    """`ds[i]` is sample `sample_index[i]` of dataset `source_index[i]`; `sources` are the mixed datasets."""

    def __init__(self, sources: list, source_index: list[int], sample_index: list[int]):
        self.sources, self.source_index, self.sample_index = sources, source_index, sample_index
        self.pad_id = sources[0].pad_id
        self.packed = getattr(sources[0], "packed", False)

    def __len__(self) -> int:
        return len(self.source_index)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.sources[self.source_index[i]][self.sample_index[i]]


def mixture_dataset(
    tokenizer,
    datasets: Sequence[Any],
    weights: Sequence[float] | None = None,
    num_samples: int | None = None,
    seed: int = 0,
) -> MixtureDataset:
    """Mix `datasets` (built datasets, or config nodes with a `_component_`, built here with `tokenizer`).

    Without `weights` they are concatenated. With `weights`, an epoch holds `num_samples` samples (default: the
    sum of the datasets' sizes), of which dataset i gives `weights[i] / sum(weights)` (rounded, exact to one
    sample): fewer than it has are a seeded random subset, more repeat it (each pass a fresh permutation). All
    datasets must share packing (samples are packs when packed) and the tokenizer's pad id.
    """
    if weights is not None and not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise DataError(f"mixture_dataset: weights must be numbers, got {list(weights)}")
    if num_samples is not None:
        if weights is None:  # concatenation takes every sample once: a count has nothing to apportion
            raise DataError(f"mixture_dataset: num_samples={num_samples} needs weights (without them the datasets are "
                            "concatenated whole); set weights, or num_samples=null")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise DataError(f"mixture_dataset: num_samples must be a whole number of samples >= 1, got "
                            f"{num_samples!r} (null: the datasets' total)")
    sources = [_build(node, tokenizer) for node in datasets]
    if not sources:
        raise DataError("mixture_dataset: datasets is empty")
    if len({getattr(d, "packed", False) for d in sources}) > 1:
        raise DataError("mixture_dataset: mix packed and unpacked datasets: set the same packed: on all of them")
    if weights is None:
        source_index = [i for i, d in enumerate(sources) for _ in range(len(d))]
        sample_index = [j for d in sources for j in range(len(d))]
    else:
        if len(weights) != len(sources) or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(
                f"mixture_dataset: weights must be {len(sources)} non-negative numbers, got {list(weights)}"
            )
        total = sum(len(d) for d in sources) if num_samples is None else num_samples
        counts = _apportion(total, weights)
        generator = torch.Generator().manual_seed(seed)
        source_index, sample_index = [], []
        for i, (d, count) in enumerate(zip(sources, counts)):
            picks: list[int] = []
            while len(picks) < count:
                picks += torch.randperm(len(d), generator=generator).tolist()
            source_index += [i] * count
            sample_index += picks[:count]
    mixture = MixtureDataset(sources, source_index, sample_index)
    if is_main_process():
        shares = [source_index.count(i) for i in range(len(sources))]
        log.info("mixture: %d samples per epoch from %s", len(mixture),
                 ", ".join(f"dataset {i}: {c} ({100 * c / len(mixture):.1f}%)" for i, c in enumerate(shares)))
    return mixture


def _apportion(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` in proportion to `weights` (largest remainders), so the counts sum to `total`."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _build(node: Any, tokenizer):
    if not isinstance(node, Mapping) and not hasattr(node, "keys"):
        return node  # an already built dataset
    if "_component_" not in node:
        raise DataError(f"mixture_dataset: each entry of datasets needs a _component_, got keys {sorted(node)}")
    from mtune.config import instantiate

    return instantiate(dict(node), tokenizer=tokenizer)


# instantiate() hands `datasets` over unbuilt: each entry needs the tokenizer, which only this function has.
mixture_dataset.__instantiate_raw__ = ("datasets",)
