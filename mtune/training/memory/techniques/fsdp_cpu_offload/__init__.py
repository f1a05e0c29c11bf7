"""FSDP2's CPU offload (``fsdp_cpu_offload``, the distributed recipes only): each rank's parameter shards, their
gradients and the optimizer's states live in host memory and the optimizer steps on the CPU; FSDP2 copies a
block's shards to the device to gather them (forward, and backward when they were freed after forward) and each
reduce-scattered gradient back to the host. The implementation is torch's (``CPUOffloadPolicy``, a sharding option
this technique gives `mtune.training.distributed.shard_model`); ``mtune plan`` lays it out as on a GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import (FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, Settings,
                                             advice, setting)

__all__ = ["FsdpCpuOffload", "FSDP_CPU_OFFLOAD", "FsdpCpuOffloadSettings"]


@dataclass(frozen=True)
class FsdpCpuOffloadSettings(Settings):
    fsdp_cpu_offload: bool = setting(False, "keep parameters, gradients and optimizer state in CPU memory; the "
                                     "optimizer steps on the CPU", distributed_only=True)


class FsdpCpuOffload(MemoryTechnique):
    name = "fsdp_cpu_offload"
    Settings = FsdpCpuOffloadSettings
    # may change on resume: the checkpoint holds the same sharded tensors wherever they lived
    fit_knob = FitKnob("fsdp_cpu_offload", floor_only=True, offloads=True)

    def enabled(self, s: FsdpCpuOffloadSettings, memory: Any) -> bool:
        return memory.distributed and s.fsdp_cpu_offload

    def footprint(self, s: FsdpCpuOffloadSettings, memory: Any, facts: ModelFacts) -> Footprint:
        """Per rank and micro-batch: every shard comes in for forward and again for backward when resharded after
        forward, and each gradient shard goes out; each rank steps its shard of the trainable elements on its
        CPU."""
        if not s.fsdp_cpu_offload:
            return Footprint()
        visits = 2 if memory.run.fsdp_reshard_after_forward else 1
        shards = (facts.trainable_bytes + facts.frozen_bytes) / facts.world_size
        transfer = (visits * shards + facts.trainable_bytes / facts.world_size) / facts.micro_batch_tokens
        return Footprint(frozen_weights_home="host", trainable_weights_home="host", states_home="host",
                         transfer_bytes_per_token=transfer,
                         host_step_elements=facts.trainable_numel // facts.world_size)

    def fit_choices(self, s: FsdpCpuOffloadSettings, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """Off, or every shard on the host (distributed recipes; on one device optimizer and weight offloading
        play this part)."""
        if not memory.distributed:
            return [FitChoice(0, {})]
        return [FitChoice(0, {"fsdp_cpu_offload": False}), FitChoice(1, {"fsdp_cpu_offload": True})]

    def oom_advice(self, s: FsdpCpuOffloadSettings, memory: Any) -> list[tuple[int, str]]:
        if memory.distributed and not s.fsdp_cpu_offload:
            return [advice("fsdp_cpu_offload", "fsdp_cpu_offload=true")]
        return []

    def sharding_options(self, s: FsdpCpuOffloadSettings, memory: Any, placement: Any) -> dict:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy

        # pinned host memory exists only beside an accelerator
        return {"offload_policy": CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())}


FSDP_CPU_OFFLOAD = FsdpCpuOffload()
