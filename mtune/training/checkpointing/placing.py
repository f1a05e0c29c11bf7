"""A checkpoint's tensors put into a model as they are read, and the names the checkpoint must hold. The experts'
stacked projections (``[n_experts, out, in]``, :class:`~mtune.modules.expert_linear.ExpertLinear`) arrive as the
family's :class:`~mtune.modules.expert_layout.ExpertLayout` holds them: one key per expert (each goes into its row),
whole (gpt-oss: turned by :func:`~mtune.modules.expert_layout.from_checkpoint`, or MXFP4 pairs dequantized by
:func:`read_mxfp4`), or gate and up side by side (Gemma 4: split along dim 1 into ``gate_proj`` and ``up_proj``)."""

from __future__ import annotations

import torch
from torch import nn

from mtune.models.gpt_oss.mxfp4 import dequantize_mxfp4
from mtune.modules.expert_layout import (
    MXFP4_BLOCKS, MXFP4_SCALES, ExpertLayout, expert_key, expert_layout, mxfp4_part, side_by_side_parts,
)
from mtune.modules.expert_linear import ExpertLinear

__all__ = ["expected_tensors", "held_names", "held_shape", "place", "read_mxfp4"]


def read_mxfp4(f, key: str, open_file, dtype, experts: slice | None = None) -> torch.Tensor | None:
    """The expert weight ``[n_experts, out, in]`` an MXFP4 pair holds, dequantized to ``dtype`` (bf16 when None):
    ``key`` (``..._blocks``) from the open safetensors file ``f``, its ``..._scales`` from ``open_file(name)`` (a
    context manager opening the file that holds it); None when ``key`` is not MXFP4 blocks. ``experts``: only
    those experts' rows are read (``[len, out, in]``; an FSDP2 rank's), equal bit for bit to the same rows of the
    whole (the dequantization is elementwise)."""
    if mxfp4_part(key) != "blocks":
        return None
    scales_key = key.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES
    with open_file(scales_key) as g:
        scales = g.get_tensor(scales_key) if experts is None else g.get_slice(scales_key)[experts]
    blocks = f.get_tensor(key) if experts is None else f.get_slice(key)[experts]
    return dequantize_mxfp4(blocks, scales, dtype or torch.bfloat16)


def expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name; a tied lm_head appears once, as embed_tokens."""
    expected = dict(model.named_parameters())
    expected.update((k, v) for k, v in model.state_dict(keep_vars=True).items() if k not in expected)
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        expected.pop("lm_head.weight", None)
    return expected


def held_names(model: nn.Module, expected: dict[str, torch.Tensor]) -> set[str]:
    """The names a checkpoint holds for ``expected`` (the model's tensors by name), as the model's layout holds
    them and the loaders name what they read: each stacked projection as one name per expert
    (``experts.3.gate_proj.weight``), under the side-by-side tensor that holds it, or (whole) as the model names it;
    anything else as is."""
    if expert_layout(model) is ExpertLayout.WHOLE_TRANSPOSED:
        return set(expected)
    experts = {f"{name}.{leaf}": m.n_experts for name, m in model.named_modules() if isinstance(m, ExpertLinear)
               for leaf in ("weight", "bias")}
    gate_up = {part: key for key, parts in side_by_side_parts(model).items() for part in parts}
    held = set()
    for name in expected:
        if name in gate_up:
            held.add(gate_up[name])
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
               gate_up: dict[str, list[str]]) -> tuple[int, ...]:
    """The shape the checkpoint's tensor ``name`` must have: its parameter's, one expert's row of it (``slot``), or
    a side-by-side tensor's (``gate_up``: :func:`~mtune.modules.expert_layout.side_by_side_parts`; ``[n_experts,
    the parts' rows together, in]``)."""
    if name in gate_up:
        first = expected[gate_up[name][0]].shape
        return first[0], sum(expected[part].shape[1] for part in gate_up[name]), first[2]
    return tuple(expected[name].shape) if slot is None else tuple(expected[slot[0]].shape[1:])


def place(model: nn.Module, name: str, slot: tuple[str, int] | None, tensor: torch.Tensor, dtype, device,
          arrived: dict[str, int], gate_up: dict[str, list[str]]) -> list[str]:
    """Put a tensor read as ``name`` into the model (``slot``: the stacked parameter and expert it is a row of; a
    name in ``gate_up``: the stacked weights it holds side by side along dim 1, split here); returns the parameters
    it made whole (a stacked one once its last expert has arrived)."""
    if name in gate_up:
        sizes = [model.get_parameter(part).shape[1] for part in gate_up[name]]
        for part, piece in zip(gate_up[name], tensor.split(sizes, dim=1)):
            _place(model, part, piece.contiguous(), dtype, device)
        return gate_up[name]
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
