"""Optimizer-state offload (``optimizer_offload: cpu``, ZeRO-Offload style): AdamW's states live in host memory,
each gradient moves there as backward produces it, the step runs on the CPU and the updated parameters come back.
The implementation: `mtune.training.memory.optimizer_offload` (``CPUOffloadOptimizer``), built by
`mtune.training.memory.optimizers.build_optimizer`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import (FitChoice, MemoryTechnique, ModelFacts, get, is_distributed,
                                             single_device_only)

__all__ = ["OptimizerOffload", "OPTIMIZER_OFFLOAD", "OPTIMIZER_OFFLOAD_OPTIMIZERS", "OPTIMIZER_OFFLOAD_TARGETS"]

OPTIMIZER_OFFLOAD_TARGETS = ("cpu",)
OPTIMIZER_OFFLOAD_OPTIMIZERS = ("torch.optim.AdamW",)
"""The optimizers ``optimizer_offload=cpu`` steps on the host: those with a vectorised (foreach / fused) CPU step
whose state is plain tensors shaped like the parameters."""


class OptimizerOffload(MemoryTechnique):
    name = "optimizer_offload"
    keys = (Key("optimizer_offload", str, None, "cpu: optimizer states in host memory, gradients moved there during "
                "backward, the optimizer step on the CPU (ZeRO-Offload style; torch.optim.AdamW only; null: off)",
                choices=OPTIMIZER_OFFLOAD_TARGETS),)
    # may change on resume: the optimizer's state_dict is the plain optimizer's, stepped by the same implementation
    fit_knob = "optimizer_offload"
    fit_saves_floor_only = True

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.optimizer_offload is not None

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """Optimizer states (and the step) in host memory; mostly worth it for full fine-tunes (LoRA's states are
        tiny). The rules drop it where it does not apply (distributed recipes, non-AdamW optimizers, fp16)."""
        return [FitChoice(0, {"optimizer_offload": None}), FitChoice(1, {"optimizer_offload": "cpu"})]

    def rules(self, cfg: Any) -> list[str]:
        """optimizer_offload=cpu moves each gradient to the host as backward produces it and steps there: the
        optimizer must have a CPU step, and nothing may step on the device or need the gradients where they were."""
        target = get(cfg, "optimizer_offload")
        if target is None:
            return []
        problems = self.optimizer_problems(target, str(get(cfg, "optimizer._component_", "")),
                                           bool(get(cfg, "optimizer_in_bwd", False)))
        if get(cfg, "dtype") == "fp16":
            problems.append(f"optimizer_offload={target} cannot be combined with dtype=fp16 (loss scaling checks the "
                            "gradients on the device, which offloading has already moved): set dtype=bf16 or "
                            "dtype=fp32, or optimizer_offload=null")
        return problems

    @staticmethod
    def optimizer_problems(target: str, component: str, optimizer_in_bwd: bool) -> list[str]:
        """What refuses ``optimizer_offload=target`` with this optimizer (`build_optimizer` asks too, for callers
        that skip the validator)."""
        problems = []
        if component not in OPTIMIZER_OFFLOAD_OPTIMIZERS:
            problems.append(f"optimizer_offload={target} cannot be combined with optimizer._component_={component}: "
                            f"offloading steps on the host with {', '.join(OPTIMIZER_OFFLOAD_OPTIMIZERS)} (foreach / "
                            "fused CPU step); set optimizer._component_=torch.optim.AdamW or optimizer_offload=null")
        if optimizer_in_bwd:
            problems.append(f"optimizer_offload={target} cannot be combined with optimizer_in_bwd=true (both take "
                            "over the optimizer step): set optimizer_in_bwd=false or optimizer_offload=null")
        return problems

    def distributed_rules(self, cfg: Any) -> list[str]:
        return single_device_only(cfg, "optimizer_offload")

    def state_home(self, cfg: Any) -> str | None:
        return "host" if get(cfg, "optimizer_offload") else None

    def host_step_elements(self, cfg: Any, facts: ModelFacts) -> int:
        """Every trainable element is stepped by the host's AdamW."""
        return facts.trainable_numel if get(cfg, "optimizer_offload") else 0

    def transfer_bytes_per_token(self, cfg: Any, facts: ModelFacts) -> float:
        """Each micro-batch's gradients go out; the updated parameters come back once per step."""
        if not cfg.get("optimizer_offload"):
            return 0.0
        return facts.trainable_bytes / facts.micro_batch_tokens + facts.trainable_bytes / facts.step_tokens

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        single_device = not is_distributed(cfg)  # the distributed recipes offload with fsdp_cpu_offload
        optimizer = str((cfg.get("optimizer") or {}).get("_component_", ""))
        if (single_device and optimizer == "torch.optim.AdamW" and not cfg.get("optimizer_offload")
                and not cfg.get("optimizer_in_bwd") and cfg.get("dtype") != "fp16"):
            return [(80, "optimizer_offload=cpu")]
        return []


OPTIMIZER_OFFLOAD = OptimizerOffload()
