"""The live tensor bytes by category and location of each step of a real run (:class:`MemoryBreakdown`, over
:class:`~mtune.training.planning.tracker.TensorTracker`): ``peak_tensor_gib`` / ``peak_host_tensor_gib`` in
``metrics.jsonl`` (``plan_check``) and ``memory_breakdown.json`` / ``.png`` (``memory_breakdown``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mtune.training.placement import Placement
from mtune.training.observe.plots import plot_memory_breakdown
from mtune.training.planning.tracker import CATEGORIES, LOCATIONS, StepMemory, TensorTracker
from mtune.units import GIB

__all__ = ["MemoryBreakdown", "step_record"]

log = logging.getLogger(__name__)


class MemoryBreakdown:
    """Live tensor bytes of every tracked optimizer step, by category, on the compute device and on the host.

    Wrap each whole step (forward, backward, optimizer step, ``zero_grad``) in :meth:`track_step`; the step's
    peaks are recorded when the block ends, so record *k* is step *k*. :meth:`log_metrics` gives the largest peaks
    since its last call (``peak_tensor_gib``, ``peak_host_tensor_gib``). With ``write=True``, after ``num_steps``
    steps (or at :meth:`close`, for a shorter run) ``memory_breakdown.json`` and ``memory_breakdown.png`` go to
    ``output_dir`` (rank 0): per step what was
    live at the device's peak and each category's own peak; overall ``device_peak_bytes``, ``host_peak_bytes``
    and each category's peak under ``device`` and ``host`` (the same fields as ``mtune plan --json``).

    ``optimizer`` may be one optimizer or a list (the inner ones of optimizer-in-backward). With ``enabled=False``
    every call does nothing. With ``track_all_steps=False`` only the first ``num_steps`` steps are tracked (their
    peaks are the run's once the optimizer state exists, for batches of the same length) and later steps run at
    full speed: tracking costs a Python call per op (2.4x a 1B LoRA step on an H100). With ``device_limit``
    (bytes) every step is tracked and one that holds more live bytes on the device raises torch.OutOfMemoryError.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                 output_dir: str | os.PathLike, num_steps: int = 3, enabled: bool = True, rank: int = 0,
                 write: bool = True, placement: Placement | None = None, track_all_steps: bool = True,
                 device_limit: int | None = None):
        self.model = model
        self.track_all_steps = track_all_steps or device_limit is not None  # a limit holds on every step
        optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.output_dir = Path(output_dir)
        self.num_steps = num_steps
        self.enabled = enabled
        self.write_file = write and rank == 0
        self.tracker = TensorTracker(placement, model=model, optimizers=optimizers,
                                     device_limit=device_limit) if enabled else None
        self.records: list[dict[str, Any]] = []
        self.overall: StepMemory | None = None  # every tracked step merged
        self._since_log: StepMemory | None = None
        self.tracked_steps = 0

    @contextmanager
    def track_step(self) -> Iterator[None]:
        """Track the live bytes of the block (one optimizer step) and record its peaks when it ends."""
        if not self.enabled or (not self.track_all_steps and self.tracked_steps >= self.num_steps):
            yield
            return
        self.tracked_steps += 1
        with self.tracker:
            yield
        memory = self.tracker.take_interval()
        self.overall = memory if self.overall is None else self.overall.merge(memory)
        self._since_log = memory if self._since_log is None else self._since_log.merge(memory)
        if len(self.records) < self.num_steps:
            self.records.append(step_record(len(self.records) + 1, memory))
            if len(self.records) == self.num_steps and self.write_file:
                self.write()
        if not self.track_all_steps and self.tracked_steps >= self.num_steps:
            self.tracker.remove_hooks()  # its gradient hooks would cost a Python call per parameter every step

    def discard_step(self) -> None:
        """Forget the step that just failed (an out-of-memory error that ``oom_recovery`` retries): its peak is
        not the run's, and the retry is tracked as that step."""
        if self.enabled and self.tracker is not None and self.tracked_steps:
            self.tracker.take_interval()
            self.tracked_steps -= 1

    def close(self) -> None:
        """Write the files now if the run ended before ``num_steps`` steps (nothing when none was tracked)."""
        if self.write_file and 0 < len(self.records) < self.num_steps:
            self.write()

    def log_metrics(self) -> dict[str, float]:
        """``peak_tensor_gib`` and ``peak_host_tensor_gib`` since the last call (empty when nothing was tracked)."""
        memory, self._since_log = self._since_log, None
        if memory is None:
            return {}
        return {"peak_tensor_gib": memory.peak["device"] / GIB, "peak_host_tensor_gib": memory.peak["host"] / GIB}

    def summary(self) -> dict[str, Any]:
        overall = self.overall or StepMemory()
        return {
            "unit": "bytes",
            "device_peak_bytes": overall.peak["device"],
            "host_peak_bytes": overall.peak["host"],
            "device": dict(overall.category_peak["device"]),
            "host": dict(overall.category_peak["host"]),
            "at_peak": {where: dict(overall.at_peak[where]) for where in LOCATIONS},
            "steps": self.records,
            "parameter_count": sum(p.numel() for p in self.model.parameters()),
            "trainable_parameter_count": sum(p.numel() for p in self.model.parameters() if p.requires_grad),
        }

    def write(self) -> Path:
        """Write ``memory_breakdown.json`` (and ``memory_breakdown.png`` when matplotlib is installed)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.output_dir / "memory_breakdown.json"
        summary = self.summary()
        path.write_text(json.dumps(summary, indent=2))
        plot_memory_breakdown(summary, self.output_dir / "memory_breakdown.png", CATEGORIES)
        return path


def step_record(step: int, memory: StepMemory) -> dict[str, Any]:
    """One step of ``memory_breakdown.json``: the peaks, what was live at the device's peak (top-level category
    keys, which the plot stacks) and each category's own peak per location."""
    record: dict[str, Any] = {"step": step, "device_peak_bytes": memory.peak["device"],
                              "host_peak_bytes": memory.peak["host"]}
    record.update(memory.at_peak["device"])
    record["category_peak"] = {where: dict(memory.category_peak[where]) for where in LOCATIONS}
    record["host"] = dict(memory.at_peak["host"])
    return record
