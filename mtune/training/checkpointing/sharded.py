"""Loading a Hugging Face checkpoint into an FSDP2-sharded model, each rank reading only its own rows.

A shard of a weight is exactly the rows ``torch.chunk(weight, world_size)[rank]``, the slice FSDP2 itself uses
(``Shard(0)``), so it can be read straight out of a safetensors file with ``get_slice``: no rank ever holds a full
weight it does not need. Weights a memory technique stores from the whole tensor are the exception (``arrives_whole``,
from `mtune.training.memory.phases.arrives_whole`): NF4 stores one scale per 64 values and quantizes those scales
against the mean of *all* of them, so each frozen QLoRA weight is read whole, quantized whole (bit-equal to
single-device QLoRA) and only then chunked; torchao's NF4Tensor chunks into NF4 pieces, and FSDP2 all-gathers
those pieces through NF4Tensor's ``fsdp_pre_all_gather`` hooks.

Experts arrive as the family's :class:`~mtune.modules.expert_layout.ExpertLayout` holds them: a rank reads the keys
of its own experts (one key per expert), or its experts' rows of each whole projection (gpt-oss: turned after
reading; MXFP4 blocks and scales read for those experts alone and dequantized, equal bit for bit to one device's
load), or its experts' rows of each side-by-side tensor (Gemma 4: ``experts.gate_up_proj [n_experts, 2 * hidden,
dim]`` split along dim 1 into ``gate_proj`` and ``up_proj``, ``experts.down_proj`` as ``down_proj``). NF4 experts
(QLoRA with a quantized expert base) are refused for now.

The helpers that turn a full tensor into this rank's shard live in :mod:`mtune.training.shards` (the sharded
initialisation and LoRA's sharded adapters use them too).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mtune.modules.expert_layout import (
    ExpertLayout, checkpoint_shape, expert_layout, from_checkpoint, mxfp4_part, side_by_side_parts, stacked_key,
)
from mtune.training.checkpointing.hf import CheckpointError, checkpoint_keys, locate_tensors, open_safetensors
from mtune.training.checkpointing.placing import held_shape, read_mxfp4
from mtune.training.shards import as_param_like, assign_tensors, row_slice

__all__ = ["load_hf_checkpoint_sharded"]


@torch.no_grad()
def load_hf_checkpoint_sharded(
    model: nn.Module,
    checkpoint_dir: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    not_in_checkpoint: Callable[[str], bool] | None = None,
    arrives_whole: Callable[[nn.Module, str], Callable | None] | None = None,
) -> nn.Module:
    """Load a Hugging Face checkpoint into a model sharded by ``fully_shard`` (still on meta, or materialised).

    Each rank reads, one tensor at a time, only its own rows of each weight (safetensors ``get_slice``), casts
    them to ``dtype`` on ``device`` and keeps them as its shard. A weight for which ``arrives_whole(module, leaf)``
    returns a function (QLoRA's NF4 bases) is read whole and handed to it with the parameter: it stores the whole
    tensor and returns this rank's rows, equal to one device's.
    ``not_in_checkpoint(name)`` marks parameters the checkpoint does not hold (LoRA adapters); they stay as they
    are (meta) until the adapters are initialised. Missing / unexpected keys and wrong shapes raise
    :class:`~mtune.training.checkpointing.hf.CheckpointError` before anything is read.
    """
    device = torch.device(device)
    expected, by_file = locate_tensors(model, checkpoint_dir, not_in_checkpoint)
    layout, gate_up = expert_layout(model), side_by_side_parts(model)
    where = ({k: p for p, keys in checkpoint_keys(checkpoint_dir).items() for k in keys}
             if layout is ExpertLayout.WHOLE_TRANSPOSED else {})  # MXFP4 scales may sit in another file

    def open_scales(key):
        return open_safetensors(where[key])

    loaded: dict[str, nn.Parameter | torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}  # this rank's experts of each stacked projection
    for path, entries in by_file.items():
        with open_safetensors(path) as f:
            for name, key in entries:
                if name in gate_up:
                    loaded.update(_read_side_by_side(model, f, path, key, name, gate_up, expected, arrives_whole,
                                                     dtype, device))
                    continue
                slot = None if name in expected else stacked_key(name)
                if slot is not None:
                    _read_expert(model, f, key, *slot, expected[slot[0]], experts, arrives_whole, dtype, device)
                    continue
                current = expected[name]
                module_name, _, leaf = name.rpartition(".")
                store = arrives_whole(model.get_submodule(module_name), leaf) if arrives_whole else None
                rows = None
                if store is None and isinstance(current, DTensor):
                    start, length = row_slice(current)
                    rows = slice(start, start + length)
                local = _read(f, path, key, name, current, layout, rows, open_scales, dtype)
                if store is not None:
                    local = store(local.to(device=device, dtype=dtype), current)
                else:
                    local = local.to(device=device, dtype=dtype, copy=True)
                loaded[name] = as_param_like(local, current) if isinstance(current, nn.Parameter) else local
    loaded.update((name, as_param_like(local, expected[name])) for name, local in experts.items())
    assign_tensors(model, loaded)
    return model


def _read(f, path, key: str, name: str, current, layout: ExpertLayout, rows: slice | None, open_scales,
          dtype) -> torch.Tensor:
    """The model's tensor ``name`` (or its first-dim ``rows``: a rank's experts or rows) read from ``key`` in the
    model's orientation: turned when held transposed, dequantized (to ``dtype``) when MXFP4 blocks, reading only
    those rows of blocks and scales. CheckpointError when the checkpoint's shape is not the model's."""
    view = f.get_slice(key)
    shape = tuple(view.get_shape())
    mxfp4 = layout is ExpertLayout.WHOLE_TRANSPOSED and mxfp4_part(key) == "blocks"
    if mxfp4:  # [E, out, groups, 16] uint8: 32 values a group
        shape = (*shape[:-2], shape[-2] * 32)
    want = tuple(current.shape) if mxfp4 else checkpoint_shape(name, tuple(current.shape), layout)
    if shape != want:
        raise CheckpointError(f"{path}: tensor {key} has shape {list(shape)}, the model expects {list(want)}")
    if mxfp4:
        return read_mxfp4(f, key, open_scales, dtype, rows)
    # a whole expert projection held [n_experts, in, out] (gpt-oss) is still split by expert, then turned
    return from_checkpoint(name, f.get_tensor(key) if rows is None else view[rows], layout)


def _read_side_by_side(model, f, path, key: str, name: str, gate_up: dict[str, list[str]], expected, arrives_whole,
                       dtype, device) -> dict[str, nn.Parameter]:
    """This rank's experts' rows of the side-by-side tensor ``name`` (``experts.gate_up_proj [n_experts, 2 * hidden,
    dim]``, or ``experts.down_proj``), split along dim 1 into the stacked weights it holds (``gate_up[name]``: gate
    then up), each ``[local experts, rows, in]`` in ``dtype`` on ``device`` as its parameter's local shard."""
    parts = gate_up[name]
    for part in parts:
        _refuse_nf4_experts(model, part, arrives_whole)
    view = f.get_slice(key)
    shape, want = tuple(view.get_shape()), held_shape(name, None, expected, gate_up)
    if shape != want:
        raise CheckpointError(f"{path}: tensor {key} has shape {list(shape)}, the model expects {list(want)}")
    current = expected[parts[0]]
    if isinstance(current, DTensor):
        start, length = row_slice(current)
        tensor = view[start:start + length]  # the expert dim: only this rank's experts are read
    else:
        tensor = f.get_tensor(key)
    pieces = tensor.split([expected[part].shape[1] for part in parts], dim=1)
    # copy=True and contiguous: a piece is a strided view of the read rows (or of the file's memory map)
    return {part: as_param_like(piece.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True),
                                expected[part])
            for part, piece in zip(parts, pieces)}


