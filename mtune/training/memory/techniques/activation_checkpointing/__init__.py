"""Activation checkpointing of transformer blocks (``enable_activation_checkpointing``): a checkpointed block keeps
only its input in forward and recomputes its internals in backward, whole (``block``) or all but its matmul and
attention outputs (``selective_op``). The implementation: `checkpoint` beside this declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import (FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, Recompute,
                                             Settings, advice, setting)

__all__ = ["ActivationCheckpointing", "ACTIVATION_CHECKPOINTING", "ActivationCheckpointingSettings",
           "ACTIVATION_CHECKPOINTING_POLICIES"]

ACTIVATION_CHECKPOINTING_POLICIES = ("block", "selective_op")
"""The values of ``activation_checkpointing_policy``."""


@dataclass(frozen=True)
class ActivationCheckpointingSettings(Settings):
    enable_activation_checkpointing: bool = setting(False, "recompute block activations in the backward pass")
    activation_checkpointing_every_n_layers: int = setting(1, "checkpoint every Nth transformer block", at_least=1)
    activation_checkpointing_policy: str = setting(
        "block", "block: recompute each checkpointed block whole; selective_op: keep the matmul and attention outputs "
        "and recompute only the cheap ops between them", choices=ACTIVATION_CHECKPOINTING_POLICIES)

    def describe(self) -> str:
        return f"{self.activation_checkpointing_policy}, every {self.activation_checkpointing_every_n_layers} layer(s)"

    def layer_policies(self, n_layers: int) -> tuple[str | None, ...]:
        """Each of ``n_layers`` blocks' policy, or None where it is not checkpointed."""
        if not self.enable_activation_checkpointing:
            return (None,) * n_layers
        every = int(self.activation_checkpointing_every_n_layers)
        return tuple(self.activation_checkpointing_policy if i % every == 0 else None for i in range(n_layers))


class ActivationCheckpointing(MemoryTechnique):
    name = "activation_checkpointing"
    Settings = ActivationCheckpointingSettings
    fit_knob = FitKnob("activation_checkpointing")

    def enabled(self, s: ActivationCheckpointingSettings, memory: Any) -> bool:
        return s.enable_activation_checkpointing

    def rules(self, s: ActivationCheckpointingSettings, memory: Any) -> list[str]:
        """A policy says how checkpointed blocks recompute; it needs checkpointing to be on."""
        policy = s.activation_checkpointing_policy
        if policy != "block" and not s.enable_activation_checkpointing:
            return [f"activation_checkpointing_policy={policy} needs enable_activation_checkpointing=true (the policy "
                    "chooses what checkpointed blocks keep): set enable_activation_checkpointing=true or "
                    "activation_checkpointing_policy=block"]
        return []

    def footprint(self, s: ActivationCheckpointingSettings, memory: Any, facts: ModelFacts) -> Footprint:
        """Every Nth block checkpointed repeats every N blocks; backward recomputes those blocks as their policy
        says."""
        every = int(s.activation_checkpointing_every_n_layers) if s.enable_activation_checkpointing else 1
        return Footprint(repeat_blocks=every, recompute=Recompute(checkpoint=s.layer_policies(facts.n_layers)))

    def fit_choices(self, s: ActivationCheckpointingSettings, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """None, then (full fine-tunes) selective_op on every block, block checkpointing of every 2nd block, of
        every block, and of every block with its input offloaded (``enable_activation_offloading`` is a level of
        this knob). selective_op keeps ~56% of a block's activations (the matmul outputs), more than block
        checkpointing of every 2nd block keeps; with LoRA on a frozen base it can keep more than no checkpointing
        at all (backward needs none of the frozen matmuls' outputs), so it is searched only for full fine-tunes."""
        block = {"activation_checkpointing_policy": "block", "enable_activation_offloading": False,
                 "activation_offloading_blocks": None}  # every block when offloading: --fit lowers it for the host
        every = {"enable_activation_checkpointing": True, "activation_checkpointing_every_n_layers": 1}
        choices = [FitChoice(0, {"enable_activation_checkpointing": False, **block})]
        if memory.lora is None:
            choices.append(FitChoice(1, {**every, "activation_checkpointing_policy": "selective_op",
                                         "enable_activation_offloading": False, "activation_offloading_blocks": None}))
        if facts.n_layers >= 2:
            choices.append(FitChoice(2, {**every, "activation_checkpointing_every_n_layers": 2, **block}))
        choices.append(FitChoice(3, {**every, **block}))
        choices.append(FitChoice(4, {**every, **block, "enable_activation_offloading": True}))
        return choices

    def oom_advice(self, s: ActivationCheckpointingSettings, memory: Any) -> list[tuple[int, str]]:
        if s.enable_activation_checkpointing:
            return []
        return [advice("activation_checkpointing", "enable_activation_checkpointing=true")]

    def on_model(self, model: Any, s: ActivationCheckpointingSettings, memory: Any, placement: Any) -> None:
        from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing

        apply_activation_checkpointing(model, every_n_layers=s.activation_checkpointing_every_n_layers,
                                       policy=s.activation_checkpointing_policy)


ACTIVATION_CHECKPOINTING = ActivationCheckpointing()
