"""A deterministic, resumable, rank-aware data loader.

The global order of an epoch is a permutation of the dataset drawn from `seed + epoch` (or the identity when
`shuffle` is false). Global batch `k` is the `batch_size * world_size` consecutive indices starting at
`k * batch_size * world_size`; rank `r` takes its `r`-th slice of `batch_size`. The state is just
`(epoch, samples consumed in the global order)`, so a run can resume mid-epoch, without replaying it, on any
number of ranks.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Iterator

import torch

from mtune.data.collate import collate_padded
from mtune.data.common import DataError


class ResumableLoader:
    """Iterate batches from the saved position; see `build_dataloader`."""

    def __init__(self, dataset, batch_size: int, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, collate_fn: Callable | None = None, drop_last: bool = True):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"build_dataloader: need batch_size >= 1 and 0 <= rank < world_size, "
                            f"got batch_size={batch_size}, rank={rank}, world_size={world_size}")
        global_batch = batch_size * world_size
        if drop_last and len(dataset) < global_batch:
            raise DataError(f"the dataset has {len(dataset)} samples, fewer than one global batch of {global_batch} "
                            f"(batch_size {batch_size} x {world_size} ranks): lower batch_size or add data")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        # a dataset may say how its samples batch (preference pairs: chosen and rejected rows together)
        self.collate_fn = (collate_fn or getattr(dataset, "collate_fn", None)
                           or partial(collate_padded, pad_id=dataset.pad_id))
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's global order already handed out (all ranks together)

    def __len__(self) -> int:
        """Batches per epoch on each rank."""
        n, global_batch = len(self.dataset), self.batch_size * self.world_size
        return n // global_batch if self.drop_last else -(-n // global_batch)

    def set_epoch(self, epoch: int) -> None:
        """Move to `epoch` from its start; the current epoch keeps its position (so a resumed run can call it)."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def global_order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self) -> Iterator[Any]:
        order = self.global_order(self.epoch)
        n, global_batch = len(order), self.batch_size * self.world_size
        while self.consumed < n and not (self.drop_last and n - self.consumed < global_batch):
            start = self.consumed + self.rank * self.batch_size
            end = min(start + self.batch_size, self.consumed + global_batch, n)
            self.consumed = min(self.consumed + global_batch, n)  # counted before yielding: saved after the step
            if start < end:
                yield self.collate_fn([self.dataset[i] for i in order[start:end]])
        self.epoch, self.consumed = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "num_samples": len(self.dataset),
                "seed": self.seed, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("num_samples", len(self.dataset)), ("seed", self.seed), ("shuffle", int(self.shuffle))):
            if state[key] != mine:
                raise DataError(f"data loader state: saved with {key}={state[key]}, this run has {key}={mine}; "
                                "the sample order would differ, so resume with the same data and settings")
        self.epoch, self.consumed = state["epoch"], state["consumed"]


def build_dataloader(dataset, batch_size: int, seed: int, shuffle: bool = True, rank: int = 0, world_size: int = 1,
                     collate_fn: Callable | None = None, drop_last: bool = True) -> ResumableLoader:
    """A loader over a map-style `dataset` (single process, no workers: samples are already tokenized).

    `collate_fn` defaults to the dataset's own `collate_fn` when it has one, else `collate_padded` with its
    `pad_id`. `len(loader)` is the batches per epoch per rank. With `drop_last=False` the last global batch is
    partial and ranks past its end get no batch.
    """
    return ResumableLoader(dataset, batch_size, seed, shuffle, rank, world_size, collate_fn, drop_last)
