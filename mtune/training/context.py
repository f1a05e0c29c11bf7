"""What every recipe sets up first: logging, the device, the dtype, the seed and the output directory."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mtune.config.errors import ConfigError
from mtune.training.memory.precision import LossScaler, autocast, resolve_dtype, storage_dtype
from mtune.training.rng import set_seed

__all__ = ["RunContext", "setup_run", "resolve_device", "configure_logging"]

log = logging.getLogger(__name__)


@dataclass
class RunContext:
    """The settings of one process of a run, derived once from the config.

    Attributes:
        device: where the model trains (``cuda:<local_rank>`` in distributed CUDA runs).
        dtype_name: the config's ``dtype`` (``fp32``, ``bf16`` or ``fp16``).
        dtype: the storage dtype of the parameters (fp32 for ``fp16``, which computes under autocast).
        output_dir: where checkpoints, ``metrics.jsonl`` and plots go.
        rank, world_size: this process in a distributed run (0 and 1 on one device).
    """

    device: torch.device
    dtype_name: str
    dtype: torch.dtype
    output_dir: Path
    seed: int = 0
    rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self):
        """fp16 autocast for ``dtype=fp16``, a no-op context otherwise."""
        return autocast(self.dtype_name, self.device)

    def loss_scaler(self) -> LossScaler:
        """Dynamic loss scaling for ``dtype=fp16``; a pass-through otherwise."""
        return LossScaler(self.dtype_name, self.device)


def configure_logging(rank: int = 0) -> None:
    """INFO lines from mtune on rank 0, warnings only on the others."""
    level = logging.INFO if rank == 0 else logging.WARNING
    root = logging.getLogger("mtune")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("mtune: %(message)s"))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` is the accelerator when there is one (CUDA first), else the CPU; a named device must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={name}: this machine has no CUDA GPU (or torch is a CPU build): set device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"device={name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


def setup_run(cfg, rank: int = 0, world_size: int = 1) -> RunContext:
    """From a config with its defaults filled in (``device``, ``dtype``, ``seed``, ``output_dir``): configure logging, resolve device and dtype (one clear error when the device cannot do it), seed every RNG
    and create ``output_dir``."""
    configure_logging(rank)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(cfg.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype_name = cfg.dtype
    resolve_dtype(dtype_name, device)  # raises when the device cannot compute in it
    seed = cfg.seed
    set_seed(seed)
    output_dir = Path(cfg.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    run = RunContext(device=device, dtype_name=dtype_name, dtype=storage_dtype(dtype_name), output_dir=output_dir,
              seed=seed, rank=rank, world_size=world_size)
    log.info("device %s, dtype %s, seed %d, output_dir %s", device, dtype_name, seed, output_dir)
    return run
