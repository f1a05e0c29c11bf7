"""The training progress display: a tqdm bar on a terminal, periodic log lines otherwise.

Only rank 0 shows anything. When the output stream is not a TTY (a log file, a CI job, ``nohup``), a bar would
write carriage-return noise, so :class:`TrainingProgress` prints one plain line every ``log_every_n_steps`` instead.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["TrainingProgress", "format_metrics"]

# Shown in this order, with these short names; other keys are left to the metric logger.
_SHOWN = (
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val_loss", "{:.4f}"),
    ("lr", "lr", "{:.2e}"),
    ("grad_norm", "grad_norm", "{:.3f}"),
    ("tokens_per_second", "tok/s", "{:.0f}"),
    ("peak_memory_gib", "peak_mem", "{:.2f}GiB"),
)


def format_metrics(metrics: Mapping[str, Any]) -> dict[str, str]:
    """The metrics the progress display shows, formatted: ``{"loss": "1.2345", "tok/s": "812", ...}``."""
    shown = {}
    for key, label, fmt in _SHOWN:
        value = metrics.get(key)
        if value is None:
            continue
        if hasattr(value, "item"):
            value = value.item()
        shown[label] = fmt.format(value)
    return shown


class TrainingProgress:
    """Progress of optimizer steps.

    Args:
        total_steps: the number of optimizer steps of the whole run (all epochs).
        initial_step: steps already done (a resumed run starts its bar there).
        rank: ranks other than 0 display nothing.
        log_every_n_steps: how often the non-TTY log line is printed.
        stream: where to write (stderr by default, like tqdm).
        use_bar: force the bar on (True) or off (False); None decides by ``stream.isatty()``.

    Use as ``progress.update(step, metrics)`` after each optimizer step (``metrics`` may be the last logged dict),
    and ``progress.close()`` at the end (or as a context manager).
    """

    def __init__(self, total_steps: int, initial_step: int = 0, rank: int = 0, log_every_n_steps: int = 1,
                 stream: TextIO | None = None, use_bar: bool | None = None):
        self.total_steps = int(total_steps)
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = rank == 0
        if use_bar is None:
            use_bar = bool(getattr(self._stream, "isatty", lambda: False)())
        self._bar = None
        if self._enabled and use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=int(initial_step), file=self._stream,
                             dynamic_ncols=True, desc="train")
        self._last_step = int(initial_step)

    def update(self, step: int, metrics: Mapping[str, Any] | None = None, epoch: int | None = None) -> None:
        """Advance to optimizer step ``step`` (global, 1-based after the first step) and show ``metrics``."""
        if not self._enabled:
            return
        advanced = int(step) - self._last_step
        self._last_step = int(step)
        shown = format_metrics(metrics or {})
        if self._bar is not None:
            if epoch is not None:
                self._bar.set_description(f"train epoch {epoch}")
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(advanced, 0))
        elif step % self.log_every_n_steps == 0 or step == self.total_steps:
            parts = [f"step {step}/{self.total_steps}"]
            if epoch is not None:
                parts.append(f"epoch {epoch}")
            parts += [f"{label} {text}" for label, text in shown.items()]
            print(" | ".join(parts), file=self._stream, flush=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar (rank 0 only)."""
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self._stream)
        else:
            print(message, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "TrainingProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