def _refuse_nf4_experts(model, name: str, arrives_whole) -> None:
    """CheckpointError when the stacked projection ``name`` would be stored as NF4 (read whole and quantized whole):
    its NF4 rows are not split by expert."""
    module_name, _, leaf = name.rpartition(".")
    if arrives_whole is not None and arrives_whole(model.get_submodule(module_name), leaf) is not None:
        raise CheckpointError(f"{name}: NF4 experts cannot be loaded into an FSDP2-sharded model yet (their NF4 "
                              "rows are not split by expert): set lora.quantize_base=false, or train on one device")


def _read_expert(model, f, key, name, expert, current, experts, arrives_whole, dtype, device) -> None:
    """Expert ``expert``'s tensor into this rank's rows (experts) of the stacked projection ``name``; skipped
    unread when another rank holds that expert."""
    _refuse_nf4_experts(model, name, arrives_whole)
    start, length = row_slice(current) if isinstance(current, DTensor) else (0, current.shape[0])
    if not start <= expert < start + length:
        return
    shape = tuple(f.get_slice(key).get_shape())
    if shape != tuple(current.shape[1:]):
        raise CheckpointError(f"tensor {key} has shape {list(shape)}, the model expects {list(current.shape[1:])}")
    if name not in experts:
        experts[name] = torch.empty((length, *current.shape[1:]), dtype=dtype, device=device)
    experts[name][expert - start].copy_(f.get_tensor(key))
