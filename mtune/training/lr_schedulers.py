"""Learning-rate schedules, as ``torch.optim.lr_scheduler.LambdaLR`` objects stepped once per optimizer step.

They are ``_component_``s taking the optimizer first; the recipe adds ``num_training_steps`` (epochs x steps per
epoch) where the schedule needs it::

    lr_scheduler:
      _component_: mtune.training.lr_schedulers.get_cosine_schedule_with_warmup
      num_warmup_steps: 100

The values follow the usual definitions (the same as transformers' functions of the same names), so a schedule
moves between libraries unchanged. ``state_dict()`` / ``load_state_dict()`` restore the position on resume.
"""

from __future__ import annotations

import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from mtune.config.errors import ConfigError

__all__ = ["get_cosine_schedule_with_warmup", "get_constant_schedule_with_warmup", "get_linear_schedule_with_warmup"]


def _cosine_factor(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * progress)))


def _constant_factor(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return 1.0


def _linear_factor(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return step / max(1, num_warmup_steps)
    return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))


def _check_steps(num_warmup_steps: int, num_training_steps: int | None = None) -> None:
    if num_warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.num_warmup_steps must be >= 0, got {num_warmup_steps}")
    if num_training_steps is not None and num_training_steps < 1:
        raise ConfigError(f"lr_scheduler num_training_steps must be >= 1, got {num_training_steps}")


def get_cosine_schedule_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                                    num_training_steps: int, num_cycles: float = 0.5,
                                    last_epoch: int = -1) -> LambdaLR:
    """Linear warmup from 0 to the optimizer's lr over ``num_warmup_steps``, then cosine decay to 0.

    ``num_cycles=0.5`` is half a cosine period (lr reaches 0 at ``num_training_steps``).
    """
    _check_steps(num_warmup_steps, num_training_steps)
    factor = functools.partial(_cosine_factor, num_warmup_steps=num_warmup_steps,
                               num_training_steps=num_training_steps, num_cycles=num_cycles)
    return LambdaLR(optimizer, factor, last_epoch=last_epoch)


def get_constant_schedule_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int = 0,
                                      num_training_steps: int | None = None, last_epoch: int = -1) -> LambdaLR:
    """Linear warmup over ``num_warmup_steps``, then the optimizer's lr. ``num_training_steps`` is accepted and
    ignored so a recipe can pass it to any schedule."""
    del num_training_steps
    _check_steps(num_warmup_steps)
    return LambdaLR(optimizer, functools.partial(_constant_factor, num_warmup_steps=num_warmup_steps),
                    last_epoch=last_epoch)


def get_linear_schedule_with_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                                    num_training_steps: int, last_epoch: int = -1) -> LambdaLR:
    """Linear warmup over ``num_warmup_steps``, then linear decay to 0 at ``num_training_steps``."""
    _check_steps(num_warmup_steps, num_training_steps)
    factor = functools.partial(_linear_factor, num_warmup_steps=num_warmup_steps,
                               num_training_steps=num_training_steps)
    return LambdaLR(optimizer, factor, last_epoch=last_epoch)
