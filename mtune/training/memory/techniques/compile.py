"""``compile``: ``torch.compile`` of each transformer block (``block.compile()``), applied last so it compiles the
checkpointed block as a unit; one compile per distinct block, not per model. Not a memory saving by itself
(compiled blocks may keep fewer intermediates); techniques that move weights between uses refuse it."""

from __future__ import annotations

from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import MemoryTechnique

__all__ = ["Compile", "COMPILE"]


class Compile(MemoryTechnique):
    name = "compile"
    keys = (Key("compile", bool, False, "torch.compile each transformer block (faster steps after a slow first one)"),)

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.compile

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> None:
        for block in model.layers:
            block.compile()


COMPILE = Compile()
