"""A checkpoint's tensors put into a model as they are read, and the names the checkpoint must hold. The experts'
stacked projections (``[n_experts, out, in]``, :class:`~mtune.modules.expert_linear.ExpertLinear`) are held one key
per expert (the hub's layout): each expert's tensor goes into its row; or, for gpt-oss (:func:`fused_experts`),
whole and transposed under the parameter's own name."""

from __future__ import annotations

import torch
from torch import nn

from mtune.models.gpt_oss.mxfp4 import dequantize_mxfp4
from mtune.modules.expert_linear import ExpertLinear, expert_key, fused_model_name

__all__ = ["fused_experts", "fused_name", "held_names", "place", "read_mxfp4"]

_BLOCKS, _SCALES = "_blocks", "_scales"


def fused_experts(model_or_args) -> bool:
    """Whether the family's checkpoints hold each expert projection whole and transposed (gpt-oss:
    ``DecoderArgs.fused_expert_checkpoint``) rather than one key per expert (:func:`held_names`)."""
    args = getattr(model_or_args, "args", model_or_args)
    return bool(getattr(args, "fused_expert_checkpoint", False))


def fused_name(name: str) -> str | None:
    """A tensor of a checkpoint holding experts whole (gpt-oss) named as the model's: ``...experts.gate_up_proj`` ->
    ``...experts.gate_up_proj.weight``, ``..._bias`` -> ``.bias``, MXFP4's ``..._blocks`` -> ``.weight``; None for
    MXFP4's ``..._scales`` (read with their blocks, :func:`read_mxfp4`); any other name as it is."""
    if ".experts." in name and name.endswith(_SCALES):
        return None
    if ".experts." in name and name.endswith(_BLOCKS):
        name = name.removesuffix(_BLOCKS)
    return fused_model_name(name) or name


def read_mxfp4(f, key: str, open_file, dtype) -> torch.Tensor | None:
    """The expert weight ``[n_experts, out, in]`` an MXFP4 pair holds, dequantized to ``dtype`` (bf16 when None):
    ``key`` (``..._blocks``) from the open safetensors file ``f``, its ``..._scales`` from ``open_file(name)`` (a
    context manager opening the file that holds it); None when ``key`` is not MXFP4 blocks."""
    if not key.endswith(_BLOCKS) or ".experts." not in key:
        return None
    scales_key = key.removesuffix(_BLOCKS) + _SCALES
    with open_file(scales_key) as g:
        scales = g.get_tensor(scales_key)
    return dequantize_mxfp4(f.get_tensor(key), scales, dtype or torch.bfloat16)


def held_names(model: nn.Module, expected: dict[str, torch.Tensor]) -> set[str]:
    """The names a checkpoint holds for ``expected`` (the model's tensors by name): each stacked projection as one
    name per expert (``experts.3.gate_proj.weight``), anything else as is."""
    experts = {f"{name}.{leaf}": m.n_experts for name, m in model.named_modules() if isinstance(m, ExpertLinear)
               for leaf in ("weight", "bias")}
    held = set()
    for name in expected:
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


def place(model: nn.Module, name: str, slot: tuple[str, int] | None, tensor: torch.Tensor, dtype, device,
          arrived: dict[str, int]) -> tuple[str, bool]:
    """Put a tensor read as ``name`` into the model (``slot``: the stacked parameter and expert it is a row of);
    returns the parameter's name and whether it is now whole (every expert arrived)."""
    if slot is None:
        _place(model, name, tensor, dtype, device)
        return name, True
    return slot[0], _place_expert(model, *slot, tensor, dtype, device, arrived)


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
