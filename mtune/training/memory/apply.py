"""The one place that applies memory techniques to a built model, in the registry's fixed order
(`mtune.training.memory.registry.TECHNIQUES`, where each line says why it stands where it does):

1. LoRA / DoRA adapters and NF4 base weights, then fp8 storage of the frozen block linears;
2. weight offloading (hooks on the modules holding frozen weights; the weights themselves leave as they are loaded,
   `mtune.training.model_setup.setup_model`);
3. the tiled MLP (reading the frozen weights once per pass, after they are quantized and hooked) and the attention
   kernel packed rows use;
4. activation checkpointing of blocks, then activation offloading (the context the step enters around forward and
   backward);
5. torch.compile per block.

FSDP2 sharding comes after, in `mtune.training.model_setup.setup_sharded_model`; ``optimizer_in_bwd``,
``optimizer_offload`` and low-bit optimizer states act through the optimizer
(`mtune.training.memory.optimizers.build_optimizer`), the chunked loss through the loss.

No global state: every step acts on the given model (a meta-device model works; see `mtune.modules.lora` for the
order of `to_empty` / loading / `reset_lora_parameters`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from mtune.training.memory.activation_offloading import OffloadActivations
from mtune.training.memory.placement import Placement
from mtune.training.memory import registry
from mtune.training.memory.registry import LoraConfig, MemoryConfig

__all__ = ["apply_memory_techniques"]

log = logging.getLogger(__name__)


def apply_memory_techniques(
    model: nn.Module, memory: MemoryConfig = MemoryConfig(), lora: "LoraConfig | Mapping[str, Any] | None" = None,
    placement: Placement | None = None,
) -> OffloadActivations | None:
    """Transforms `model` in place, in the registry's order. Returns the activation-offloading context to enter
    around forward and backward, or None without offloading.

    Args:
        memory: the run's memory keys (`MemoryConfig.from_config(cfg)`); the default applies nothing.
        lora: the config's `lora` node (a mapping or `LoraConfig`), or None for a full fine-tune.
        placement: the compute device and the host the offloading techniques move tensors between; default
            `Placement.default()` (the machine's accelerator and the CPU).
    """
    lora = LoraConfig.from_node(lora)
    placement = placement or Placement.default()
    context = None
    for technique in registry.TECHNIQUES:
        if technique.enabled(memory, lora):
            context = technique.apply(model, memory, lora=lora, placement=placement) or context
    log.info("memory techniques: %s", ", ".join(f"{t.name}={t.describe(memory, lora)}" for t in registry.TECHNIQUES if t.keys))
    return context
