"""Plots people would rather see than read: the loss curve of a run and its memory breakdown by category.

matplotlib is optional (the ``plots`` extra): without it each function says so once and returns None.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_loss_curve", "plot_memory_breakdown"]

log = logging.getLogger(__name__)

GIB = 1024**3


def _pyplot(what: str):
    """matplotlib.pyplot with the file-only Agg backend, or None (after saying what was not plotted)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("%s not plotted: pip install 'mtune[plots]' for matplotlib", what)
        return None
    return plt


def plot_loss_curve(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike) -> Path | None:
    """Plot ``loss`` (and ``val_loss`` where present) against ``step`` from a ``metrics.jsonl`` into ``out_png``.

    Returns the PNG path, or None (with a message naming the ``plots`` extra) when matplotlib is not installed.
    """
    plt = _pyplot("loss curve")
    if plt is None:
        return None
    series: dict[str, tuple[list[int], list[float]]] = {"loss": ([], []), "val_loss": ([], [])}
    with open(metrics_jsonl, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{metrics_jsonl}:{line_number} is not JSON ({e})") from e
            for key, (steps, values) in series.items():
                if isinstance(row.get(key), (int, float)):
                    steps.append(row["step"])
                    values.append(row[key])
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, (steps, values) in series.items():
        if steps:
            ax.plot(steps, values, marker="o" if key == "val_loss" else None, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_memory_breakdown(summary: dict[str, Any], out_png: str | os.PathLike,
                          categories: Sequence[str]) -> Path | None:
    """Stacked bars of live bytes per category (``summary["steps"]``: one dict per optimizer step with ``step`` and
    a byte count per category) into ``out_png``. Returns the PNG path, or None without matplotlib."""
    plt = _pyplot("memory breakdown (JSON written)")
    if plt is None:
        return None
    steps = summary["steps"]
    scale, unit = (GIB, "GiB") if summary["peak"]["total"] >= GIB else (1024**2, "MiB")
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(steps)
    x = [r["step"] for r in steps]
    for category in categories:
        heights = [r[category] / scale for r in steps]
        ax.bar(x, heights, bottom=bottom, label=category.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"live tensors ({unit})")
    ax.set_xticks(x)
    ax.set_title("Memory by category")
    ax.legend()
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png
