"""FSDP2's CPU offload (``fsdp_cpu_offload``, the distributed recipes only): each rank's parameter shards, their
gradients and the optimizer's states live in host memory and the optimizer steps on the CPU; FSDP2 copies a
block's shards to the device to gather them (forward, and backward when they were freed after forward) and each
reduce-scattered gradient back to the host. The implementation is torch's (``CPUOffloadPolicy``, set by
`mtune.training.distributed.shard_model`); ``mtune plan`` lays it out as on a GPU
(`mtune.training.planning.plan`), and this module says what it costs and saves."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import FitChoice, MemoryTechnique, ModelFacts, get, is_distributed

__all__ = ["FsdpCpuOffload", "FSDP_CPU_OFFLOAD"]


def _host_if_on(cfg: Any) -> str | None:
    return "host" if get(cfg, "fsdp_cpu_offload") else None


class FsdpCpuOffload(MemoryTechnique):
    name = "fsdp_cpu_offload"
    distributed_keys = (Key("fsdp_cpu_offload", bool, False,
                            "keep parameters, gradients and optimizer state in CPU memory; the optimizer steps on "
                            "the CPU"),)
    # may change on resume: the checkpoint holds the same sharded tensors wherever they lived
    fit_knob = "fsdp_cpu_offload"
    fit_saves_floor_only = True

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """Off, or every shard on the host (distributed recipes; on one device optimizer and weight offloading
        play this part)."""
        if not is_distributed(cfg):
            return [FitChoice(0, {})]
        return [FitChoice(0, {"fsdp_cpu_offload": False}), FitChoice(1, {"fsdp_cpu_offload": True})]

    def state_home(self, cfg: Any) -> str | None:
        return _host_if_on(cfg)

    def frozen_weights_home(self, cfg: Any) -> str | None:
        return _host_if_on(cfg)

    def trainable_weights_home(self, cfg: Any) -> str | None:
        return _host_if_on(cfg)

    def host_step_elements(self, cfg: Any, facts: ModelFacts) -> int:
        """Each rank steps its shard of the trainable elements on its CPU."""
        return facts.trainable_numel // facts.world_size if get(cfg, "fsdp_cpu_offload") else 0

    def transfer_bytes_per_token(self, cfg: Any, facts: ModelFacts) -> float:
        """Per rank and micro-batch: every shard comes in for forward and again for backward when resharded after
        forward, and each gradient shard goes out."""
        if not get(cfg, "fsdp_cpu_offload"):
            return 0.0
        visits = 2 if get(cfg, "fsdp_reshard_after_forward", True) else 1
        shards = (facts.trainable_bytes + facts.frozen_bytes) / facts.world_size
        return (visits * shards + facts.trainable_bytes / facts.world_size) / facts.micro_batch_tokens

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        if is_distributed(cfg) and not cfg.get("fsdp_cpu_offload"):
            return [(85, "fsdp_cpu_offload=true")]
        return []


FSDP_CPU_OFFLOAD = FsdpCpuOffload()
