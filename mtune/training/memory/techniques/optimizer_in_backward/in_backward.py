"""`OptimizerInBackward`: one optimizer per parameter, stepped as soon as that parameter's gradient is accumulated
in backward (``optimizer_in_bwd``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["OptimizerInBackward"]


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps each parameter as soon as its gradient is accumulated during backward, then frees that gradient.

    One inner optimizer per parameter, stepped in a `register_post_accumulate_grad_hook`; so at most one parameter's
    gradient is alive at a time and no full set of gradients ever exists. `step()` and `zero_grad()` are no-ops.
    `param_groups` are the inner optimizers' own groups, so a torch LR scheduler built on this object sets the lr
    of every inner optimizer. Incompatible with gradient accumulation, gradient clipping and fp16 loss scaling
    (each needs all gradients before the step); the validator rejects those combinations.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], optimizer_cls: Callable, **kwargs: Any):
        named_params = list(named_params)
        self.optimizers = {name: optimizer_cls([p], **kwargs) for name, p in named_params}
        super().__init__([p for _, p in named_params], dict(lr=kwargs.get("lr", 0.0)))
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(self.optimizers[name])) for name, p in named_params
        ]

    @staticmethod
    def _make_hook(optimizer: torch.optim.Optimizer) -> Callable:
        def hook(param: torch.Tensor) -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return hook

    def step(self, closure=None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        missing = set(self.optimizers) - set(state_dict)
        if missing:
            raise ValueError(f"optimizer state lacks parameters {sorted(missing)[:3]}: the checkpoint was saved "
                             "for another model or without optimizer_in_bwd")
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])
        self.param_groups = [opt.param_groups[0] for opt in self.optimizers.values()]

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()

    def inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The per-parameter optimizers, which hold the state (`mtune.training.optimizers.inner_optimizers`)."""
        return list(self.optimizers.values())
