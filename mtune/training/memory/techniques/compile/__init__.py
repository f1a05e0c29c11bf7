"""``compile``: ``torch.compile`` of each transformer block (``block.compile()``), applied last so it compiles the
checkpointed block as a unit; one compile per distinct block, not per model. Not a memory saving by itself, but a
compiled block keeps fewer intermediates for backward than an eager one: AOT autograd's partitioner saves what is
cheapest to keep and recomputes the rest inside the block's backward. Techniques that move weights between uses
refuse it in their rules.

Planned compiled (`Footprint.compiles`: the plan compiles the same blocks with the partitioner alone,
`mtune.training.planning.fake_mode`), except with activation checkpointing: a checkpointed block keeps its input
either way, and its recompute runs under a higher-order op the planner's byte tracker does not take, so those blocks
are planned eagerly and the plan says so."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import Footprint, MemoryTechnique, ModelFacts, Settings, setting
from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING

__all__ = ["Compile", "COMPILE", "CompileSettings"]


@dataclass(frozen=True)
class CompileSettings(Settings):
    compile: bool = setting(False, "torch.compile each transformer block (faster steps after a slow first one)")


def _eager_plan_reason(memory: Any) -> str | None:
    """Why a plan runs the compiled blocks eagerly, or None when it compiles them as the run does."""
    if memory[ACTIVATION_CHECKPOINTING].enable_activation_checkpointing:
        return ("compile=true with activation checkpointing is planned eagerly: a checkpointed block keeps its "
                "input either way")
    from torch.utils._python_dispatch import TorchDispatchMode

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):  # the byte tracker cannot see compiled code
        return "compile=true is planned eagerly on this torch: compiled blocks may hold fewer intermediates"
    return None


class Compile(MemoryTechnique):
    name = "compile"
    Settings = CompileSettings

    def enabled(self, s: CompileSettings, memory: Any) -> bool:
        return s.compile

    def footprint(self, s: CompileSettings, memory: Any, facts: ModelFacts) -> Footprint:
        if not s.compile:
            return Footprint()
        reason = _eager_plan_reason(memory)
        return Footprint(not_planned=reason) if reason else Footprint(compiles=True)

    def on_model(self, model: Any, s: CompileSettings, memory: Any, placement: Any) -> None:
        for block in model.layers:
            block.compile()


COMPILE = Compile()
