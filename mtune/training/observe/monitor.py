"""What a run shows and records each step: the progress bar, ``metrics.jsonl`` (and TensorBoard / W&B), tokens/s,
peak memory, and at the end a loss-curve plot. One object so that every recipe logs the same keys the same way."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mtune.training.loop import StepResult, all_reduce
from mtune.training.memory.accounting import peak_memory_stats
from mtune.training.observe.metric_logging import METRICS_FILENAME, build_metric_logger
from mtune.training.observe.plots import plot_loss_curve
from mtune.training.observe.step_timer import StepTimer
from mtune.training.observe.progress import TrainingProgress

__all__ = ["TrainingMonitor"]

log = logging.getLogger(__name__)


class TrainingMonitor:
    """Log a step: ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_second`` (all ranks),
    ``tokens_per_second_per_device``, ``trained_tokens``, ``peak_memory_gib`` (max over ranks), ``val_loss``; ``peak_tensor_gib`` and
    ``peak_host_tensor_gib`` (max over ranks) when the session tracks live tensor bytes.

    Every rank must call :meth:`step` (tokens and memory are reduced over ranks); only rank 0 writes. A row is
    written every ``log_every_n_steps`` steps and for the run's last step (``total_steps``). A run that ends
    earlier (a signal stopped it) gets its last step written by :meth:`close`, which runs no collective: on more
    than one rank that row has this rank's peak memory left out rather than a maximum over ranks.
    """

    def __init__(self, *, output_dir: Path, device: torch.device, total_steps: int, initial_step: int = 0,
                 log_every_n_steps: int = 1, metric_logger: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, rank: int = 0, world_size: int = 1):
        self.output_dir, self.device, self.rank, self.world_size = Path(output_dir), device, rank, world_size
        self.total_steps = int(total_steps)
        self.log_every_n_steps = max(1, int(log_every_n_steps or 1))
        self.logger = build_metric_logger(metric_logger, output_dir=output_dir, rank=rank, world_size=world_size)
        if config is not None:
            self.logger.log_config(config)
        self.progress = TrainingProgress(total_steps, initial_step=initial_step, rank=rank,
                                         log_every_n_steps=self.log_every_n_steps)
        self.timer = StepTimer(world_size=world_size)
        self.timer.start()
        peak_memory_stats(device, reset=True)
        self.skipped_steps = 0
        # Live tensor-byte peaks since the last row (peak_tensor_gib, peak_host_tensor_gib); the session sets it.
        self.memory_metrics = dict
        # The last step when it was not logged: (step, epoch, result, lr, clock reading at its end).
        self._unlogged: tuple[int, int, StepResult, float, float] | None = None
        self._closed = False

    def step(self, *, step: int, epoch: int, result: StepResult, lr: float, extra: Mapping[str, Any] | None = None):
        self.timer.add_tokens(int(self._reduce(result.num_tokens, torch.distributed.ReduceOp.SUM)))
        if not result.stepped:
            self.skipped_steps += 1
        if step % self.log_every_n_steps and step != self.total_steps and not extra:
            self._unlogged = (step, epoch, result, lr, self.timer.clock())
            self.progress.update(step)
            return
        self._unlogged = None
        memory = {**peak_memory_stats(self.device, reset=True), **self.memory_metrics()}
        if self.world_size > 1:
            memory = {k: self._reduce(v, torch.distributed.ReduceOp.MAX) for k, v in memory.items()}
        metrics = self._row(step, epoch, result, lr, self.timer.rates(), memory, extra)
        self.logger.log_dict(metrics, step=step)
        self.progress.update(step, metrics, epoch=epoch)

    @staticmethod
    def _row(step, epoch, result: StepResult, lr, rates, memory, extra) -> dict[str, Any]:
        metrics = {"step": step, "epoch": epoch, "loss": result.loss, "lr": lr,
                   "trained_tokens": result.trained_tokens, **rates, **memory}
        if result.grad_norm is not None:
            metrics["grad_norm"] = result.grad_norm
        if not result.stepped:
            metrics["skipped_step"] = 1
        metrics.update(extra or {})
        return metrics

    def _reduce(self, value: float, op) -> float:
        if self.world_size == 1:
            return value
        return float(all_reduce(torch.tensor(float(value), dtype=torch.float64, device=self.device), op).item())

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Extra values for a step (e.g. ``val_loss``) in their own row."""
        self.logger.log_dict({"step": step, **metrics}, step=step)
        self.progress.write("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in metrics.items()))

    def write(self, message: str) -> None:
        self.progress.write(message)

    def activity(self, description: str, total: int | None = None, unit: str = "it"):
        """A side task's own progress (an evaluation): see :meth:`TrainingProgress.activity`."""
        return self.progress.activity(description, total=total, unit=unit)

    def close(self) -> None:
        """Write the last step if it was not logged, close the display and the loggers, plot the loss curve.
        Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._unlogged is not None:
            step, epoch, result, lr, ended = self._unlogged
            memory = {**peak_memory_stats(self.device, reset=True), **self.memory_metrics()} if self.world_size == 1 else {}
            self.logger.log_dict(self._row(step, epoch, result, lr, self.timer.rates(end=ended), memory, None),
                                 step=step)
            self._unlogged = None
        self.progress.close()
        self.logger.close()
        if self.rank == 0:
            png = plot_loss_curve(self.output_dir / METRICS_FILENAME, self.output_dir / "loss_curve.png")
            if png is not None:
                log.info("loss curve: %s", png)
