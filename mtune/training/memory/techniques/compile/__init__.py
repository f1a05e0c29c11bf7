"""``compile``: ``torch.compile`` of each transformer block (``block.compile()``), applied last so it compiles the
checkpointed block as a unit; one compile per distinct block, not per model. Not a memory saving by itself
(compiled blocks may keep fewer intermediates); techniques that move weights between uses refuse it in their
rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import Footprint, MemoryTechnique, ModelFacts, Settings, setting

__all__ = ["Compile", "COMPILE", "CompileSettings"]


@dataclass(frozen=True)
class CompileSettings(Settings):
    compile: bool = setting(False, "torch.compile each transformer block (faster steps after a slow first one)")


class Compile(MemoryTechnique):
    name = "compile"
    Settings = CompileSettings

    def enabled(self, s: CompileSettings, memory: Any) -> bool:
        return s.compile

    def footprint(self, s: CompileSettings, memory: Any, facts: ModelFacts) -> Footprint:
        if not s.compile:
            return Footprint()
        return Footprint(not_planned="compile=true is planned eagerly: compiled blocks may hold fewer intermediates")

    def on_model(self, model: Any, s: CompileSettings, memory: Any, placement: Any) -> None:
        for block in model.layers:
            block.compile()


COMPILE = Compile()
