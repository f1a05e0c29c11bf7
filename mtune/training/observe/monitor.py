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
    ``tokens_per_second_per_device``, ``trained_tokens``, ``peak_memory_gib`` (max over ranks), ``val_loss``.

    Every rank must call :meth:`step` (tokens and memory are reduced over ranks); only rank 0 writes.
    """

    def __init__(self, *, output_dir: Path, device: torch.device, total_steps: int, initial_step: int = 0,
                 log_every_n_steps: int = 1, metric_logger: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, rank: int = 0, world_size: int = 1):
        self.output_dir, self.device, self.rank, self.world_size = Path(output_dir), device, rank, world_size
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

    def step(self, *, step: int, epoch: int, result: StepResult, lr: float, extra: Mapping[str, Any] | None = None):
        self.timer.add_tokens(int(self._reduce(result.num_tokens, torch.distributed.ReduceOp.SUM)))
        if not result.stepped:
            self.skipped_steps += 1
        if step % self.log_every_n_steps and not extra:
            self.progress.update(step)
            return
        memory = peak_memory_stats(self.device, reset=True)
        if self.world_size > 1:
            memory = {k: self._reduce(v, torch.distributed.ReduceOp.MAX) for k, v in memory.items()}
        metrics = {"step": step, "epoch": epoch, "loss": result.loss, "lr": lr,
                   "trained_tokens": result.trained_tokens, **self.timer.rates(), **memory}
        if result.grad_norm is not None:
            metrics["grad_norm"] = result.grad_norm
        if not result.stepped:
            metrics["skipped_step"] = 1
        metrics.update(extra or {})
        self.logger.log_dict(metrics, step=step)
        self.progress.update(step, metrics, epoch=epoch)

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

    def close(self) -> None:
        self.progress.close()
        self.logger.close()
        if self.rank == 0:
            png = plot_loss_curve(self.output_dir / METRICS_FILENAME, self.output_dir / "loss_curve.png")
            if png is not None:
                log.info("loss curve: %s", png)
