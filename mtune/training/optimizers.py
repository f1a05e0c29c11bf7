"""Building optimizers, including the low-memory ones and optimizer-in-backward.

`build_optimizer(cfg.optimizer, model, memory)` reads the config node's `_component_` and keyword arguments, and
the run's `MemoryConfig` for the techniques that act through the optimizer (``optimizer_in_bwd``,
``optimizer_offload``). Supported components (AdamW state per parameter element: fp32 2 x 4 bytes):

| `_component_`                        | state bytes / element | notes                                            |
|--------------------------------------|-----------------------|--------------------------------------------------|
| torch.optim.AdamW                    | 8                     | fused on CUDA and CPU unless given               |
| bitsandbytes.optim.AdamW8bit         | ~2                    | blockwise 8-bit states; runs on CPU too          |
| bitsandbytes.optim.PagedAdamW8bit    | ~2                    | states in CUDA unified memory (paged); CPU: unpaged |
| bitsandbytes.optim.PagedAdamW        | 8                     | as above, 32-bit states                          |
| torchao.optim.AdamW8bit              | ~2                    | compiled per parameter shape on first step       |
| torchao.optim.AdamW4bit              | ~1                    | drifts more from AdamW (~36% in 10 steps)         |
| torchao.optim.AdamWFp8               | ~2                    | float8 states                                    |

``optimizer_offload: cpu`` (`CPUOffloadOptimizer`) supports torch.optim.AdamW (its foreach / fused CPU step); the
validator refuses the others with it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mtune.config.errors import ConfigError
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.techniques.optimizer_offload import OPTIMIZER_OFFLOAD
from mtune.training.memory.tensor_bytes import tensor_bytes
from mtune.training.memory.techniques.optimizer_offload.cpu_optimizer import CPUOffloadOptimizer
from mtune.training.placement import Placement

__all__ = ["build_optimizer", "OptimizerInBackward", "inner_optimizers", "optimizer_state_bytes", "SUPPORTED_OPTIMIZERS"]

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


def _component_kwargs(component: str, kwargs: dict, device: torch.device) -> dict:
    global _warned_paging
    kwargs = dict(kwargs)
    if component == "torch.optim.AdamW" and "fused" not in kwargs and "foreach" not in kwargs:
        # fused: one kernel per parameter. On CPU it steps a full fine-tune's parameters ~4x faster than foreach
        # (whose ~12 multi-tensor ops each allocate a copy of every state: fresh pages every step) and a LoRA
        # adapter's far more (benchmarks/step_speedups.py).
        kwargs["fused" if device.type in ("cuda", "cpu") else "foreach"] = True
    if ".Paged" in component and device.type != "cuda" and not _warned_paging:
        _warned_paging = True
        log.warning("optimizer %s: paging needs CUDA unified memory; on %s its states stay in ordinary memory "
                    "(it runs as the unpaged optimizer)", component, device.type)
    return kwargs


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
        memory: the run's memory keys; ``optimizer_in_bwd``: return an `OptimizerInBackward` (one optimizer per
            parameter, stepped during backward); ``optimizer_offload="cpu"``: return a `CPUOffloadOptimizer` (states
            in host memory, stepped on the CPU; `mtune.training.memory.techniques.optimizer_offload.cpu_optimizer`) when ``placement`` has a
            host distinct from the compute device.
        placement: the compute device and the host (default: the parameters' device and the CPU).
        target_device: the device whose defaults to use (fused AdamW on CUDA); default: the parameters' device.
            ``mtune plan`` builds a CUDA run's optimizer over fake CPU tensors.
        overrides: keyword arguments that replace the config's.
    """
    optimizer_in_bwd, optimizer_offload = memory.optimizer_in_bwd, memory.optimizer_offload
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
    if optimizer_offload is not None:
        placement = placement or Placement(device)
        problems = OPTIMIZER_OFFLOAD.optimizer_problems(optimizer_offload, component, optimizer_in_bwd)
        if problems:  # callers that skip the validator get its own words
            raise ConfigError(problems[0])
        if placement.distinct:
            kwargs = _component_kwargs(component, cfg, placement.host)  # the step runs on the host
            log.info("optimizer_offload=%s: %s states in %s memory, stepped there", optimizer_offload, component,
                     placement.host)
            offloaded = CPUOffloadOptimizer(named, _resolve(component), placement, **kwargs)
            if type(offloaded.optimizer) is torch.optim.AdamW:
                with placement.host_allocation():  # the states live on the host from the start, beside the copies
                    allocate_adamw_state(offloaded.optimizer)
                offloaded.mark_states()
            return offloaded
        log.info("optimizer_offload=%s: the model already computes in host memory (%s): the optimizer runs "
                 "unchanged, nothing is moved", optimizer_offload, placement.compute)
    kwargs = _component_kwargs(component, cfg, device)
    cls = _resolve(component)
    if optimizer_in_bwd:
        return OptimizerInBackward(named, cls, **kwargs)
    optimizer = cls([p for _, p in named], **kwargs)
    if type(optimizer) is torch.optim.AdamW:
        allocate_adamw_state(optimizer)
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
    """The optimizers that hold state: an `OptimizerInBackward`'s per-parameter ones, else ``[optimizer]``
    (``[]`` for None). Code that reads or saves optimizer state goes through this, not through the wrapper."""
    if optimizer is None:
        return []
    if isinstance(optimizer, OptimizerInBackward):
        return list(optimizer.optimizers.values())
    return [optimizer]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in the optimizer's per-parameter state tensors (quantized states and their scales included)."""
    total = 0
    for opt in inner_optimizers(optimizer):
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    total += tensor_bytes(value)
    return total
