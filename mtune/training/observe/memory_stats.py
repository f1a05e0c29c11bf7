"""The allocator's or the process's peak memory, for ``peak_memory_gib`` in ``metrics.jsonl``; and what autograd
saves for backward during a step (the GPU suite's rows, the activation tests)."""

from __future__ import annotations

import resource
import sys

import torch

from mtune.units import GIB

__all__ = ["peak_memory_stats", "saved_for_backward_bytes"]


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


def saved_for_backward_bytes(step, module: torch.nn.Module, groups: dict | None = None) -> int:
    """Bytes of the distinct storages autograd saves for backward during one ``step()``, ``module``'s parameters
    and buffers (NF4 codes and scales too) left out: the activations a step holds. A checkpointed block saves its
    input here and the rest under its own hooks, so with block checkpointing this is about one hidden state per
    block; a compiled block saves what its partitioner keeps. ``groups``, when given, is filled with
    ``{"[shape] dtype": [storages, bytes]}`` of the same storages, by the first tensor saved in each (what a block
    keeps that it should recompute shows here by shape)."""
    def storages(t) -> list[tuple[int, int, torch.Tensor]]:  # (data pointer, bytes, tensor) of t or a subclass's parts
        if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            return [part for name in t.__tensor_flatten__()[0] for part in storages(getattr(t, name))]
        return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes(), t)]

    owned = {ptr for t in [*module.parameters(), *module.buffers()] for ptr, _, _ in storages(t.data)}
    seen: dict[int, tuple[int, str]] = {}

    def pack(t):
        for ptr, nbytes, part in storages(t):
            if ptr not in owned and ptr not in seen:
                seen[ptr] = (nbytes, f"{list(part.shape)} {str(part.dtype).removeprefix('torch.')}")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    if groups is not None:
        for nbytes, key in seen.values():
            count, total = groups.get(key, (0, 0))
            groups[key] = [count + 1, total + nbytes]
    return sum(nbytes for nbytes, _ in seen.values())
