"""The tokens/s meter behind ``tokens_per_second`` and ``tokens_per_second_per_device`` in ``metrics.jsonl``."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

__all__ = ["StepTimer"]


class StepTimer:
    """Measures tokens/s over a logging interval.

    Call :meth:`start` when the interval begins, :meth:`add_tokens` once per step with the number of non-padding
    tokens processed *on all ranks* in that step (the recipe sums them over ranks), and :meth:`rates` at logging
    time; :meth:`rates` restarts the interval.

    Args:
        world_size: number of ranks; ``tokens_per_second_per_device = tokens_per_second / world_size``.
        clock: seconds as a float; ``time.perf_counter`` by default (a fake clock in tests).
        synchronize: wait for queued CUDA work before reading the clock, so the rate covers finished work.
    """

    def __init__(self, world_size: int = 1, clock: Callable[[], float] = time.perf_counter,
                 synchronize: bool = True):
        if world_size < 1:
            raise ValueError(f"StepTimer world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._clock = clock
        self._synchronize = synchronize
        self._tokens = 0
        self._start: float | None = None

    def _now(self) -> float:
        if self._synchronize:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        return self._clock()

    def start(self) -> None:
        self._tokens = 0
        self._start = self._now()

    def add_tokens(self, num_tokens: int) -> None:
        self._tokens += int(num_tokens)

    def synchronized_clock(self) -> float:
        """The clock's reading once queued device work has finished (what :meth:`rates` measures to)."""
        return self._now()

    def clock(self) -> float:
        """The clock's reading now, without waiting for the device (to pass as ``rates(end=...)`` later)."""
        return self._clock()

    def rates(self, reset: bool = True, end: float | None = None) -> dict[str, float]:
        """``{"tokens_per_second": ..., "tokens_per_second_per_device": ...}`` since :meth:`start`.

        ``end``: a :meth:`clock` reading that closes the interval (the end of the last step counted) instead of now.
        """
        if self._start is None:
            raise RuntimeError("StepTimer.rates() called before StepTimer.start()")
        now = self._now() if end is None else end
        elapsed = now - self._start
        tps = self._tokens / elapsed if elapsed > 0 else 0.0
        if reset:
            self._tokens = 0
            self._start = now
        return {"tokens_per_second": tps, "tokens_per_second_per_device": tps / self.world_size}
