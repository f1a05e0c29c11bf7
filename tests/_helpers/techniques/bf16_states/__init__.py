"""AdamW with its moments kept in bf16 between steps (``bf16_optimizer_states``), an optimizer-side technique: the
states are upcast to fp32 for each step and stored as bf16 after it, half of fp32 AdamW's 8 bytes a weight. The
implementation: `wrapper` beside this declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import FitChoice, FitKnob, Footprint, MemoryTechnique, Settings, advice, setting

__all__ = ["Bf16States", "BF16_STATES", "Bf16StatesSettings"]


@dataclass(frozen=True)
class Bf16StatesSettings(Settings):
    bf16_optimizer_states: bool = setting(False, "keep torch.optim.AdamW's moments in bf16 between steps",
                                          must_match_on_resume=True)  # the saved states' dtype


class Bf16States(MemoryTechnique):
    name = "bf16_optimizer_states"
    Settings = Bf16StatesSettings
    fit_knob = FitKnob("bf16_optimizer_states", floor_only=True)

    def enabled(self, s: Bf16StatesSettings, memory: Any) -> bool:
        return s.bf16_optimizer_states

    def rules(self, s: Bf16StatesSettings, memory: Any) -> list[str]:
        if s.bf16_optimizer_states and memory.run.optimizer_component != "torch.optim.AdamW":
            return [f"bf16_optimizer_states=true needs optimizer._component_=torch.optim.AdamW, not "
                    f"{memory.run.optimizer_component}"]
        if s.bf16_optimizer_states and (memory.optimizer_in_bwd or memory.optimizer_offload):
            return ["bf16_optimizer_states=true cannot be combined with optimizer_in_bwd or optimizer_offload"]
        return []

    def footprint(self, s: Bf16StatesSettings, memory: Any, facts: Any) -> Footprint:
        if not s.bf16_optimizer_states:
            return Footprint()
        return Footprint(state_bytes_per_element=4.0, lossy="bf16 optimizer states")  # two moments, 2 bytes each

    def fit_choices(self, s: Bf16StatesSettings, memory: Any, facts: Any) -> list[FitChoice]:
        return [FitChoice(0, {"bf16_optimizer_states": False}),
                FitChoice(1, {"bf16_optimizer_states": True},
                          lossy=None if s.bf16_optimizer_states else "bf16 optimizer states",
                          quality="low_bit_states")]

    def oom_advice(self, s: Bf16StatesSettings, memory: Any) -> list[tuple[int, str]]:
        return [] if s.bf16_optimizer_states else [advice("low_bit_states", "bf16_optimizer_states=true")]

    def wrap_optimizer(self, spec: Any, named_params: list, s: Bf16StatesSettings, memory: Any,
                       placement: Any) -> Any:
        from tests._helpers.techniques.bf16_states.wrapper import Bf16StateOptimizer

        return Bf16StateOptimizer(named_params, spec.cls, spec.allocate, **spec.kwargs_for(spec.device))


BF16_STATES = Bf16States()
