"""Optimizer-state offload (``optimizer_offload: cpu``, ZeRO-Offload style): AdamW's states live in host memory,
each gradient moves there as backward produces it, the step runs on the CPU and the updated parameters come back.
The implementation: `cpu_optimizer` beside this declaration (``CPUOffloadOptimizer``), built in the optimizer
phase."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.config.errors import ConfigError
from mtune.training.memory.technique import (FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, Settings,
                                             advice, setting)
from mtune.training.memory.techniques.optimizer_in_backward import OPTIMIZER_IN_BACKWARD

__all__ = ["OptimizerOffload", "OPTIMIZER_OFFLOAD", "OptimizerOffloadSettings", "OPTIMIZER_OFFLOAD_OPTIMIZERS",
           "OPTIMIZER_OFFLOAD_TARGETS"]

OPTIMIZER_OFFLOAD_TARGETS = ("cpu",)
OPTIMIZER_OFFLOAD_OPTIMIZERS = ("torch.optim.AdamW",)
"""The optimizers ``optimizer_offload=cpu`` steps on the host: those with a vectorised (foreach / fused) CPU step
whose state is plain tensors shaped like the parameters."""


@dataclass(frozen=True)
class OptimizerOffloadSettings(Settings):
    optimizer_offload: str | None = setting(
        None, "cpu: optimizer states in host memory, gradients moved there during backward, the optimizer step on the "
        "CPU (ZeRO-Offload style; torch.optim.AdamW only; null: off)", choices=OPTIMIZER_OFFLOAD_TARGETS)


def _problems(target: str, component: str, optimizer_in_bwd: bool) -> list[str]:
    """What refuses ``optimizer_offload=target`` with this optimizer (the optimizer phase asks too, for callers
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


class OptimizerOffload(MemoryTechnique):
    name = "optimizer_offload"
    Settings = OptimizerOffloadSettings
    # may change on resume: the optimizer's state_dict is the plain optimizer's, stepped by the same implementation
    fit_knob = FitKnob("optimizer_offload", floor_only=True, offloads=True)

    def enabled(self, s: OptimizerOffloadSettings, memory: Any) -> bool:
        return s.optimizer_offload is not None

    def rules(self, s: OptimizerOffloadSettings, memory: Any) -> list[str]:
        """optimizer_offload=cpu moves each gradient to the host as backward produces it and steps there: the
        optimizer must have a CPU step, and nothing may step on the device or need the gradients where they were.
        The distributed recipes offload with fsdp_cpu_offload."""
        target = s.optimizer_offload
        if target is None:
            return []
        if memory.distributed:
            return ["optimizer_offload is a single-device technique: the distributed recipes offload parameters, "
                    "gradients and optimizer states with fsdp_cpu_offload=true; set optimizer_offload=null"]
        problems = _problems(target, memory.run.optimizer_component, memory[OPTIMIZER_IN_BACKWARD].optimizer_in_bwd)
        if memory.run.dtype == "fp16":
            problems.append(f"optimizer_offload={target} cannot be combined with dtype=fp16 (loss scaling checks the "
                            "gradients on the device, which offloading has already moved): set dtype=bf16 or "
                            "dtype=fp32, or optimizer_offload=null")
        return problems

    def footprint(self, s: OptimizerOffloadSettings, memory: Any, facts: ModelFacts) -> Footprint:
        """States on the host, every trainable element stepped there; each micro-batch's gradients go out and the
        updated parameters come back once per step."""
        if not s.optimizer_offload:
            return Footprint()
        transfer = facts.trainable_bytes / facts.micro_batch_tokens + facts.trainable_bytes / facts.step_tokens
        return Footprint(states_home="host", frees_gradients=True, transfer_bytes_per_token=transfer,
                         host_step_elements=facts.trainable_numel)

    def fit_choices(self, s: OptimizerOffloadSettings, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """Optimizer states (and the step) in host memory; mostly worth it for full fine-tunes (LoRA's states are
        tiny). The rules drop it where it does not apply (distributed recipes, non-AdamW optimizers, fp16)."""
        return [FitChoice(0, {"optimizer_offload": None}), FitChoice(1, {"optimizer_offload": "cpu"})]

    def oom_advice(self, s: OptimizerOffloadSettings, memory: Any) -> list[tuple[int, str]]:
        if (not memory.distributed and memory.run.optimizer_component == "torch.optim.AdamW"
                and not s.optimizer_offload and not memory[OPTIMIZER_IN_BACKWARD].optimizer_in_bwd
                and memory.run.dtype != "fp16"):
            return [advice("optimizer_offload", "optimizer_offload=cpu")]
        return []

    def wrap_optimizer(self, spec: Any, named_params: list, s: OptimizerOffloadSettings, memory: Any,
                       placement: Any) -> Any:
        problems = _problems(s.optimizer_offload, spec.component, memory[OPTIMIZER_IN_BACKWARD].optimizer_in_bwd)
        if problems:  # callers that skip the validator get its own words
            raise ConfigError(problems[0])
        from mtune.training.memory.techniques.optimizer_offload.cpu_optimizer import offloaded_optimizer

        return offloaded_optimizer(spec, named_params, s.optimizer_offload, placement)


OPTIMIZER_OFFLOAD = OptimizerOffload()
