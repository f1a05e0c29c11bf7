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


_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
"""The keyword arguments every AdamW ``--fit`` offers takes (torch's, bitsandbytes' 32-bit and 8-bit)."""


def _paged(component: str) -> bool:
    return component.startswith("bitsandbytes.optim.Paged")


def _low_bit(component: str) -> bool:
    return any(mark in component.lower() for mark in ("8bit", "4bit", "fp8"))


class OptimizerState(MemoryTechnique):
    name = "optimizer_state"
    fit_knob = "optimizer"
    fit_saves_floor_only = True

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """torch AdamW; with bitsandbytes installed, on a CUDA target, PagedAdamW (32-bit states in managed memory:
        the same numbers) and PagedAdamW8bit; elsewhere AdamW8bit. Each replaces the optimizer node whole, keeping
        only the keys every AdamW takes (``lr``, ``betas``, ``eps``, ``weight_decay``). 8-bit states are lossy
        unless the user's config already keeps low-bit states."""
        node = get(cfg, "optimizer", {}) or {}
        kept = {key: node[key] for key in _ADAMW_KEYS if key in node and node[key] is not None}
        already_low_bit = self.lossy(cfg) is not None
        lossy = None if already_low_bit else "8-bit optimizer states"

        def choice(level: int, component: str, lossy: str | None = None) -> FitChoice:
            return FitChoice(level, {"optimizer": {"_component_": component, **kept}}, lossy=lossy, quality_cost=2)

        choices = [choice(0, "torch.optim.AdamW")]
        if importlib.util.find_spec("bitsandbytes") is None:
            return choices
        if facts.cuda:
            return choices + [choice(1, "bitsandbytes.optim.PagedAdamW"),
                              choice(2, "bitsandbytes.optim.PagedAdamW8bit", lossy)]
        return choices + [choice(2, "bitsandbytes.optim.AdamW8bit", lossy)]

    def state_home(self, cfg: Any) -> str | None:
        """bitsandbytes' paged optimizers allocate their states in CUDA managed memory."""
        return "managed" if _paged(str(get(cfg, "optimizer._component_", ""))) else None

    def state_bytes_per_element(self, cfg: Any, facts: ModelFacts) -> float | None:
        """AdamW's two moments: in the parameter's dtype for torch's AdamW, fp32 for bitsandbytes' 32-bit states,
        ~2 bytes (one per moment, plus a scale per 256) for 8-bit ones."""
        component = str(get(cfg, "optimizer._component_", ""))
        if _low_bit(component):
            return 2.0 + 8.0 / 256
        if component.startswith("bitsandbytes."):
            return 8.0
        return 2.0 * facts.trainable_bytes / max(1, facts.trainable_numel)

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
