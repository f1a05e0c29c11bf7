"""Activation checkpointing per transformer block.

A checkpointed block keeps only its input during forward and recomputes its internals during backward, trading
one extra block forward for the block's activations. We use PyTorch's non-reentrant `torch.utils.checkpoint`,
which reproduces the RNG state for dropout, works with `torch.compile`, FSDP2 and partially frozen (LoRA) models.

The block's `forward` is replaced on the instance rather than wrapping the module, so parameter names (and so
checkpoint keys) do not change.
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from mtune.config.errors import ConfigError

__all__ = ["apply_activation_checkpointing", "is_checkpointed"]


def _checkpointed_forward(original_forward, *args, **kwargs):
    return checkpoint(original_forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(block: nn.Module) -> bool:
    return getattr(block, "_mtune_checkpointed", False)


def apply_activation_checkpointing(model: nn.Module, every_n_layers: int = 1) -> nn.Module:
    """Checkpoints block i of `model.layers` when i % every_n_layers == 0 (1 = every block). In place; returns the
    model. Applying twice does not nest."""
    if every_n_layers < 1:
        raise ConfigError(f"activation_checkpointing_every_n_layers must be >= 1, got {every_n_layers}")
    for i, block in enumerate(model.layers):
        if i % every_n_layers == 0 and not is_checkpointed(block):
            block.forward = functools.partial(_checkpointed_forward, block.forward)
            block._mtune_checkpointed = True
    return model
