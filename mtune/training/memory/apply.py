"""The one place that applies memory techniques to a built model, in one fixed order:

1. LoRA / DoRA adapters (and NF4 base weights for QLoRA) — changes which modules exist, so it comes first. Then
   fp8 storage of the frozen block linears (``weight_storage_dtype``), which needs to know which weights the
   adapters froze.
2. Weight offloading (``weight_offloading``) — hooks on the modules holding frozen weights (so after 1, which
   decides what is frozen and how it is stored); the weights themselves move to host memory as they are loaded
   (`mtune.training.model_setup.setup_model`). Hooks on modules, not on blocks, so recomputation sees them too.
3. Activation checkpointing of blocks (``enable_activation_checkpointing``) — wraps the blocks' forward, adapters
   included; ``activation_checkpointing_policy`` says whether a block is recomputed whole (``block``) or keeps its
   matmul and attention outputs (``selective_op``).
4. Activation offloading (``enable_activation_offloading``) — returns the context that the training step enters
   around forward and backward (so the loss's saved tensors are covered too); with (3) it moves each block's saved
   input.
5. torch.compile per block (``compile``: `block.compile()`) — compiles the checkpointed block as a unit; compiling
   blocks one by one keeps compile time per distinct block, not per model.

FSDP2 sharding comes after, in `mtune.training.model_setup.setup_sharded_model` (blocks, then the root), and
``optimizer_in_bwd`` acts through the optimizer (`mtune.training.memory.optimizers.build_optimizer`).

No global state: every step acts on the given model (a meta-device model works; see `mtune.modules.lora` for the
order of `to_empty` / loading / `reset_lora_parameters`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from mtune.config.keys import MemoryConfig
from mtune.modules.lora import apply_lora
from mtune.training.memory.activation_checkpointing import apply_activation_checkpointing
from mtune.training.memory.activation_offloading import OffloadActivations, apply_activation_offloading
from mtune.training.memory.placement import Placement
from mtune.training.memory.weight_offloading import apply_weight_offloading
from mtune.training.memory.weight_storage import apply_fp8_weight_storage

__all__ = ["apply_memory_techniques"]

log = logging.getLogger(__name__)


def apply_memory_techniques(
    model: nn.Module, memory: MemoryConfig = MemoryConfig(), lora: Mapping[str, Any] | None = None,
    placement: Placement | None = None,
) -> OffloadActivations | None:
    """Transforms `model` in place, in the order above. Returns the activation-offloading context to enter around
    forward and backward, or None without offloading.

    Args:
        memory: the run's memory keys (`MemoryConfig.from_config(cfg)`); the default applies nothing.
        lora: the config's `lora` node (`modules`, `rank`, `alpha`, `dropout`, `use_dora`, `quantize_base`), or None
            for a full fine-tune.
        placement: the compute device and the host the offloading techniques move tensors between; default
            `Placement.default()` (the machine's accelerator and the CPU).
    """
    if lora is not None:
        apply_lora(
            model,
            modules=lora["modules"],
            rank=lora["rank"],
            alpha=lora["alpha"],
            dropout=lora.get("dropout", 0.0),
            use_dora=lora.get("use_dora", False),
            quantize_base=lora.get("quantize_base", False),
        )
    if memory.weight_storage_dtype is not None:
        apply_fp8_weight_storage(model, memory.weight_storage_dtype, memory.weight_storage_skip_patterns)
    if memory.weight_offloading is not None:
        apply_weight_offloading(model, memory.weight_offloading, placement=placement)
    if memory.enable_activation_checkpointing:
        apply_activation_checkpointing(model, every_n_layers=memory.activation_checkpointing_every_n_layers,
                                       policy=memory.activation_checkpointing_policy)
    offload = None
    if memory.enable_activation_offloading:
        offload = apply_activation_offloading(model, use_streams=memory.activation_offloading_use_streams,
                                              placement=placement)
    if memory.compile:
        for block in model.layers:
            block.compile()
    log.info(
        "memory techniques: lora=%s, weight_storage=%s, weight_offloading=%s, activation_checkpointing=%s (%s, "
        "every %d), activation_offloading=%s, compile=%s",
        None if lora is None else ("dora" if lora.get("use_dora") else "lora") + ("+nf4" if lora.get("quantize_base") else ""),
        memory.weight_storage_dtype, memory.weight_offloading,
        memory.enable_activation_checkpointing, memory.activation_checkpointing_policy,
        memory.activation_checkpointing_every_n_layers, memory.enable_activation_offloading, memory.compile,
    )
    return offload
