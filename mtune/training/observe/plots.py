"""Plots people would rather see than read: the loss curve of a run and its memory breakdown by category.

matplotlib is one of mtune's dependencies; should it be missing anyway (a trimmed environment), each function says
so and returns None. A loss curve with no loss to draw is not plotted at all.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtune.units import GIB, MIB

__all__ = ["plot_loss_curve", "plot_memory_breakdown", "plot_memory_plan"]

log = logging.getLogger(__name__)


def _pyplot(what: str):
    """matplotlib.pyplot with the file-only Agg backend, or None (after saying what was not plotted)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("%s not plotted: matplotlib is not installed (mtune depends on it: pip install matplotlib)", what)
        return None
    return plt


def plot_loss_curve(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike) -> Path | None:
    """Plot ``loss`` (and ``val_loss`` where present) against ``step`` from a ``metrics.jsonl`` into ``out_png``.

    Returns the PNG path, or None when there is nothing to plot (no file, or no row with a loss) or matplotlib is
    missing. Short series get a marker on each point, so that a single logged step is still visible.
    """
    series = _loss_series(metrics_jsonl)
    if not any(steps for steps, _ in series.values()):
        log.debug("loss curve not plotted: %s has no loss values", metrics_jsonl)
        return None
    plt = _pyplot("loss curve")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, (steps, values) in series.items():
        if steps:
            marker = "o" if key == "val_loss" or len(steps) <= 20 else None
            ax.plot(steps, values, marker=marker, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def _loss_series(metrics_jsonl: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """``{"loss": (steps, values), "val_loss": (steps, values)}`` read from a ``metrics.jsonl`` (empty if absent), in
    step order. A step logged twice keeps its last row: a resumed run appends the steps after its checkpoint again,
    and the curve should not run back over the interrupted run's."""
    by_step: dict[str, dict[int, float]] = {"loss": {}, "val_loss": {}}
    if Path(metrics_jsonl).is_file():
        with open(metrics_jsonl, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{metrics_jsonl}:{line_number} is not JSON ({e})") from e
                for key, values in by_step.items():
                    if isinstance(row.get(key), (int, float)):
                        values[row["step"]] = row[key]
    return {key: (sorted(values), [values[step] for step in sorted(values)]) for key, values in by_step.items()}


def plot_memory_breakdown(summary: dict[str, Any], out_png: str | os.PathLike,
                          categories: Sequence[str]) -> Path | None:
    """Stacked bars of live bytes per category (``summary["steps"]``: one dict per optimizer step with ``step`` and
    a byte count per category) into ``out_png``. Returns the PNG path, or None without matplotlib."""
    plt = _pyplot("memory breakdown (JSON written)")
    if plt is None:
        return None
    steps = summary["steps"]
    scale, unit = (GIB, "GiB") if summary["device_peak_bytes"] >= GIB else (MIB, "MiB")
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(steps)
    x = [r["step"] for r in steps]
    for category in categories:
        heights = [r[category] / scale for r in steps]
        ax.bar(x, heights, bottom=bottom, label=category.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"live tensors at the device peak ({unit})")
    ax.set_xticks(x)
    ax.set_title("Memory by category")
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_memory_plan(at_peak: dict[str, dict[str, int]], out_png: str | os.PathLike, categories: Sequence[str], *,
                     title: str, context_bytes: int = 0, budget_bytes: int | None = None) -> Path | None:
    """``mtune plan``'s chart: one stacked bar per location (``at_peak``: ``{"device"|"host": {category: bytes}}``,
    what is live at that location's peak), the CUDA context on top of the device's, and the ``--device-memory``
    budget as a line. Returns the PNG path, or None without matplotlib."""
    plt = _pyplot("plan chart")
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5, 4))
    wheres = list(at_peak)
    bottoms = [0.0] * len(wheres)
    for category in categories:
        heights = [at_peak[where][category] / GIB for where in wheres]
        ax.bar(wheres, heights, bottom=bottoms, label=category.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    if context_bytes:
        ax.bar([wheres[0]], [context_bytes / GIB], bottom=[bottoms[0]], label="CUDA context", color="grey")
    if budget_bytes:
        ax.axhline(budget_bytes / GIB, color="red", linestyle="--", label="device memory")
    ax.set_ylabel("GiB live at the peak")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
