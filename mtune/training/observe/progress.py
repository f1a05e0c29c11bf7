"""The training progress display: a tqdm bar on a terminal, plain step lines everywhere else.

Only rank 0 shows anything. A bar needs a terminal that says how wide it is: when the output stream is not a TTY (a
log file, a CI job, ``nohup``, a pipe) a bar would fill the file with carriage returns, and a terminal reporting
0 rows x 0 columns (some containers, serial consoles, IDE panes) leaves tqdm nothing to draw in. In both cases
:class:`TrainingProgress` prints one plain line every ``log_every_n_steps`` steps instead.

While the bar is up, the ``mtune`` logger's console handlers write through it (``tqdm.write``), so a log line
appears once, whole, above the bar; side tasks such as evaluations get a short-lived bar of their own
(:meth:`TrainingProgress.activity`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TextIO, TypeVar

__all__ = ["Activity", "TrainingProgress", "format_metrics", "bar_fits"]

T = TypeVar("T")

# Shown in this order, with these short names; other keys are left to the metric logger.
_SHOWN = (
    ("loss", "loss", "{:.4f}"),
    ("val_loss", "val_loss", "{:.4f}"),
    ("rewards/accuracies", "reward_acc", "{:.2f}"),  # preference recipes
    ("rewards/margins", "margin", "{:.3f}"),
    ("lr", "lr", "{:.2e}"),
    ("grad_norm", "grad_norm", "{:.3f}"),
    ("tokens_per_second", "tok/s", "{:.0f}"),
    ("mfu", "mfu", "{:.1%}"),
    ("hfu", "hfu", "{:.1%}"),
    ("peak_memory_gib", "peak_mem", "{:.2f}GiB"),
)
# How often an activity bar redraws while nothing advances it (its elapsed time keeps moving).
_REFRESH_SECONDS = 1.0


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


def bar_fits(stream: TextIO) -> bool:
    """True when ``stream`` is a terminal that reports a size of at least one row and one column."""
    try:
        if not stream.isatty():
            return False
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return size.columns > 0 and size.lines > 0


class _WriteAboveBar(logging.StreamHandler):
    """Stands in for a console handler while a bar is up: each record goes through ``tqdm.write``, which clears the
    bar, prints the line and redraws the bar below it."""

    def __init__(self, replaced: logging.StreamHandler):
        super().__init__(replaced.stream)
        self.setLevel(replaced.level)
        self.setFormatter(replaced.formatter)
        for record_filter in replaced.filters:
            self.addFilter(record_filter)

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _logging_through_bar(stream: TextIO) -> Iterator[None]:
    """Route the ``mtune`` logger's console handlers (those writing to ``stream``, stdout or stderr) through tqdm.

    tqdm's own ``logging_redirect_tqdm`` is close, but it adds a handler even to a logger that has none (whose
    records already reach the root logger, which would print them twice) and only recognises handlers bound to the
    current ``sys.stderr`` object; this one replaces exactly the handlers that write to the terminal.
    """
    logger = logging.getLogger("mtune")
    original = list(logger.handlers)
    consoles = (stream, sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    logger.handlers = [
        _WriteAboveBar(h) if type(h) is logging.StreamHandler and any(h.stream is s for s in consoles) else h
        for h in original
    ]
    try:
        yield
    finally:
        logger.handlers = original


class Activity:
    """A side task in progress (see :meth:`TrainingProgress.activity`): ``advance`` counts done units,
    ``count(iterable)`` advances once per item it yields, ``seconds`` is the time since it started."""

    def __init__(self, bar):
        self._bar = bar
        self._start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self._start

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def count(self, items: Iterable[T]) -> Iterator[T]:
        for item in items:
            yield item
            self.advance()


class TrainingProgress:
    """Progress of optimizer steps.

    Args:
        total_steps: the number of optimizer steps of the whole run (all epochs).
        initial_step: steps already done (a resumed run starts its bar there).
        rank: ranks other than 0 display nothing.
        log_every_n_steps: how often a plain line is printed when there is no bar.
        stream: where to write (stderr by default, like tqdm).
        use_bar: force the bar on (True) or off (False); None: a bar when :func:`bar_fits` the stream.

    Use as ``progress.update(step, metrics)`` after each optimizer step (``metrics`` may be the last logged dict),
    and ``progress.close()`` at the end (or as a context manager).
    """

    def __init__(self, total_steps: int, initial_step: int = 0, rank: int = 0, log_every_n_steps: int = 1,
                 stream: TextIO | None = None, use_bar: bool | None = None):
        self.total_steps = int(total_steps)
        self.log_every_n_steps = max(1, int(log_every_n_steps))
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = rank == 0
        self._bar = None
        self._logging = contextlib.ExitStack()
        if self._enabled and (bar_fits(self._stream) if use_bar is None else use_bar):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=int(initial_step), file=self._stream,
                             dynamic_ncols=True, desc="train")
            self._logging.enter_context(_logging_through_bar(self._stream))
        self._last_step = int(initial_step)

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def update(self, step: int, metrics: Mapping[str, Any] | None = None, epoch: int | None = None) -> None:
        """Advance to optimizer step ``step`` (global, 1-based after the first step) and show ``metrics``; ``epoch`` is
        0-based (as in ``metrics.jsonl``) and shown 1-based."""
        if not self._enabled:
            return
        advanced = int(step) - self._last_step
        self._last_step = int(step)
        shown = format_metrics(metrics or {})
        if self._bar is not None:
            if epoch is not None:
                self._bar.set_description(f"train epoch {epoch + 1}")  # 0-based in metrics.jsonl, 1-based here
            if shown:
                self._bar.set_postfix(shown, refresh=False)
            self._bar.update(max(advanced, 0))
        elif step % self.log_every_n_steps == 0 or step == self.total_steps:
            parts = [f"step {step}/{self.total_steps}"]
            if epoch is not None:
                parts.append(f"epoch {epoch + 1}")  # 0-based in metrics.jsonl, 1-based for people
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

    @contextlib.contextmanager
    def activity(self, description: str, total: int | None = None, unit: str = "it") -> Iterator["Activity"]:
        """Show a side task (an evaluation) while it runs; yields an :class:`Activity` to count its ``total`` units.

        Under the training bar it is a second bar, removed when the task ends and redrawn every second, so that its
        elapsed time moves even when nothing advances it. Without a bar it is one line printed when the task
        starts, ``{description}: {total} {unit} ...`` (the caller prints the result).
        """
        if not self._enabled:
            yield Activity(None)
            return
        if self._bar is None:
            count = f": {total} {unit}" if total else ""
            print(f"{description}{count} ...", file=self._stream, flush=True)
            yield Activity(None)
            return
        from tqdm import tqdm

        bar = tqdm(total=total, desc=description, unit=unit, file=self._stream, leave=False, dynamic_ncols=True,
                   bar_format=None if total else "{desc} [{elapsed}]")
        stop = threading.Event()

        def redraw():
            while not stop.wait(_REFRESH_SECONDS):
                bar.refresh()

        ticker = threading.Thread(target=redraw, name="mtune-progress", daemon=True)
        ticker.start()
        try:
            yield Activity(bar)
        finally:
            stop.set()
            ticker.join()
            bar.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._logging.close()

    def __enter__(self) -> "TrainingProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
