"""int8 storage of the frozen block linears (``int8_base``), a load-time technique: each frozen weight inside the
blocks is stored as int8 codes with an fp32 scale per output row as it arrives, and upcast to the compute dtype
for the forward that uses it. The implementation: `int8` beside this declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import FitChoice, FitKnob, Footprint, MemoryTechnique, Settings, advice, setting

__all__ = ["Int8Storage", "INT8_STORAGE", "Int8StorageSettings"]


@dataclass(frozen=True)
class Int8StorageSettings(Settings):
    int8_base: bool = setting(False, "store the frozen block linears as int8 with a scale per row, upcast in forward",
                              must_match_on_resume=True)  # the base the adapters trained against


class Int8Storage(MemoryTechnique):
    name = "int8_base"
    Settings = Int8StorageSettings
    fit_knob = FitKnob("int8_base", floor_only=True)

    def enabled(self, s: Int8StorageSettings, memory: Any) -> bool:
        return s.int8_base

    def rules(self, s: Int8StorageSettings, memory: Any) -> list[str]:
        if not s.int8_base:
            return []
        if memory.lora is None:
            return ["int8_base=true stores frozen weights: a full fine-tune has none; use a LoRA recipe"]
        if memory.lora.quantize_base or memory.weight_storage_dtype is not None:
            return ["int8_base=true cannot be combined with lora.quantize_base or weight_storage_dtype: keep one"]
        return []

    def footprint(self, s: Int8StorageSettings, memory: Any, facts: Any) -> Footprint:
        if not s.int8_base:
            return Footprint()
        return Footprint(lossy="int8 base weights", frozen_bytes_per_weight=1.0)

    def fit_choices(self, s: Int8StorageSettings, memory: Any, facts: Any) -> list[FitChoice]:
        if memory.lora is None:
            return [FitChoice(0, {})]
        return [FitChoice(0, {"int8_base": False}),
                FitChoice(1, {"int8_base": True}, lossy=None if s.int8_base else "int8 base weights",
                          quality="fp8_base")]

    def oom_advice(self, s: Int8StorageSettings, memory: Any) -> list[tuple[int, str]]:
        return [] if s.int8_base or memory.lora is None else [advice("qlora", "int8_base=true")]

    def on_model(self, model: Any, s: Int8StorageSettings, memory: Any, placement: Any) -> None:
        from tests._helpers.techniques.int8_storage.int8 import mark_frozen_linears

        mark_frozen_linears(model)

    def weights(self, s: Int8StorageSettings) -> Any:
        from tests._helpers.techniques.int8_storage.int8 import Int8Weights

        return Int8Weights()


INT8_STORAGE = Int8Storage()
