"""The one place that applies memory techniques to a built model, in one fixed order:

1. LoRA / DoRA adapters (and NF4 base weights for QLoRA) — changes which modules exist, so it comes first.
2. Activation checkpointing of blocks — wraps the blocks' forward, adapters included.
3. Activation offloading — hooks on the whole model; with (2) it moves each block's saved input.
4. torch.compile per block (`block.compile()`) — compiles the checkpointed block as a unit; compiling blocks one by
   one keeps compile time per distinct block, not per model.
5. FSDP2 sharding — applied afterwards by the distributed recipe, on the blocks and then the model.

No global state: every step acts on the given model (a meta-device model works; see `mtune.modules.lora` for the
order of `to_empty` / loading / `reset_lora_parameters`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from mtune.modules.lora import apply_lora
from mtune.training.memory.activation_checkpointing import apply_activation_checkpointing
from mtune.training.memory.activation_offloading import OffloadActivations, apply_activation_offloading

__all__ = ["apply_memory_techniques"]

log = logging.getLogger(__name__)


def apply_memory_techniques(
    model: nn.Module,
    *,
    lora: Mapping[str, Any] | None = None,
    activation_checkpointing: bool = False,
    every_n_layers: int = 1,
    activation_offloading: bool = False,
    offload_use_streams: bool = True,
    compile: bool = False,
) -> OffloadActivations | None:
    """Transforms `model` in place, in the order above. Returns the offloading context (None without offloading).

    Args:
        lora: the config's `lora` node (`modules`, `rank`, `alpha`, `dropout`, `use_dora`, `quantize_base`), or None
            for a full fine-tune.
        activation_checkpointing / every_n_layers: `enable_activation_checkpointing`,
            `activation_checkpointing_every_n_layers`.
        activation_offloading / offload_use_streams: `enable_activation_offloading`,
            `activation_offloading_use_streams`.
        compile: `compile`: each block of `model.layers` is compiled separately.
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
    if activation_checkpointing:
        apply_activation_checkpointing(model, every_n_layers=every_n_layers)
    offload = None
    if activation_offloading:
        offload = apply_activation_offloading(model, use_streams=offload_use_streams)
    if compile:
        for block in model.layers:
            block.compile()
    log.info(
        "memory techniques: lora=%s, activation_checkpointing=%s (every %d), activation_offloading=%s, compile=%s",
        None if lora is None else ("dora" if lora.get("use_dora") else "lora") + ("+nf4" if lora.get("quantize_base") else ""),
        activation_checkpointing, every_n_layers, activation_offloading, compile,
    )
    return offload
