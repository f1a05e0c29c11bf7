"""Memory figures for logging (:func:`peak_memory_stats`) and an opt-in breakdown by category
(:class:`MemoryBreakdown`): where the bytes of a training step go.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mtune.training.observe.plots import plot_memory_breakdown

__all__ = ["peak_memory_stats", "MemoryBreakdown", "tensor_bytes", "tensor_storage_bytes"]

log = logging.getLogger(__name__)

GIB = 1024**3
CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations")


def peak_memory_stats(device: torch.device | str, reset: bool = True) -> dict[str, float]:
    """Peak memory since the last reset, in GiB.

    On CUDA: ``peak_memory_gib`` (allocator's allocated peak), ``peak_memory_active_gib``,
    ``peak_memory_reserved_gib``; with ``reset=True`` the peaks restart, so each log interval reports its own.
    Elsewhere: ``peak_memory_gib`` is the process's peak resident set size (``ru_maxrss``), which cannot be reset
    and covers the whole process lifetime.
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        result = {
            "peak_memory_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
            "peak_memory_active_gib": stats.get("active_bytes.all.peak", 0) / GIB,
            "peak_memory_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GIB,
        }
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return result
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024  # Linux reports KiB, macOS bytes
    return {"peak_memory_gib": rss_bytes / GIB}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements; tensor subclasses (torchao's quantized states, NF4) count their inner parts, and
    a DTensor (an FSDP2-sharded parameter, gradient or optimizer state) the local shard of this rank."""
    if isinstance(t, torch.nn.Parameter):
        t = t.data
    if _is_wrapper(t):
        return sum(tensor_bytes(part) for part in _inner_tensors(t))
    return t.numel() * t.element_size()


def _is_wrapper(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__")


def _inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors a wrapper subclass holds. ``__tensor_flatten__`` also names non-tensor parts (a DTensor's
    ``device_mesh``), which hold no tensor bytes."""
    names, _ = t.__tensor_flatten__()
    for name in names:
        part = getattr(t, name)
        if isinstance(part, torch.Tensor):
            yield part


def _storages(tensor: torch.Tensor) -> Iterator[tuple[tuple, int]]:
    """``(key, nbytes)`` of the storages behind ``tensor``. Wrapper subclasses (torchao's NF4Tensor, low-bit
    optimizer states, DTensor) are opened up to their inner tensors, whose storages hold the real bytes: a
    DTensor's local shard, which may itself be an NF4Tensor."""
    if isinstance(tensor, torch.nn.Parameter):
        tensor = tensor.data
    if _is_wrapper(tensor):
        for part in _inner_tensors(tensor):
            yield from _storages(part)
        return
    if tensor.device.type == "meta":
        return
    storage = tensor.untyped_storage()
    if storage.nbytes() > 0:
        yield (tensor.device.type, tensor.device.index, storage.data_ptr()), storage.nbytes()


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (a linear saves ``weight.t()`` for backward). FSDP2's all-gathered weights are
    parameters too, though their storages are not those of the sharded parameters the model lists."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


def tensor_storage_bytes(tensors: Iterable[torch.Tensor], exclude: set | None = None) -> tuple[int, set]:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by views counts once), skipping storage
    keys in ``exclude``. Returns ``(bytes, keys)``."""
    seen: set = set()
    total = 0
    for tensor in tensors:
        for key, nbytes in _storages(tensor):
            if key in seen or (exclude is not None and key in exclude):
                continue
            seen.add(key)
            total += nbytes
    return total, seen


def _optimizer_tensors(optimizers: Iterable[torch.optim.Optimizer]) -> Iterator[torch.Tensor]:
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield value


class MemoryBreakdown:
    """Measures live bytes by category over the first ``num_steps`` optimizer steps, then writes
    ``memory_breakdown.json`` and ``memory_breakdown.png`` into ``output_dir``.

    Categories: ``parameters`` (all, frozen included; NF4 weights by their packed inner tensors), ``buffers``,
    ``gradients``, ``optimizer_state`` (tensors in ``optimizer.state``), and ``activations`` (tensors saved for
    backward during the tracked forward, parameters excluded; the largest micro-batch counts). Each category
    counts distinct storages. Activations inside activation checkpointing / offloading regions are handled by
    those techniques' own hooks and are not seen, which is what they save.

    Use::

        breakdown = MemoryBreakdown(model, optimizer, output_dir, num_steps=3, enabled=True)
        with breakdown.track_forward():
            loss = loss_fn(model(tokens), labels)
        loss.backward()
        optimizer.step()
        breakdown.step()          # after optimizer.step(), before zero_grad()
        optimizer.zero_grad()

    ``optimizer`` may be one optimizer or a list (one per parameter with ``optimizer_in_bwd``). With
    ``enabled=False`` or on ranks other than 0 every call does nothing.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                 output_dir: str | os.PathLike, num_steps: int = 3, enabled: bool = True, rank: int = 0):
        self.model = model
        self.optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.output_dir = Path(output_dir)
        self.num_steps = num_steps
        self.enabled = enabled and rank == 0
        self.records: list[dict[str, int]] = []
        self._activation_bytes = 0

    @property
    def done(self) -> bool:
        return not self.enabled or len(self.records) >= self.num_steps

    @contextmanager
    def track_forward(self) -> Iterator[None]:
        """Count the bytes saved for backward by the forward (and loss) run inside this block."""
        if self.done:
            yield
            return
        _, param_keys = tensor_storage_bytes(self.model.parameters())
        seen: set = set()
        total = [0]

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if _is_parameter(tensor):
                return tensor
            for key, nbytes in _storages(tensor):
                if key not in seen and key not in param_keys:
                    seen.add(key)
                    total[0] += nbytes
            return tensor  # only the sizes are kept; the tensor is saved as usual

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self._activation_bytes = max(self._activation_bytes, total[0])

    def step(self) -> None:
        """Record this optimizer step; after ``num_steps`` steps write the summary and the plot."""
        if self.done:
            return
        params, param_keys = tensor_storage_bytes(self.model.parameters())
        buffers, _ = tensor_storage_bytes(self.model.buffers(), exclude=param_keys)
        grads, _ = tensor_storage_bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        optim, _ = tensor_storage_bytes(_optimizer_tensors(self.optimizers), exclude=param_keys)
        record = {"step": len(self.records) + 1, "parameters": params, "buffers": buffers, "gradients": grads,
                  "optimizer_state": optim, "activations": self._activation_bytes}
        record["total"] = sum(record[c] for c in CATEGORIES)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            record["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        self.records.append(record)
        self._activation_bytes = 0
        if len(self.records) == self.num_steps:
            self.write()

    def close(self) -> None:
        """At the end of a run: write what was recorded if the run was shorter than ``num_steps``."""
        if not self.done and self.records:
            self.write()
            self.num_steps = len(self.records)

    def summary(self) -> dict[str, Any]:
        """``{"unit": "bytes", "steps": [per-step records], "peak": {category: max over steps}, ...}``."""
        peak = {c: max((r[c] for r in self.records), default=0) for c in (*CATEGORIES, "total")}
        return {
            "unit": "bytes",
            "steps": self.records,
            "peak": peak,
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
