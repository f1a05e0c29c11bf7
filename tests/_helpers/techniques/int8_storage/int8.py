"""int8 codes with an fp32 scale per output row for a frozen linear's weight, upcast around each forward."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mtune.training.memory.technique import WeightPhases

__all__ = ["mark_frozen_linears", "store_int8", "upcast_all", "is_int8", "Int8Weights"]


def mark_frozen_linears(model: nn.Module) -> None:
    """Mark every linear inside ``model.layers`` whose weight is frozen (a LoRA base) for int8 on arrival."""
    for module in model.layers.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and not weight.requires_grad:
            module.int8_pending = True


def is_int8(module: nn.Module) -> bool:
    return getattr(module, "weight_int8_scale", None) is not None


@torch.no_grad()
def store_int8(module: nn.Module) -> None:
    """``module``'s just-arrived weight as int8 codes (``round(w / scale)``, ``scale = max|w_row| / 127``)."""
    if not getattr(module, "int8_pending", False) or module.weight.is_meta:
        return
    weight = module.weight.detach()
    scale = weight.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / 127.0
    codes = torch.round(weight.float() / scale).clamp(-127, 127).to(torch.int8)
    module.compute_dtype = weight.dtype
    module.weight = nn.Parameter(codes, requires_grad=False)
    module.register_buffer("weight_int8_scale", scale, persistent=False)
    module.int8_pending = False
    module.register_forward_pre_hook(lambda m, args: _swap(m, _upcast(m)))
    module.register_forward_hook(lambda m, args, out: _swap(m, m.int8_codes))


def _upcast(module: nn.Module) -> torch.Tensor:
    return (module.weight.float() * module.weight_int8_scale).to(module.compute_dtype)


def _swap(module: nn.Module, weight: torch.Tensor) -> None:
    if weight.dtype == torch.int8:
        module._parameters["weight"] = module.__dict__.pop("int8_codes")
    else:
        module.__dict__["int8_codes"] = module._parameters["weight"]
        module._parameters["weight"] = nn.Parameter(weight, requires_grad=False)


@contextlib.contextmanager
def upcast_all(model: nn.Module):
    """Every int8 weight in its compute dtype while inside (saving, merging); int8 again after."""
    stored = [m for m in model.modules() if is_int8(m)]
    for module in stored:
        _swap(module, _upcast(module))
    try:
        yield
    finally:
        for module in stored:
            _swap(module, module.int8_codes)


class Int8Weights(WeightPhases):
    """Each frozen block linear stored as int8 as it arrives; every one upcast back for a save."""

    def arrived(self, model: nn.Module, module: nn.Module) -> None:
        store_int8(module)

    def full_form(self, model: nn.Module):
        return upcast_all(model)
