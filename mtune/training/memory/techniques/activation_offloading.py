"""Activation offloading (``enable_activation_offloading``): what checkpointed blocks keep (each block's input)
waits in host memory from forward until backward needs it. The implementation:
`mtune.training.memory.activation_offloading`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import MemoryTechnique, ModelFacts, get

__all__ = ["ActivationOffloading", "ACTIVATION_OFFLOADING"]


class ActivationOffloading(MemoryTechnique):
    name = "activation_offloading"
    keys = (
        Key("enable_activation_offloading", bool, False, "move saved activations to CPU memory until backward"),
        Key("activation_offloading_use_streams", bool, True, "overlap offloading transfers with compute (CUDA only)"),
    )

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.enable_activation_offloading

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> Any:
        from mtune.training.memory.activation_offloading import apply_activation_offloading

        return apply_activation_offloading(model, use_streams=memory.activation_offloading_use_streams,
                                           placement=placement)

    def rules(self, cfg: Any) -> list[str]:
        """mtune offloads the inputs that checkpointed blocks keep; without checkpointing it would copy every saved
        activation of every layer over PCIe each step, which makes training transfer-bound."""
        if get(cfg, "enable_activation_offloading", False) and not get(cfg, "enable_activation_checkpointing", False):
            return ["enable_activation_offloading=true needs enable_activation_checkpointing=true (offloading moves "
                    "what checkpointed blocks keep; alone it would copy every activation over PCIe): set "
                    "enable_activation_checkpointing=true or enable_activation_offloading=false"]
        return []

    def transfer_bytes_per_token(self, cfg: Any, facts: ModelFacts) -> float:
        """Each block's input goes out in forward and comes back in backward."""
        if cfg.get("enable_activation_checkpointing") and cfg.get("enable_activation_offloading"):
            return 2.0 * facts.n_layers * facts.dim * facts.residual_bytes
        return 0.0

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        if cfg.get("enable_activation_checkpointing") and not cfg.get("enable_activation_offloading"):
            return [(20, "enable_activation_offloading=true")]
        return []


ACTIVATION_OFFLOADING = ActivationOffloading()
