"""Activation offloading (``enable_activation_offloading``): what checkpointed blocks keep (each block's input)
waits in host memory from forward until backward needs it; ``activation_offloading_blocks: N`` offloads only the
first N blocks' (the rest stay on the device: a host too small for every block's input still takes some). The
implementation: `offload` beside this declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import (BlockOffload, Footprint, MemoryTechnique, ModelFacts, Settings, advice,
                                             setting)
from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING

__all__ = ["ActivationOffloading", "ACTIVATION_OFFLOADING", "ActivationOffloadingSettings"]


@dataclass(frozen=True)
class ActivationOffloadingSettings(Settings):
    enable_activation_offloading: bool = setting(False, "move saved activations to CPU memory until backward")
    activation_offloading_use_streams: bool = setting(True, "overlap offloading transfers with compute (CUDA only)")
    activation_offloading_blocks: int | None = setting(
        None, "offload what the first N transformer blocks save, keep the later blocks' on the device (0: only what "
        "is saved outside the blocks); null: every block", at_least=0)

    def offloaded_blocks(self, n_layers: int) -> int:
        """How many of ``n_layers`` blocks save to the host (0 when offloading is off)."""
        if not self.enable_activation_offloading:
            return 0
        blocks = self.activation_offloading_blocks
        return n_layers if blocks is None else min(int(blocks), n_layers)


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
        if s.activation_offloading_blocks is not None and not s.enable_activation_offloading:
            return [f"activation_offloading_blocks={s.activation_offloading_blocks} needs "
                    "enable_activation_offloading=true (it says which blocks offload): set "
                    "enable_activation_offloading=true or activation_offloading_blocks=null"]
        return []

    def footprint(self, s: ActivationOffloadingSettings, memory: Any, facts: ModelFacts) -> Footprint:
        """Each offloaded block's input goes out in forward and comes back in backward."""
        if not (s.enable_activation_offloading and _checkpointing(memory)):
            return Footprint()
        blocks = s.offloaded_blocks(facts.n_layers)
        return Footprint(transfer_bytes_per_token=2.0 * blocks * facts.dim * facts.residual_bytes,
                         block_offload=BlockOffload(blocks, facts.n_layers, "activation_offloading_blocks"))

    def oom_advice(self, s: ActivationOffloadingSettings, memory: Any) -> list[tuple[int, str]]:
        if _checkpointing(memory) and not s.enable_activation_offloading:
            return [advice("activation_offloading", "enable_activation_offloading=true")]
        return []

    def on_model(self, model: Any, s: ActivationOffloadingSettings, memory: Any, placement: Any) -> Any:
        """The context the step enters around forward and backward: saved activations go to the host."""
        from mtune.training.memory.techniques.activation_offloading.offload import apply_activation_offloading

        return apply_activation_offloading(model, use_streams=s.activation_offloading_use_streams,
                                           placement=placement, blocks=s.activation_offloading_blocks)


ACTIVATION_OFFLOADING = ActivationOffloading()
