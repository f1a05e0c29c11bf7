"""What a run shows and records each step: the progress bar, ``metrics.jsonl`` (and TensorBoard / W&B), tokens/s,
peak memory, and at the end a loss-curve plot. One object so that every recipe logs the same keys the same way."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mtune.training.distributed import all_reduce
from mtune.training.loop import StepResult
from mtune.training.observe.memory_stats import peak_memory_stats
from mtune.training.observe.flops import utilization
from mtune.training.observe.metric_logging import METRICS_FILENAME, build_metric_logger
from mtune.training.observe.peak_flops import PeakFlops
from mtune.training.observe.plots import plot_loss_curve
from mtune.training.observe.step_timer import StepTimer
from mtune.training.observe.progress import TrainingProgress

__all__ = ["TrainingMonitor"]

log = logging.getLogger(__name__)


class TrainingMonitor:
    """Log a step: ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``, ``tokens_per_second`` (all ranks),
    ``tokens_per_second_per_device``, ``trained_tokens``, ``peak_memory_gib`` (max over ranks), ``val_loss``;
    ``peak_tensor_gib`` and ``peak_host_tensor_gib`` (max over ranks) when the session tracks live tensor bytes; and
    ``mfu`` / ``hfu`` when steps come with their FLOPs and the device's ``peak`` is known: the interval's FLOPs per
    token (model, or with recomputation) times ``tokens_per_second_per_device`` over the peak.

    Every rank must call :meth:`step` (tokens and memory are reduced over ranks); only rank 0 writes. A row is
    written every ``log_every_n_steps`` steps and for the run's last step (``total_steps``). A run that ends
    earlier (a signal stopped it) gets its last step written by :meth:`close`, which runs no collective: on more
    than one rank that row has this rank's peak memory left out rather than a maximum over ranks.
    """

    def __init__(self, *, output_dir: Path, device: torch.device, total_steps: int, initial_step: int = 0,
                 log_every_n_steps: int = 1, metric_logger: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, rank: int = 0, world_size: int = 1,
                 peak: PeakFlops | None = None):
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
        # --- utilization (mfu / hfu): FLOPs and tokens of the logging interval, and of the run after its first step
        self.peak = peak
        self._interval = [0.0, 0.0, 0]  # model FLOPs, hardware FLOPs, tokens (all ranks)
        self._run = [0.0, 0.0, 0]
        self._run_start: float | None = None
        self._run_end = 0.0
        self._run_steps = 0
        self._first_started: float | None = None
        self.first_step_s: float | None = None
        """Seconds the first step of this process took (compilation and warm-up included), when it was marked."""

    def _utilization(self, totals, tokens_per_second_per_device: float) -> dict[str, float]:
        model_flops, hardware_flops, tokens = totals
        if self.peak is None or not tokens or not model_flops:
            return {}
        return {"mfu": utilization(model_flops / tokens, tokens_per_second_per_device, self.peak.flops),
                "hfu": utilization(hardware_flops / tokens, tokens_per_second_per_device, self.peak.flops)}

    def _count_flops(self, flops: tuple[float, float] | None, tokens: int) -> None:
        if flops is not None:
            flops = tuple(self._reduce(f, torch.distributed.ReduceOp.SUM) for f in flops)
        for totals in (self._interval, self._run) if self._run_start is not None else (self._interval,):
            if flops is not None:
                totals[0] += flops[0]
                totals[1] += flops[1]
            totals[2] += tokens

    def summary(self) -> dict[str, float]:
        """Throughput of the run after its first step (which includes warm-up and compilation): tokens/s of all
        ranks, per device, and ``mfu`` / ``hfu`` when known; empty before the second step."""
        if self._run_start is None or not self._run_steps:
            return {}
        elapsed = self._run_end - self._run_start
        tps = self._run[2] / elapsed if elapsed > 0 else 0.0
        out = {"steps": self._run_steps, "tokens_per_second": tps, "tokens_per_second_per_device": tps / self.world_size}
        if self.first_step_s is not None:
            out["first_step_s"] = self.first_step_s
        return {**out, **self._utilization(self._run, tps / self.world_size)}

    def summary_line(self) -> str | None:
        """The end-of-run line: tokens/s, MFU and HFU (with the peak they are measured against)."""
        summary = self.summary()
        if not summary:
            return None
        first = f": it took {summary['first_step_s']:.1f} s" if "first_step_s" in summary else ""
        line = (f"throughput over the last {summary['steps']} steps (the first excluded{first}): "
                f"{summary['tokens_per_second']:.1f} tokens/s")
        if self.world_size > 1:
            line += f" ({summary['tokens_per_second_per_device']:.1f} per device)"
        if "mfu" in summary:
            line += f", mfu {summary['mfu']:.1%}, hfu {summary['hfu']:.1%} of {self.peak}"
        return line
    # --- end utilization

    def step_started(self) -> None:
        """Mark the start of a step: the first one's time (compilation, warm-up) is stated at the end."""
        if self._run_start is None:
            self._first_started = self.timer.synchronized_clock()

    def step(self, *, step: int, epoch: int, result: StepResult, lr: float, extra: Mapping[str, Any] | None = None,
             flops: tuple[float, float] | None = None):
        """Record optimizer step ``step``; ``flops``: this rank's (model, hardware) FLOPs of it (``StepFlops``)."""
        tokens = int(self._reduce(result.num_tokens, torch.distributed.ReduceOp.SUM))
        self.timer.add_tokens(tokens)
        self._count_flops(flops, tokens)
        if self._run_start is None:
            self._run_start = self.timer.synchronized_clock()
            if self._first_started is not None:
                self.first_step_s = self._run_start - self._first_started
        else:
            self._run_steps += 1
            self._run_end = self.timer.clock()  # re-read after rates() below, which waits for the device
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
        rates = self.timer.rates()
        if self._run_steps:
            self._run_end = self.timer.clock()
        rates.update(self._utilization(self._interval, rates["tokens_per_second_per_device"]))
        self._interval = [0.0, 0.0, 0]
        metrics = self._row(step, epoch, result, lr, rates, memory, extra)
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
        metrics.update(result.metrics)
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
            memory = ({**peak_memory_stats(self.device, reset=True), **self.memory_metrics()}
                      if self.world_size == 1 else {})
            rates = self.timer.rates(end=ended)
            rates.update(self._utilization(self._interval, rates["tokens_per_second_per_device"]))
            self.logger.log_dict(self._row(step, epoch, result, lr, rates, memory, None), step=step)
            self._unlogged = None
        self.progress.close()
        self.logger.close()
        if self.rank == 0:
            png = plot_loss_curve(self.output_dir / METRICS_FILENAME, self.output_dir / "loss_curve.png")
            if png is not None:
                log.info("loss curve: %s", png)
