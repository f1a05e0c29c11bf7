"""Metric loggers: ``metrics.jsonl`` always, TensorBoard or Weights & Biases when the config asks.

Every run writes ``${output_dir}/metrics.jsonl`` (one JSON object per logged step). The ``metric_logger`` config
node may name one more backend by ``_component_`` (TensorBoard or Weights & Biases); it receives the same dicts.
Only rank 0 logs: :func:`build_metric_logger` returns a logger that drops everything on other ranks.

Conventional keys (docs/configs.md, "Runs"): ``step``, ``epoch``, ``loss``, ``lr``, ``grad_norm``,
``tokens_per_second`` (all devices), ``tokens_per_second_per_device``, ``trained_tokens``, ``peak_memory_gib``,
``val_loss``.

This module does not import torch at module level.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from mtune.config import call_component

METRICS_FILENAME = "metrics.jsonl"

__all__ = [
    "MetricLogger",
    "JsonlLogger",
    "TensorBoardLogger",
    "WandBLogger",
    "NullLogger",
    "MultiLogger",
    "build_metric_logger",
    "METRICS_FILENAME",
]


@runtime_checkable
class MetricLogger(Protocol):
    """What a recipe calls on a metric logger."""

    def log_dict(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (name -> number) for optimizer step ``step``."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Record the resolved run config (a plain dict) once, at the start."""

    def close(self) -> None:
        """Flush and release files / connections. Safe to call twice."""


def _to_number(value: Any) -> Any:
    """Plain Python number from a float / int / 0-d tensor / numpy scalar; non-finite floats become None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or isinstance(value, int):
        return value
    if isinstance(value, float):
        # JSON has no NaN/Infinity; null keeps the file readable by every JSON parser.
        return value if math.isfinite(value) else None
    return value


class JsonlLogger:
    """Appends one JSON object per :meth:`log_dict` call to ``${output_dir}/metrics.jsonl``, flushed at once.

    The file is opened in append mode, so a resumed run continues the same file. ``step`` is written first.
    """

    def __init__(self, output_dir: str | os.PathLike, filename: str = METRICS_FILENAME):
        self.path = Path(output_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def log_dict(self, metrics: Mapping[str, Any], step: int) -> None:
        record = {"step": int(step)}
        record.update({k: _to_number(v) for k, v in metrics.items() if k != "step"})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        # The resolved config lives in each checkpoint's mtune_state.json; the metrics file stays one row per step.
        pass

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardLogger:
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter``.

    Args:
        output_dir: the run's output directory; the default ``log_dir`` is ``${output_dir}/tensorboard``.
        log_dir: where the event files go (overrides the default).
    """

    def __init__(self, output_dir: str | os.PathLike | None = None, log_dir: str | os.PathLike | None = None,
                 **kwargs: Any):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError(
                "metric_logger TensorBoardLogger needs the tensorboard package: pip install 'mtune[tensorboard]'"
            ) from e
        if log_dir is None:
            if output_dir is None:
                raise ValueError("TensorBoardLogger needs output_dir or metric_logger.log_dir")
            log_dir = Path(output_dir) / "tensorboard"
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), **kwargs)

    def log_dict(self, metrics: Mapping[str, Any], step: int) -> None:
        for name, value in metrics.items():
            value = _to_number(value)
            if name != "step" and isinstance(value, (int, float)):
                self._writer.add_scalar(name, value, global_step=int(step))
        self._writer.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandBLogger:
    """Logs to Weights & Biases. Works offline: set ``mode: offline`` (or ``WANDB_MODE=offline``) and sync later
    with ``wandb sync``.

    Args:
        output_dir: the run's output directory; wandb's files go to ``${output_dir}/wandb`` unless ``dir`` is set.
        project, entity, group, name, mode, dir: passed to ``wandb.init``; any other keyword is passed too.
    """

    def __init__(self, output_dir: str | os.PathLike | None = None, project: str = "mtune",
                 entity: str | None = None, group: str | None = None, name: str | None = None,
                 mode: str | None = None, dir: str | os.PathLike | None = None, **kwargs: Any):
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "metric_logger WandBLogger needs the wandb package: pip install 'mtune[wandb]'"
            ) from e
        self._wandb = wandb
        if dir is None and output_dir is not None:
            dir = Path(output_dir)
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, entity=entity, group=group, name=name, mode=mode,
                               dir=None if dir is None else str(dir), **kwargs)

    @property
    def run(self):
        """The ``wandb`` run object (its ``dir`` holds the offline files)."""
        return self._run

    def log_dict(self, metrics: Mapping[str, Any], step: int) -> None:
        clean = {k: _to_number(v) for k, v in metrics.items() if k != "step"}
        self._run.log(clean, step=int(step))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._run.config.update(dict(config), allow_val_change=True)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class NullLogger:
    """Drops everything (the logger of non-zero ranks)."""

    def log_dict(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def log_config(self, config: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MultiLogger:
    """Sends each call to every logger in ``loggers``, in order."""

    def __init__(self, loggers: list[MetricLogger]):
        self.loggers = list(loggers)

    def log_dict(self, metrics: Mapping[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log_dict(metrics, step)

    def log_config(self, config: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_config(config)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def _import_component(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"metric_logger._component_: cannot import '{path}' ({e})") from e


def build_metric_logger(node: Mapping[str, Any] | None, *, output_dir: str | os.PathLike, rank: int = 0,
                        world_size: int = 1) -> MetricLogger:
    """The run's metric logger: JSONL always, plus the backend that ``node`` names.

    Args:
        node: the ``metric_logger`` config node (a dict or DictConfig) with ``_component_`` and its keyword
            arguments, or None for JSONL only. Naming ``JsonlLogger`` (or ``NullLogger``) adds nothing.
        output_dir: the run's output directory; also passed to the backend as ``output_dir``.
        rank, world_size: this process's rank; ranks other than 0 get a :class:`NullLogger`.
    """
    del world_size  # every rank passes it; only rank 0 logs
    if rank != 0:
        return NullLogger()
    loggers: list[MetricLogger] = [JsonlLogger(output_dir)]
    if node is not None:
        kwargs = {str(k): v for k, v in dict(node).items()}
        target = kwargs.pop("_component_", None)
        if target is None:
            raise ValueError("metric_logger needs a _component_, e.g. mtune.training.observe.metric_logging.TensorBoardLogger")
        component = _import_component(str(target)) if isinstance(target, str) else target
        if component not in (JsonlLogger, NullLogger):
            kwargs.setdefault("output_dir", str(output_dir))
            loggers.append(call_component(component, str(target), "metric_logger", **kwargs))
    return loggers[0] if len(loggers) == 1 else MultiLogger(loggers)
