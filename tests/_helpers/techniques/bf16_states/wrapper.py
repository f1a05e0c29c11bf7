"""An optimizer whose floating-point states wait in bf16 between steps and are stepped in fp32, one parameter at a
time (so the fp32 states of one parameter exist at once, not of all)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Bf16StateOptimizer"]


def _store(optimizer: torch.optim.Optimizer, dtype: torch.dtype) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                state[key] = value.to(dtype)


class Bf16StateOptimizer(torch.optim.Optimizer):
    """One ``optimizer_cls`` per parameter, its states allocated now by ``allocate`` and stored as bf16; each
    ``step()`` upcasts one parameter's states to fp32, steps it and stores them as bf16 again. ``param_groups`` are
    the inner optimizers' own (an LR scheduler sets every one); their states are what a checkpoint saves."""

    def __init__(self, named_params: list, optimizer_cls: Callable, allocate: Callable, **kwargs: Any):
        self.optimizers = {name: optimizer_cls([p], **kwargs) for name, p in named_params}
        super().__init__([p for _, p in named_params], {"lr": kwargs.get("lr", 0.0)})
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]
        for optimizer in self.optimizers.values():
            allocate(optimizer)
            _store(optimizer, torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for optimizer in self.optimizers.values():
            _store(optimizer, torch.float32)
            optimizer.step()
            _store(optimizer, torch.bfloat16)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none)

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizers.values())

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state_dict[name])
            _store(optimizer, torch.bfloat16)  # AdamW loads its states in the parameter's dtype
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]
