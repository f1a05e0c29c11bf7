"""The allocator's or the process's peak memory, for ``peak_memory_gib`` in ``metrics.jsonl``."""

from __future__ import annotations

import resource
import sys

import torch

from mtune.units import GIB

__all__ = ["peak_memory_stats"]


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
