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
(QLoRA with a quantized expert base) are read the same way, each rank its own experts, though their scales are
centred on the mean of the whole projection's: the store all-gathers the ranks' first-level scales for it (a
collective, so every rank stores the stacks in the checkpoint's order, each once its own experts are in) and keeps
this rank's rows of the NF4 tensor one device would make, which FSDP2 holds as ``[n_experts * out, in]``
(`mtune.training.distributed.shard_model`).

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
from mtune.training.shards import as_param_like, assign_tensors, full_shape, local_rows, row_slice

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
    tensor and returns this rank's rows, equal to one device's; a sharded expert stack is handed this rank's
    experts alone (``rank_experts=True``), every rank in the same order.
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

    def stored_whole(name: str) -> Callable | None:
        module_name, _, leaf = name.rpartition(".")
        return arrives_whole(model.get_submodule(module_name), leaf) if arrives_whole else None

    def by_experts(name: str) -> bool:  # a sharded expert stack stored from each rank's own experts (NF4)
        return (isinstance(expected.get(name), DTensor) and stored_whole(name) is not None
                and len(full_shape(model, name, expected[name])) == 3)

    # Expert stacks stored by experts are quantized with a collective (their scales' mean is the whole stack's), so
    # every rank stores them in one order, the checkpoint's (the same on every rank), each once its own experts are in.
    order = list(dict.fromkeys(target for entries in by_file.values() for name, _ in entries
                               for target in gate_up.get(name, [(stacked_key(name) or (name,))[0]])
                               if by_experts(target)))
    ready: dict[str, torch.Tensor] = {}  # this rank's experts of a stack in order, read but not yet stored

    def store_ready() -> None:
        while order and order[0] in ready:
            name = order.pop(0)
            local = stored_whole(name)(ready.pop(name), expected[name], rank_experts=True)
            loaded[name] = as_param_like(local, expected[name])

    loaded: dict[str, nn.Parameter | torch.Tensor] = {}
    experts: dict[str, torch.Tensor] = {}  # this rank's experts (all of them, to store whole) of each stack
    arrived: dict[str, int] = {}  # experts read into each projection stored whole or by experts so far
    for path, entries in by_file.items():
        with open_safetensors(path) as f:
            for name, key in entries:
                if name in gate_up:
                    kept, by_rank = _read_side_by_side(model, f, path, key, name, gate_up, expected, stored_whole,
                                                       by_experts, dtype, device)
                    loaded.update(kept)
                    ready.update(by_rank)
                    store_ready()
                    continue
                slot = None if name in expected else stacked_key(name)
                if slot is not None:
                    stacked, store = slot[0], stored_whole(slot[0])
                    current, shape = expected[stacked], full_shape(model, stacked, expected[stacked])
                    if by_experts(stacked):
                        start, length = _own_experts(current, shape[0])
                    elif store is not None:  # stored whole (an unsharded NF4 stack): every expert, on the host
                        start, length = 0, shape[0]
                    else:
                        start, length = row_slice(current) if isinstance(current, DTensor) else (0, shape[0])
                    read = _read_expert(f, key, *slot, start, length, shape, experts, dtype,
                                        "cpu" if store is not None and not by_experts(stacked) else device)
                    if not read or store is None:
                        continue
                    arrived[stacked] = arrived.get(stacked, 0) + 1
                    if arrived[stacked] < length:
                        continue
                    if by_experts(stacked):  # its last own expert
                        ready[stacked] = experts.pop(stacked)
                        store_ready()
                    else:
                        loaded[stacked] = as_param_like(store(experts.pop(stacked).to(device), current), current)
                    continue
                current = expected[name]
                store = stored_whole(name)
                rows = None
                if by_experts(name):
                    start, length = _own_experts(current, full_shape(model, name, current)[0])
                    rows = slice(start, start + length)
                elif store is None and isinstance(current, DTensor):
                    start, length = row_slice(current)
                    rows = slice(start, start + length)
                local = _read(f, path, key, name, full_shape(model, name, current), layout, rows, open_scales, dtype)
                if by_experts(name):
                    ready[name] = local.to(device=device, dtype=dtype)
                    store_ready()
                    continue
                if store is not None:
                    local = store(local.to(device=device, dtype=dtype), current)
                else:
                    local = local.to(device=device, dtype=dtype, copy=True)
                loaded[name] = as_param_like(local, current) if isinstance(current, nn.Parameter) else local
    if order:
        raise CheckpointError(f"{checkpoint_dir}: {order[0]}: not every expert of this rank was read")
    loaded.update((name, as_param_like(local, expected[name])) for name, local in experts.items())
    assign_tensors(model, loaded)
    return model


def _own_experts(current: DTensor, n_experts: int) -> tuple[int, int]:
    """First expert and count of this rank's experts of a stack held as its NF4 rows (the ranks divide the
    experts: `mtune.training.distributed.shard_model`)."""
    ranks, rank = current.device_mesh.size(), current.device_mesh.get_local_rank()
    return rank * (n_experts // ranks), n_experts // ranks


def _read(f, path, key: str, name: str, model_shape: tuple[int, ...], layout: ExpertLayout, rows: slice | None,
          open_scales, dtype) -> torch.Tensor:
    """The model's tensor ``name`` of full shape ``model_shape`` (or its first-dim ``rows``: a rank's experts or
    rows) read from ``key`` in the model's orientation: turned when held transposed, dequantized (to ``dtype``) when
    MXFP4 blocks, reading only those rows of blocks and scales. CheckpointError when the checkpoint's shape is not
    the model's."""
    view = f.get_slice(key)
    shape = tuple(view.get_shape())
    mxfp4 = layout is ExpertLayout.WHOLE_TRANSPOSED and mxfp4_part(key) == "blocks"
    if mxfp4:  # [E, out, groups, 16] uint8: 32 values a group
        shape = (*shape[:-2], shape[-2] * 32)
    want = model_shape if mxfp4 else checkpoint_shape(name, model_shape, layout)
    if shape != want:
        raise CheckpointError(f"{path}: tensor {key} has shape {list(shape)}, the model expects {list(want)}")
    if mxfp4:
        return read_mxfp4(f, key, open_scales, dtype, rows)
    # a whole expert projection held [n_experts, in, out] (gpt-oss) is still split by expert, then turned
    return from_checkpoint(name, f.get_tensor(key) if rows is None else view[rows], layout)


def _read_side_by_side(model, f, path, key: str, name: str, gate_up: dict[str, list[str]], expected, stored_whole,
                       by_experts, dtype, device) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """This rank's experts' rows of the side-by-side tensor ``name`` (``experts.gate_up_proj [n_experts, 2 * hidden,
    dim]``, or ``experts.down_proj``), split along dim 1 into the stacked weights it holds (``gate_up[name]``: gate
    then up), each ``[local experts, rows, in]`` in ``dtype`` on ``device``. Returns ``(parameters made, this rank's
    experts of the parts stored by experts)``: a part stored by experts (``by_experts(part)``: NF4) is left to the
    caller; one stored whole (``stored_whole(part)``, unsharded) is read whole and handed to its store."""
    parts = gate_up[name]
    full = {part: torch.empty(full_shape(model, part, expected[part]), device="meta") for part in parts}
    stores = {part: stored_whole(part) for part in parts}
    view = f.get_slice(key)
    shape, want = tuple(view.get_shape()), held_shape(name, None, full, gate_up)
    if shape != want:
        raise CheckpointError(f"{path}: tensor {key} has shape {list(shape)}, the model expects {list(want)}")
    current = expected[parts[0]]
    ranked = {part for part in parts if by_experts(part)}
    whole = not ranked and (not isinstance(current, DTensor) or any(store is not None for store in stores.values()))
    if whole:
        tensor = f.get_tensor(key)
    else:  # the expert dim: only this rank's experts are read
        start, length = _own_experts(current, shape[0]) if ranked else row_slice(current)
        tensor = view[start:start + length]
    kept, by_rank = {}, {}
    for part, piece in zip(parts, tensor.split([full[part].shape[1] for part in parts], dim=1)):
        # copy=True and contiguous: a piece is a strided view of the read rows (or of the file's memory map)
        local = piece.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        if part in ranked:
            by_rank[part] = local
            continue
        if stores[part] is not None:
            local = stores[part](local, expected[part])
        elif whole:
            local = local_rows(local, expected[part])
        kept[part] = as_param_like(local, expected[part])
    return kept, by_rank


def _read_expert(f, key, name, expert, start: int, length: int, shape: tuple[int, ...], experts, dtype,
                 device) -> bool:
    """Expert ``expert``'s tensor into ``experts[name]``, the experts ``start`` to ``start + length`` of the stacked
    projection ``name`` of full ``shape`` (in ``dtype`` on ``device``); False, unread, for another rank's expert."""
    if not start <= expert < start + length:
        return False
    got = tuple(f.get_slice(key).get_shape())
    if got != tuple(shape[1:]):
        raise CheckpointError(f"tensor {key} has shape {list(got)}, the model expects {list(shape[1:])}")
    if name not in experts:
        experts[name] = torch.empty((length, *shape[1:]), dtype=dtype, device=device)
    experts[name][expert - start].copy_(f.get_tensor(key))
    return True
