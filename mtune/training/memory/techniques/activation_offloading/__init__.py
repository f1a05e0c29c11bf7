"""Activation offloading (``enable_activation_offloading``): what checkpointed blocks keep (each block's input)
waits in host memory from forward until backward needs it. The implementation: `offload` beside this
declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import Footprint, MemoryTechnique, ModelFacts, Settings, advice, setting
from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING

__all__ = ["ActivationOffloading", "ACTIVATION_OFFLOADING", "ActivationOffloadingSettings"]


@dataclass(frozen=True)
class ActivationOffloadingSettings(Settings):
    enable_activation_offloading: bool = setting(False, "move saved activations to CPU memory until backward")
    activation_offloading_use_streams: bool = setting(True, "overlap offloading transfers with compute (CUDA only)")


def _checkpointing(memory: Any) -> bool:
    return memory[ACTIVATION_CHECKPOINTING].enable_activation_checkpointing


class ActivationOffloading(MemoryTechnique):
    name = "activation_offloading"
    Settings = ActivationOffloadingSettings

    def enabled(self, s: ActivationOffloadingSettings, memory: Any) -> bool:
        return s.enable_activation_offloading

    def rules(self, s: ActivationOffloadingSettings, memory: Any) -> list[str]:
        """mtune offloads the inputs that checkpointed blocks keep; without checkpointing it would copy every saved
        activation of every layer over PCIe each step, which makes training transfer-bound."""
        if s.enable_activation_offloading and not _checkpointing(memory):
            return ["enable_activation_offloading=true needs enable_activation_checkpointing=true (offloading moves "
                    "what checkpointed blocks keep; alone it would copy every activation over PCIe): set "
                    "enable_activation_checkpointing=true or enable_activation_offloading=false"]
        return []

    def footprint(self, s: ActivationOffloadingSettings, memory: Any, facts: ModelFacts) -> Footprint:
        """Each block's input goes out in forward and comes back in backward."""
        if s.enable_activation_offloading and _checkpointing(memory):
            return Footprint(transfer_bytes_per_token=2.0 * facts.n_layers * facts.dim * facts.residual_bytes)
        return Footprint()

    def oom_advice(self, s: ActivationOffloadingSettings, memory: Any) -> list[tuple[int, str]]:
        if _checkpointing(memory) and not s.enable_activation_offloading:
            return [advice("activation_offloading", "enable_activation_offloading=true")]
        return []

    def on_model(self, model: Any, s: ActivationOffloadingSettings, memory: Any, placement: Any) -> Any:
        """The context the step enters around forward and backward: saved activations go to the host."""
        from mtune.training.memory.techniques.activation_offloading.offload import apply_activation_offloading

        return apply_activation_offloading(model, use_streams=s.activation_offloading_use_streams,
                                           placement=placement)


ACTIVATION_OFFLOADING = ActivationOffloading()
