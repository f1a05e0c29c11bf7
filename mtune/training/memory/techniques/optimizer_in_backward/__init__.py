"""Optimizer-in-backward (``optimizer_in_bwd``): each parameter is stepped as soon as its gradient is accumulated
and the gradient is freed, so a full set of gradients never exists. The implementation: `in_backward` beside this
declaration (`OptimizerInBackward`), built in the optimizer phase."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import (FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, Settings,
                                             advice, setting)

__all__ = ["OptimizerInBackward", "OPTIMIZER_IN_BACKWARD", "OptimizerInBackwardSettings"]


@dataclass(frozen=True)
class OptimizerInBackwardSettings(Settings):
    optimizer_in_bwd: bool = setting(False, "step each parameter's optimizer during backward and free its gradient",
                                     must_match_on_resume=True)  # the layout of the optimizer state


class OptimizerInBackward(MemoryTechnique):
    name = "optimizer_in_bwd"
    Settings = OptimizerInBackwardSettings
    fit_knob = FitKnob("optimizer_in_bwd", floor_only=True)

    def enabled(self, s: OptimizerInBackwardSettings, memory: Any) -> bool:
        return s.optimizer_in_bwd

    def rules(self, s: OptimizerInBackwardSettings, memory: Any) -> list[str]:
        """optimizer_in_bwd steps each parameter during backward, so nothing may need all gradients first."""
        if not s.optimizer_in_bwd:
            return []
        problems = []
        steps = memory.run.gradient_accumulation_steps
        if steps > 1:
            problems.append(f"optimizer_in_bwd=true cannot be combined with gradient_accumulation_steps={steps}: "
                            "set gradient_accumulation_steps=1 or optimizer_in_bwd=false")
        clip = memory.run.clip_grad_norm
        if clip is not None:
            problems.append(f"optimizer_in_bwd=true cannot be combined with clip_grad_norm={clip} (clipping needs "
                            "every gradient before the step): set clip_grad_norm=null or optimizer_in_bwd=false")
        if memory.run.dtype == "fp16":
            problems.append("optimizer_in_bwd=true cannot be combined with dtype=fp16 (loss scaling must see every "
                            "gradient to skip a step): set dtype=bf16 or dtype=fp32, or optimizer_in_bwd=false")
        return problems

    def footprint(self, s: OptimizerInBackwardSettings, memory: Any, facts: ModelFacts) -> Footprint:
        return Footprint(frees_gradients=s.optimizer_in_bwd)

    def fit_choices(self, s: OptimizerInBackwardSettings, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """Off, or on with clipping off (what it cannot do). Lossy where the user's config clips gradients. It also
        needs one micro-batch per step: the search keeps the samples per step by pairing it only with the
        micro-batch that holds them all (the rules refuse accumulation with it)."""
        lossy = "optimizer_in_bwd drops gradient clipping" if memory.run.clip_grad_norm is not None else None
        return [FitChoice(0, {"optimizer_in_bwd": False}),
                FitChoice(1, {"optimizer_in_bwd": True, "clip_grad_norm": None}, lossy=lossy,
                          quality="clipping_dropped")]

    def oom_advice(self, s: OptimizerInBackwardSettings, memory: Any) -> list[tuple[int, str]]:
        if not s.optimizer_in_bwd and memory.lora is None and memory.run.gradient_accumulation_steps == 1:
            return [advice("optimizer_in_bwd", "optimizer_in_bwd=true")]
        return []

    def wrap_optimizer(self, spec: Any, named_params: list, s: OptimizerInBackwardSettings, memory: Any,
                       placement: Any) -> Any:
        from mtune.training.memory.techniques.optimizer_in_backward.in_backward import OptimizerInBackward as Wrapper

        return Wrapper(named_params, spec.cls, **spec.kwargs_for(spec.device))


OPTIMIZER_IN_BACKWARD = OptimizerInBackward()
