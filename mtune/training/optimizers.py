"""Building the config's optimizer, the low-memory ones included.

`build_optimizer(cfg.optimizer, model, memory)` reads the config node's `_component_` and keyword arguments; a
technique of the run's `MemoryConfig` that steps elsewhere or elsewhen (optimizer-in-backward, optimizer offload)
builds it instead, from the same `OptimizerSpec`. Supported components (AdamW state per parameter element: fp32
2 x 4 bytes):

| `_component_`                        | state bytes / element | notes                                            |
|--------------------------------------|-----------------------|--------------------------------------------------|
| torch.optim.AdamW                    | 8                     | fused on CUDA and CPU unless given               |
| bitsandbytes.optim.AdamW8bit         | ~2                    | blockwise 8-bit states; runs on CPU too          |
| bitsandbytes.optim.PagedAdamW8bit    | ~2                    | states in CUDA unified memory (paged); CPU: unpaged |
| bitsandbytes.optim.PagedAdamW        | 8                     | as above, 32-bit states                          |
| torchao.optim.AdamW8bit              | ~2                    | compiled per parameter shape on first step       |
| torchao.optim.AdamW4bit              | ~1                    | drifts more from AdamW (~36% in 10 steps)         |
| torchao.optim.AdamWFp8               | ~2                    | float8 states                                    |

Optimizer offload supports torch.optim.AdamW (its foreach / fused CPU step); the validator refuses the others
with it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mtune.config import ConfigError, call_component
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.tensor_bytes import tensor_bytes
from mtune.training.placement import Placement

__all__ = ["build_optimizer", "OptimizerSpec", "inner_optimizers", "optimizer_state_bytes", "allocate_adamw_state",
           "SUPPORTED_OPTIMIZERS"]

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS = (
    "torch.optim.AdamW",
    "bitsandbytes.optim.AdamW8bit",
    "bitsandbytes.optim.PagedAdamW8bit",
    "bitsandbytes.optim.PagedAdamW",
    "torchao.optim.AdamW8bit",
    "torchao.optim.AdamW4bit",
    "torchao.optim.AdamWFp8",
)
_warned_paging = False


def _resolve(component: str) -> Callable:
    module_name, _, attr = component.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(
            f"optimizer._component_={component!r} cannot be imported ({err}): use one of {list(SUPPORTED_OPTIMIZERS)}"
        ) from None


@dataclass
class OptimizerSpec:
    """The config's optimizer, not built yet: what a technique that steps elsewhere or elsewhen builds from.
    ``component`` is the dotted path, ``cls`` the class it names, ``kwargs`` the node's other keys, ``device`` the
    device whose defaults apply (fused AdamW on CUDA and CPU)."""

    component: str
    cls: Callable
    kwargs: dict
    device: torch.device

    def kwargs_for(self, device: torch.device) -> dict:
        """The keyword arguments for an optimizer stepping on ``device``: torch's AdamW fused unless the config
        says otherwise."""
        global _warned_paging
        kwargs = dict(self.kwargs)
        if self.component == "torch.optim.AdamW" and "fused" not in kwargs and "foreach" not in kwargs:
            # fused: one kernel per parameter. On CPU it steps a full fine-tune's parameters ~4x faster than foreach
            # (whose ~12 multi-tensor ops each allocate a copy of every state: fresh pages every step) and a LoRA
            # adapter's far more (benchmarks/step_speedups.py).
            kwargs["fused" if device.type in ("cuda", "cpu") else "foreach"] = True
        if ".Paged" in self.component and device.type != "cuda" and not _warned_paging:
            _warned_paging = True
            log.warning("optimizer %s: paging needs CUDA unified memory; on %s its states stay in ordinary memory "
                        "(it runs as the unpaged optimizer)", self.component, device.type)
        return kwargs

    @staticmethod
    def allocate(optimizer: torch.optim.Optimizer) -> None:
        """Create the optimizer's states now where that is known to be exact (torch's AdamW:
        :func:`allocate_adamw_state`)."""
        if type(optimizer) is torch.optim.AdamW:
            allocate_adamw_state(optimizer)


def build_optimizer(
    optimizer_cfg: Mapping[str, Any],
    params_or_model: nn.Module | Iterable[nn.Parameter],
    memory: MemoryConfig = MemoryConfig(),
    *,
    placement: Placement | None = None,
    target_device: torch.device | str | None = None,
    **overrides: Any,
) -> torch.optim.Optimizer:
    """Builds the optimizer the config node describes over the trainable parameters.

    Args:
        optimizer_cfg: mapping with `_component_` (a dotted path, see SUPPORTED_OPTIMIZERS) and its kwargs (lr, ...).
        params_or_model: a model (its parameters with requires_grad) or an iterable of parameters.
        memory: the run's memory settings: a technique that steps elsewhere or elsewhen (in backward, on the host)
            builds the optimizer instead (`mtune.training.memory.phases.wrap_optimizer`).
        placement: the compute device and the host (default: the parameters' device and the CPU).
        target_device: the device whose defaults to use (fused AdamW on CUDA); default: the parameters' device.
            ``mtune plan`` builds a CUDA run's optimizer over fake CPU tensors.
        overrides: keyword arguments that replace the config's.
    """
    cfg = dict(optimizer_cfg)
    component = cfg.pop("_component_", None)
    if component is None:
        raise ConfigError(f"optimizer needs _component_: one of {list(SUPPORTED_OPTIMIZERS)}")
    cfg.update(overrides)
    if isinstance(params_or_model, nn.Module):
        named = [(n, p) for n, p in params_or_model.named_parameters() if p.requires_grad]
    else:
        named = [(str(i), p) for i, p in enumerate(p for p in params_or_model if p.requires_grad)]
    if not named:
        raise ConfigError("the model has no trainable parameters: check lora.modules or the frozen layers")
    device = torch.device(target_device) if target_device else named[0][1].device
    spec = OptimizerSpec(component, _resolve(component), cfg, device)
    wrapped = phases.wrap_optimizer(spec, named, memory, placement or Placement(device))
    if wrapped is not None:
        return wrapped
    optimizer = call_component(spec.cls, component, "optimizer", [p for _, p in named], **spec.kwargs_for(device))
    spec.allocate(optimizer)
    return optimizer


def allocate_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Creates AdamW's per-parameter state now, as its first ``step()`` would (zero moments, step 0), so nothing
    changes numerically. Allocated lazily, the states (2x the trainable weights) land in the holes the first
    step's freed activations left, and the second step's activations must find new memory: on CPU a full
    fine-tune's resident memory then grows by about the states' size over the first steps (glibc keeps the holes);
    on CUDA the caching allocator fragments the same way. Allocated before the first forward, they sit beside the
    weights and activations reuse one region step after step. Parameters that already have state are skipped."""
    for group in optimizer.param_groups:
        step_on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            # where AdamW keeps `step`: on the parameter's device when fused or capturable, else a CPU scalar
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if step_on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def inner_optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    """The optimizers that hold state: a wrapper's (its ``inner_optimizers()``: optimizer-in-backward's
    per-parameter ones), else ``[optimizer]``
    (``[]`` for None). Code that reads or saves optimizer state goes through this, not through the wrapper."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "inner_optimizers", None)  # a wrapper that steps elsewhen holds several
    return list(inner()) if callable(inner) else [optimizer]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in the optimizer's per-parameter state tensors (quantized states and their scales included)."""
    total = 0
    for opt in inner_optimizers(optimizer):
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    total += tensor_bytes(value)
    return total
