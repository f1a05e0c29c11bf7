"""Stopping a run cleanly on SIGTERM / SIGINT (a cluster's preemption notice, Ctrl-C).

Inside ``with GracefulStop() as stop:`` the first SIGTERM or SIGINT only sets ``stop.requested``; the recipe checks
it after each optimizer step, writes a checkpoint and returns, so the process exits 0 and the run resumes with
``resume_from_checkpoint=true``. Work that can be dropped, an evaluation, runs inside ``stop.interrupting(what)``:
there the first signal of a single-process run also raises :class:`StopDuringEvaluation` at once, so nobody waits a
minute for scores that will be thrown away (ranks of a distributed run finish it: they must leave its collectives
together). A second SIGINT (Ctrl-C twice) raises ``KeyboardInterrupt`` at once. The previous handlers are restored
when the block ends.

This module does not import torch at module level.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["GracefulStop", "StopDuringEvaluation"]


class StopDuringEvaluation(KeyboardInterrupt):
    """A stop signal arrived during work :meth:`GracefulStop.interrupting` marks as droppable. A KeyboardInterrupt,
    so whatever does not catch it ends as Ctrl-C does."""


class GracefulStop:
    """Context manager turning SIGTERM/SIGINT into a stop request.

    Args:
        signals: the signals to catch (SIGTERM and SIGINT by default).
        rank: only rank 0 prints the notice.
        world_size: the run's processes; with more than one, :meth:`interrupting` does not interrupt.

    Signal handlers can only be installed from the main thread; elsewhere the context does nothing (and says so).
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT), rank: int = 0,
                 world_size: int = 1):
        self.signals = tuple(signals)
        self.rank = rank
        self.world_size = world_size
        self.requested = False
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._droppable: str | None = None  # what runs inside interrupting(), if anything

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.requested:
            if sig == signal.SIGINT:
                raise KeyboardInterrupt
            return  # a repeated SIGTERM changes nothing: we are already stopping
        self.requested = True
        self.received = sig
        drop = self._droppable is not None and self.world_size == 1
        if self.rank == 0:
            doing = (f"stopping the {self._droppable}, then the run, saving what it trained" if drop else
                     f"finishing the {self._droppable}, then the run, saving what it trained" if self._droppable
                     else "finishing the current step, saving a checkpoint")
            print(f"Received {sig.name}: {doing}, then exiting (press Ctrl-C again to stop at once).",
                  file=sys.stderr, flush=True)
        if drop:
            raise StopDuringEvaluation(self._droppable)

    @contextlib.contextmanager
    def interrupting(self, what: str) -> Iterator[None]:
        """Mark ``what`` (an evaluation, by name) as droppable: a first stop signal inside raises
        :class:`StopDuringEvaluation` in a single-process run; a signal that came before it raises at its start."""
        if self.requested and self.world_size == 1:
            raise StopDuringEvaluation(what)
        self._droppable = what
        try:
            yield
        finally:
            self._droppable = None

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is not threading.main_thread():
            print("GracefulStop: not in the main thread, signals keep their default behaviour.", file=sys.stderr)
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def requested_on_any_rank(self) -> bool:
        """True if any rank got a stop signal (an all-reduce; call it on every rank at the same point of the
        step). Without an initialised process group this is :attr:`requested`."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        device = "cpu"
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        flag = torch.tensor([1 if self.requested else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
