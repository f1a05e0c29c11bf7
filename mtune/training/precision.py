"""Training precision: the `dtype` key (`fp32 | bf16 | fp16`).

- fp32, bf16: the model is stored and computed in that dtype; no loss scaling.
- fp16: trainable parameters stay fp32, compute runs under fp16 autocast, and the loss is scaled dynamically
  (`torch.amp.GradScaler`) so small fp16 gradients do not flush to zero. A step whose gradients hold inf/NaN is
  skipped and the scale halved; `LossScaler.step` reports it. The scale is part of the recipe state.

Usage in a training step:

    scaler = LossScaler(dtype_name, device)
    with autocast(dtype_name, device):
        loss = ...
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)           # before clipping the gradient norm
    stepped = scaler.step(optimizer)     # False: inf/NaN gradients, step skipped
"""

from __future__ import annotations

import contextlib
import logging

import torch

from mtune.config.errors import ConfigError
from mtune.config.keys import DTYPE_NAMES

__all__ = ["DTYPES", "resolve_dtype", "storage_dtype", "autocast", "LossScaler"]

log = logging.getLogger(__name__)

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16)))
"""The ``dtype`` key's values as torch dtypes."""


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype for `dtype=name` on `device`, or a one-line error when the device cannot compute in it."""
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} is not supported: use one of {list(DTYPES)}")
    device = torch.device(device)
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise ConfigError(f"dtype=bf16: the GPU {torch.cuda.get_device_name(device)} has no bf16 support: "
                         "set dtype=fp16 (with loss scaling) or dtype=fp32")
    return DTYPES[name]


def storage_dtype(name: str) -> torch.dtype:
    """The dtype the model's parameters are stored in: fp16 training keeps fp32 weights (compute is autocast)."""
    return torch.float32 if name == "fp16" else DTYPES[name]


def autocast(name: str, device: torch.device | str):
    """fp16 autocast for dtype=fp16, else a no-op context (bf16/fp32 models already compute in their dtype)."""
    if name != "fp16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.float16)


class LossScaler:
    """Dynamic loss scaling for dtype=fp16; a pass-through for other dtypes (same calls, no scaling)."""

    def __init__(self, name: str, device: torch.device | str, init_scale: float = 2.0**16):
        self.enabled = name == "fp16"
        self.scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=init_scale, enabled=self.enabled)
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides the gradients by the scale in place (call once per step, before clipping)."""
        if self.enabled:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Steps the optimizer unless the gradients hold inf/NaN, updates the scale; returns whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        stepped = self.scaler.get_scale() >= before  # the scale only shrinks after inf/NaN gradients
        if not stepped:
            self.skipped_steps += 1
            log.warning("fp16: inf/NaN gradients, optimizer step skipped; loss scale %g -> %g",
                        before, self.scaler.get_scale())
        return stepped

    def get_scale(self) -> float:
        return self.scaler.get_scale() if self.enabled else 1.0

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)
