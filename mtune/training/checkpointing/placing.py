"""A checkpoint's tensors put into a model as they are read, and the names the checkpoint must hold. The experts'
stacked projections (``[n_experts, out, in]``, :class:`~mtune.modules.expert_linear.ExpertLinear`) are held one key
per expert (Qwen3-MoE's and Qwen3.5-MoE's hub layout): each expert's tensor goes into its row. Experts marked
``fused_checkpoint`` (Gemma 4's) are held as transformers 5's modules hold them: ``experts.gate_up_proj [n_experts,
2 * hidden, dim]``, split into ``gate_proj`` and ``up_proj`` on loading and fused again on saving
(:func:`fuse_experts`), and ``experts.down_proj``, the ``down_proj`` weight as it is."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from mtune.modules.expert_linear import ExpertLinear, expert_key
from mtune.modules.moe import Experts

__all__ = ["fuse_experts", "fused_experts", "held_names", "held_shape", "place"]

_FUSED_PART = re.compile(r"^(.*\.experts)\.(gate|up|down)_proj\.weight$")


def fused_experts(model: nn.Module) -> dict[str, list[str]]:
    """For the experts a checkpoint holds fused: the checkpoint's name (``layers.0.experts.gate_up_proj``) -> the
    stacked weights it holds side by side along dim 1 (``[layers.0.experts.gate_proj.weight,
    layers.0.experts.up_proj.weight]``; ``down_proj`` alone)."""
    fused = {}
    for name, m in model.named_modules():
        if isinstance(m, Experts) and m.fused_checkpoint:
            fused[f"{name}.gate_up_proj"] = [f"{name}.gate_proj.weight", f"{name}.up_proj.weight"]
            fused[f"{name}.down_proj"] = [f"{name}.down_proj.weight"]
    return fused


def fuse_experts(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs with every experts' stacked weights as a fused checkpoint holds them:
    ``...experts.gate_proj.weight`` and ``...experts.up_proj.weight`` (the first kept until the second comes) as one
    ``...experts.gate_up_proj``, ``...experts.down_proj.weight`` as ``...experts.down_proj``; others unchanged.
    ValueError naming the experts when one of gate and up never comes."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        match = _FUSED_PART.match(name)
        if match is None:
            yield name, tensor
        elif match[2] == "down":
            yield f"{match[1]}.down_proj", tensor
        else:
            halves = waiting.setdefault(match[1], {})
            halves[match[2]] = tensor
            if len(halves) == 2:
                del waiting[match[1]]
                yield f"{match[1]}.gate_up_proj", torch.cat([halves["gate"], halves["up"]], dim=1)
    if waiting:
        raise ValueError(f"{next(iter(waiting))}: only one of gate_proj and up_proj was given, so its fused "
                         "gate_up_proj cannot be written")


def held_names(model: nn.Module, expected: dict[str, torch.Tensor]) -> set[str]:
    """The names a checkpoint holds for ``expected`` (the model's tensors by name): each stacked projection as one
    name per expert (``experts.3.gate_proj.weight``), anything else as is."""
    experts = {f"{name}.{leaf}": m.n_experts for name, m in model.named_modules() if isinstance(m, ExpertLinear)
               for leaf in ("weight", "bias")}
    fused = {part: key for key, parts in fused_experts(model).items() for part in parts}
    held = set()
    for name in expected:
        if name in fused:
            held.add(fused[name])
        else:
            held.update([expert_key(name, e) for e in range(experts[name])] if name in experts else [name])
    return held


@torch.no_grad()
def _place_expert(model: nn.Module, name: str, expert: int, tensor: torch.Tensor, dtype, device,
                  arrived: dict[str, int]) -> bool:
    """Put one expert's tensor into row ``expert`` of the stacked parameter ``name`` (allocated at its first
    expert when on meta); returns whether every expert has now arrived."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, leaf)
    if current.is_meta or (dtype is not None and current.dtype != dtype):
        value = torch.empty(current.shape, dtype=dtype or tensor.dtype, device=device if current.is_meta
                            else current.device)
        setattr(module, leaf, nn.Parameter(value, requires_grad=current.requires_grad))
        current = getattr(module, leaf)
    current[expert].copy_(tensor)
    arrived[name] = arrived.get(name, 0) + 1
    return arrived[name] == current.shape[0]


def held_shape(name: str, slot: tuple[str, int] | None, expected: dict[str, torch.Tensor],
               fused: dict[str, list[str]]) -> tuple[int, ...]:
    """The shape the checkpoint's tensor ``name`` must have: its parameter's, one expert's row of it (``slot``), or
    a fused experts tensor's (``[n_experts, the parts' rows together, in]``)."""
    if name in fused:
        first = expected[fused[name][0]].shape
        return first[0], sum(expected[part].shape[1] for part in fused[name]), first[2]
    return tuple(expected[name].shape) if slot is None else tuple(expected[slot[0]].shape[1:])


def place(model: nn.Module, name: str, slot: tuple[str, int] | None, tensor: torch.Tensor, dtype, device,
          arrived: dict[str, int], fused: dict[str, list[str]]) -> list[str]:
    """Put a tensor read as ``name`` into the model (``slot``: the stacked parameter and expert it is a row of; a
    name in ``fused``: the stacked weights it holds side by side along dim 1); returns the parameters it made whole
    (a stacked one once its last expert has arrived)."""
    if name in fused:
        sizes = [model.get_parameter(part).shape[1] for part in fused[name]]
        for part, piece in zip(fused[name], tensor.split(sizes, dim=1)):
            _place(model, part, piece.contiguous(), dtype, device)
        return fused[name]
    if slot is None:
        _place(model, name, tensor, dtype, device)
        return [name]
    return [slot[0]] if _place_expert(model, *slot, tensor, dtype, device, arrived) else []


@torch.no_grad()
def _place(model: nn.Module, name: str, tensor: torch.Tensor, dtype, device) -> None:
    """Put ``tensor`` into the parameter ``name``: assigned if the model is on meta, copied otherwise."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, leaf)
    if current.is_meta or (dtype is not None and current.dtype != dtype):
        # copy=True: safetensors hands out tensors backed by the file's memory map; the model must own its memory.
        target = device if current.is_meta else current.device
        value = tensor.to(device=target, dtype=dtype or tensor.dtype, copy=True)
        if isinstance(current, nn.Parameter):
            value = nn.Parameter(value, requires_grad=current.requires_grad)
        setattr(module, leaf, value)
    else:
        current.copy_(tensor)
