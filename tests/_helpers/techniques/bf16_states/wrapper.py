"""An optimizer whose floating-point states wait in bf16 between steps and are stepped in fp32."""

from __future__ import annotations

import torch

__all__ = ["Bf16StateOptimizer"]


class Bf16StateOptimizer(torch.optim.Optimizer):
    """Wraps ``inner`` (built and allocated by the caller): after every step (and now) its floating-point state
    tensors are stored as bf16; before a step they are upcast to fp32. ``param_groups`` and ``state`` are the inner
    optimizer's, so an LR scheduler and the checkpoint see it (`inner_optimizers`)."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        super().__init__([p for group in inner.param_groups for p in group["params"]], {"lr": 0.0})
        self.param_groups, self.state = inner.param_groups, inner.state
        self._store(torch.bfloat16)

    def _store(self, dtype: torch.dtype) -> None:
        for state in self.inner.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    state[key] = value.to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        self._store(torch.float32)
        loss = self.inner.step(closure)
        self._store(torch.bfloat16)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.inner]

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
        self._store(torch.bfloat16)
