"""Low-bit and paged optimizer states (the ``optimizer`` node's ``_component_``): bitsandbytes' 8-bit AdamW keeps
~2 bytes of state per weight instead of 8, its paged variants keep them in CUDA unified memory, torchao's 8-bit,
4-bit and fp8 AdamW likewise. No key of its own: the optimizer node names it. The implementation: the libraries',
built by `mtune.training.memory.optimizers.build_optimizer`."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from mtune.training.memory.technique import FitChoice, MemoryTechnique, ModelFacts, get

__all__ = ["OptimizerState", "OPTIMIZER_STATE"]


def _low_bit(component: str) -> bool:
    return any(mark in component.lower() for mark in ("8bit", "4bit", "fp8"))


class OptimizerState(MemoryTechnique):
    name = "optimizer_state"
    fit_knob = "optimizer"

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """AdamW with fp32 states, then bitsandbytes' 8-bit AdamW when bitsandbytes is installed."""
        choices = [FitChoice(0, {"optimizer._component_": "torch.optim.AdamW"})]
        if importlib.util.find_spec("bitsandbytes") is None:
            return choices
        return choices + [FitChoice(1, {"optimizer._component_": "bitsandbytes.optim.AdamW8bit"},
                                    lossy="8-bit optimizer states")]

    def distributed_rules(self, cfg: Any) -> list[str]:
        """Optimizers that cannot step FSDP2's sharded (DTensor) parameters."""
        component = str(get(cfg, "optimizer._component_", ""))
        if component.startswith("bitsandbytes."):
            return [f"optimizer._component_={component} cannot step FSDP2's sharded parameters (its kernels get "
                    "mixed torch.Tensor and DTensor arguments): use torchao.optim.AdamW8bit for 8-bit states, or "
                    "torch.optim.AdamW"]
        if component == "torchao.optim.AdamW4bit":
            return ["optimizer._component_=torchao.optim.AdamW4bit fails on FSDP2's sharded parameters (its "
                    "compiled 4-bit kernel rejects the DTensor shards): use torchao.optim.AdamW8bit or "
                    "torch.optim.AdamW"]
        return []

    def lossy(self, cfg: Any) -> str | None:
        component = str(get(cfg, "optimizer._component_", ""))
        return "low-bit optimizer states" if _low_bit(component) else None

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        optimizer = str((cfg.get("optimizer") or {}).get("_component_", ""))
        if "8bit" not in optimizer.lower() and "4bit" not in optimizer.lower() and cfg.get("lora") is None:
            return [(60, "optimizer=bitsandbytes.optim.PagedAdamW8bit")]
        return []


OPTIMIZER_STATE = OptimizerState()
