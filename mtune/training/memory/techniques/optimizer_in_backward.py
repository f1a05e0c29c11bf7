"""Optimizer-in-backward (``optimizer_in_bwd``): each parameter is stepped as soon as its gradient is accumulated
and the gradient is freed, so a full set of gradients never exists. The implementation:
`mtune.training.memory.optimizers.OptimizerInBackward`, built by ``build_optimizer``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import FitChoice, MemoryTechnique, ModelFacts, get

__all__ = ["OptimizerInBackward", "OPTIMIZER_IN_BACKWARD"]


class OptimizerInBackward(MemoryTechnique):
    name = "optimizer_in_bwd"
    keys = (Key("optimizer_in_bwd", bool, False,
                "step each parameter's optimizer during backward and free its gradient"),)
    must_match_on_resume = ("optimizer_in_bwd",)  # changes the layout of the optimizer state
    fit_knob = "optimizer_in_bwd"
    fit_saves_floor_only = True

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.optimizer_in_bwd

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """Off, or on with clipping off (what it cannot do). Lossy where the user's config clips gradients. It also
        needs one micro-batch per step: the search keeps the samples per step by pairing it only with the
        micro-batch that holds them all (the rules refuse accumulation with it)."""
        lossy = "optimizer_in_bwd drops gradient clipping" if cfg.get("clip_grad_norm") is not None else None
        return [FitChoice(0, {"optimizer_in_bwd": False}),
                FitChoice(1, {"optimizer_in_bwd": True, "clip_grad_norm": None}, lossy=lossy, quality_cost=1)]

    def rules(self, cfg: Any) -> list[str]:
        """optimizer_in_bwd steps each parameter during backward, so nothing may need all gradients first."""
        if not get(cfg, "optimizer_in_bwd", False):
            return []
        problems = []
        steps = get(cfg, "gradient_accumulation_steps", 1)
        if steps > 1:
            problems.append(f"optimizer_in_bwd=true cannot be combined with gradient_accumulation_steps={steps}: "
                            "set gradient_accumulation_steps=1 or optimizer_in_bwd=false")
        clip = get(cfg, "clip_grad_norm")
        if clip is not None:
            problems.append(f"optimizer_in_bwd=true cannot be combined with clip_grad_norm={clip} (clipping needs "
                            "every gradient before the step): set clip_grad_norm=null or optimizer_in_bwd=false")
        if get(cfg, "dtype") == "fp16":
            problems.append("optimizer_in_bwd=true cannot be combined with dtype=fp16 (loss scaling must see every "
                            "gradient to skip a step): set dtype=bf16 or dtype=fp32, or optimizer_in_bwd=false")
        return problems

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        if (not cfg.get("optimizer_in_bwd") and cfg.get("lora") is None
                and int(cfg.get("gradient_accumulation_steps") or 1) == 1):
            return [(70, "optimizer_in_bwd=true")]
        return []


OPTIMIZER_IN_BACKWARD = OptimizerInBackward()
