"""Activation checkpointing of transformer blocks (``enable_activation_checkpointing``): a checkpointed block keeps
only its input in forward and recomputes its internals in backward, whole (``block``) or all but its matmul and
attention outputs (``selective_op``). The implementation: `mtune.training.memory.activation_checkpointing`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import FitChoice, MemoryTechnique, ModelFacts, get

__all__ = ["ActivationCheckpointing", "ACTIVATION_CHECKPOINTING", "ACTIVATION_CHECKPOINTING_POLICIES"]

ACTIVATION_CHECKPOINTING_POLICIES = ("block", "selective_op")
"""The values of ``activation_checkpointing_policy``."""


class ActivationCheckpointing(MemoryTechnique):
    name = "activation_checkpointing"
    keys = (
        Key("enable_activation_checkpointing", bool, False, "recompute block activations in the backward pass"),
        Key("activation_checkpointing_every_n_layers", int, 1, "checkpoint every Nth transformer block", at_least=1),
        Key("activation_checkpointing_policy", str, "block",
            "block: recompute each checkpointed block whole; selective_op: keep the matmul and attention outputs "
            "and recompute only the cheap ops between them", choices=ACTIVATION_CHECKPOINTING_POLICIES),
    )
    fit_knob = "activation_checkpointing"

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.enable_activation_checkpointing

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> None:
        from mtune.training.memory.activation_checkpointing import apply_activation_checkpointing

        apply_activation_checkpointing(model, every_n_layers=memory.activation_checkpointing_every_n_layers,
                                       policy=memory.activation_checkpointing_policy)

    def describe(self, memory: Any, lora: Any = None) -> str:
        if not memory.enable_activation_checkpointing:
            return "off"
        return (f"{memory.activation_checkpointing_policy}, every {memory.activation_checkpointing_every_n_layers} "
                "layer(s)")

    def planning_blocks(self, cfg: Any) -> int:
        """Every Nth block checkpointed repeats every N blocks."""
        if not get(cfg, "enable_activation_checkpointing", False):
            return 1
        return int(get(cfg, "activation_checkpointing_every_n_layers", 1))

    def layer_policies(self, memory: Any, n_layers: int) -> list[str | None]:
        """Each block's policy (``block``, ``selective_op``) or None, as :meth:`apply` would checkpoint
        ``n_layers`` blocks under ``memory`` (the FLOPs counter reads recomputation from this)."""
        if not memory.enable_activation_checkpointing:
            return [None] * n_layers
        every = int(memory.activation_checkpointing_every_n_layers)
        return [memory.activation_checkpointing_policy if i % every == 0 else None for i in range(n_layers)]

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """None, then (full fine-tunes) selective_op on every block, block checkpointing of every 2nd block, of
        every block, and of every block with its input offloaded (``enable_activation_offloading`` is a level of
        this knob). selective_op keeps ~56% of a block's activations (the matmul outputs), more than block
        checkpointing of every 2nd block keeps; with LoRA on a frozen base it can keep more than no checkpointing
        at all (backward needs none of the frozen matmuls' outputs), so it is searched only for full fine-tunes."""
        block = {"activation_checkpointing_policy": "block", "enable_activation_offloading": False}
        every = {"enable_activation_checkpointing": True, "activation_checkpointing_every_n_layers": 1}
        choices = [FitChoice(0, {"enable_activation_checkpointing": False, **block})]
        if cfg.get("lora") is None:
            choices.append(FitChoice(1, {**every, "activation_checkpointing_policy": "selective_op",
                                         "enable_activation_offloading": False}))
        if facts.n_layers >= 2:
            choices.append(FitChoice(2, {**every, "activation_checkpointing_every_n_layers": 2, **block}))
        choices.append(FitChoice(3, {**every, **block}))
        choices.append(FitChoice(4, {**every, **block, "enable_activation_offloading": True}))
        return choices

    def rules(self, cfg: Any) -> list[str]:
        """A policy says how checkpointed blocks recompute; it needs checkpointing to be on."""
        policy = get(cfg, "activation_checkpointing_policy", "block")
        if policy != "block" and not get(cfg, "enable_activation_checkpointing", False):
            return [f"activation_checkpointing_policy={policy} needs enable_activation_checkpointing=true (the policy "
                    "chooses what checkpointed blocks keep): set enable_activation_checkpointing=true or "
                    "activation_checkpointing_policy=block"]
        return []

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        return [] if cfg.get("enable_activation_checkpointing") else [(10, "enable_activation_checkpointing=true")]


ACTIVATION_CHECKPOINTING = ActivationCheckpointing()
