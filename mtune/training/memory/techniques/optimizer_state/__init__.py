"""Low-bit and paged optimizer states (the ``optimizer`` node's ``_component_``): bitsandbytes' 8-bit AdamW keeps
~2 bytes of state per weight instead of 8, its paged variants keep them in CUDA unified memory, torchao's 8-bit,
4-bit and fp8 AdamW likewise. No key of its own: the optimizer node names it. The implementation: the libraries'
optimizers, built by `mtune.training.optimizers.build_optimizer`."""

from __future__ import annotations

import importlib.util
from typing import Any

from mtune.training.memory.technique import FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, advice

__all__ = ["OptimizerState", "OPTIMIZER_STATE"]

_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
"""The keyword arguments every AdamW ``--fit`` offers takes (torch's, bitsandbytes' 32-bit and 8-bit)."""


def _paged(component: str) -> bool:
    return component.startswith("bitsandbytes.optim.Paged")


def _low_bit(component: str) -> bool:
    return any(mark in component.lower() for mark in ("8bit", "4bit", "fp8"))


class OptimizerState(MemoryTechnique):
    name = "optimizer_state"
    fit_knob = FitKnob("optimizer", floor_only=True)

    def enabled(self, s: Any, memory: Any) -> bool:
        component = memory.run.optimizer_component
        return _paged(component) or _low_bit(component)

    def rules(self, s: Any, memory: Any) -> list[str]:
        """Optimizers that cannot step FSDP2's sharded (DTensor) parameters."""
        component = memory.run.optimizer_component
        if not memory.distributed:
            return []
        if component.startswith("bitsandbytes."):
            return [f"optimizer._component_={component} cannot step FSDP2's sharded parameters (its kernels get "
                    "mixed torch.Tensor and DTensor arguments): use torchao.optim.AdamW8bit for 8-bit states, or "
                    "torch.optim.AdamW"]
        if component == "torchao.optim.AdamW4bit":
            return ["optimizer._component_=torchao.optim.AdamW4bit fails on FSDP2's sharded parameters (its "
                    "compiled 4-bit kernel rejects the DTensor shards): use torchao.optim.AdamW8bit or "
                    "torch.optim.AdamW"]
        return []

    def footprint(self, s: Any, memory: Any, facts: ModelFacts) -> Footprint:
        """AdamW's two moments: in the parameter's dtype for torch's AdamW, fp32 for bitsandbytes' 32-bit states,
        ~2 bytes (one per moment, plus a scale per 256) for 8-bit ones; bitsandbytes' paged optimizers allocate
        their states in CUDA managed memory."""
        component = memory.run.optimizer_component
        if _low_bit(component):
            per_element = 2.0 + 8.0 / 256
        elif component.startswith("bitsandbytes."):
            per_element = 8.0
        else:
            per_element = 2.0 * facts.trainable_bytes / max(1, facts.trainable_numel)
        return Footprint(states_home="managed" if _paged(component) else None, state_bytes_per_element=per_element,
                         lossy="low-bit optimizer states" if _low_bit(component) else None)

    def fit_choices(self, s: Any, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """torch AdamW; with bitsandbytes installed, on a CUDA target, PagedAdamW (32-bit states in managed memory:
        the same numbers) and PagedAdamW8bit; elsewhere AdamW8bit. Each replaces the optimizer node whole, keeping
        only the keys every AdamW takes (``lr``, ``betas``, ``eps``, ``weight_decay``). 8-bit states are lossy
        unless the user's config already keeps low-bit states."""
        node = dict(memory.run.optimizer)
        kept = {key: _yaml(node[key]) for key in _ADAMW_KEYS if node.get(key) is not None}
        lossy = None if _low_bit(memory.run.optimizer_component) else "8-bit optimizer states"

        def choice(level: int, component: str, lossy: str | None = None) -> FitChoice:
            return FitChoice(level, {"optimizer": {"_component_": component, **kept}}, lossy=lossy,
                             quality="low_bit_states")

        choices = [choice(0, "torch.optim.AdamW")]
        if importlib.util.find_spec("bitsandbytes") is None:
            return choices
        if facts.cuda:
            return choices + [choice(1, "bitsandbytes.optim.PagedAdamW"),
                              choice(2, "bitsandbytes.optim.PagedAdamW8bit", lossy)]
        return choices + [choice(2, "bitsandbytes.optim.AdamW8bit", lossy)]

    def oom_advice(self, s: Any, memory: Any) -> list[tuple[int, str]]:
        optimizer = memory.run.optimizer_component.lower()
        if "8bit" not in optimizer and "4bit" not in optimizer and memory.lora is None:
            return [advice("low_bit_states", "optimizer=bitsandbytes.optim.PagedAdamW8bit")]
        return []


def _yaml(value: Any) -> Any:
    """A carried config value back as YAML writes it (tuples as lists)."""
    return list(value) if isinstance(value, tuple) else value


OPTIMIZER_STATE = OptimizerState()
