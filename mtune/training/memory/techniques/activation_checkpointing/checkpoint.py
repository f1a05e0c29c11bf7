"""Activation checkpointing per transformer block: whole blocks, or op by op.

A checkpointed block keeps only its input during forward and recomputes its internals during backward, trading
one extra block forward for the block's activations. We use PyTorch's non-reentrant `torch.utils.checkpoint`,
which reproduces the RNG state for dropout, works with `torch.compile`, FSDP2 and partially frozen (LoRA) models.

Two policies (``activation_checkpointing_policy``):

- ``block``: nothing inside the block is kept; backward reruns the whole block forward.
- ``selective_op`` (torchtitan's "op-level selective AC"): inside the block, the outputs of the expensive ops —
  matrix multiplies and attention — are kept, and only the cheap ops between them (norms, rotary embeddings,
  activations, adds, casts, views) are recomputed. The recompute then costs almost no FLOPs, and the memory sits
  between no checkpointing and ``block``: a matmul's output is kept, but the many elementwise intermediates that
  autograd would save around it are not. Built on `torch.utils.checkpoint.create_selective_checkpoint_contexts`,
  whose policy function is asked, for each aten op run inside the block, whether to save or recompute its output.

The block's ``forward`` is replaced on the instance rather than wrapping the module, so parameter names (and so
checkpoint keys) do not change.
"""

from __future__ import annotations

import functools
import importlib

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from mtune.config.errors import ConfigError

__all__ = ["apply_activation_checkpointing", "checkpoint_policy", "is_checkpointed", "selective_op_policy", "saved_ops"]


@functools.cache  # looked up on the first checkpointed forward: the varlen module imports torch._dynamo
def saved_ops() -> frozenset:
    """The aten ops whose outputs ``selective_op`` keeps: matrix multiplies (what linears lower to, with or without
    bias, batched or not) and every fused attention kernel this build of torch has (CPU, CUDA flash, efficient,
    cuDNN, math, and ``torch.ops.torch_attn._varlen_attn``, the varlen flash kernel of packed rows)."""
    names = ["mm", "addmm", "bmm", "baddbmm", "linear", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math"]
    ops = {getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name)}
    try:  # packed rows on CUDA (torch 2.10+): importing the module registers its op
        importlib.import_module("torch.nn.attention.varlen")
    except ImportError:
        pass
    varlen = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn", None)
    if varlen is not None:
        ops.add(varlen.default)
    return frozenset(ops)


def selective_op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep the output of a matmul or attention op; recompute anything else (the same answer in the forward pass
    and in the recompute, as `create_selective_checkpoint_contexts` requires)."""
    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_op_policy)


def _checkpointed_forward(original_forward, *args, **kwargs):
    return checkpoint(original_forward, *args, use_reentrant=False, **kwargs)


def _selective_forward(original_forward, *args, **kwargs):
    return checkpoint(original_forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)


def checkpoint_policy(block: nn.Module) -> str | None:
    """The policy ``block`` is checkpointed with (``block``, ``selective_op``), or None when it is not."""
    return getattr(block, "_mtune_checkpointed", None)


def is_checkpointed(block: nn.Module) -> bool:
    return checkpoint_policy(block) is not None


def apply_activation_checkpointing(model: nn.Module, every_n_layers: int = 1, policy: str = "block") -> nn.Module:
    """Checkpoints block i of `model.layers` when i % every_n_layers == 0 (1 = every block), with `policy`
    (``block`` or ``selective_op``, see the module docstring). In place; returns the model. Applying twice does not
    nest (the first policy stays)."""
    if every_n_layers < 1:
        raise ConfigError(f"activation_checkpointing_every_n_layers must be >= 1, got {every_n_layers}")
    wrappers = {"block": _checkpointed_forward, "selective_op": _selective_forward}
    if policy not in wrappers:
        raise ConfigError(f"activation_checkpointing_policy must be one of {', '.join(wrappers)}, got {policy!r}")
    wrapper = wrappers[policy]
    for i, block in enumerate(model.layers):
        if i % every_n_layers == 0 and not is_checkpointed(block):
            block.forward = functools.partial(wrapper, block.forward)
            block._mtune_checkpointed = policy
    return model
