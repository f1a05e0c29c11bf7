"""Loading a Hugging Face checkpoint into an FSDP2-sharded model, each rank reading only its own rows.

A shard of a weight is exactly the rows ``torch.chunk(weight, world_size)[rank]``, the slice FSDP2 itself uses
(``Shard(0)``), so it can be read straight out of a safetensors file with ``get_slice``: no rank ever holds a full
weight it does not need. NF4 (QLoRA) weights are the exception: NF4 stores one scale per 64 values and quantizes
those scales against the mean of *all* of them, so each frozen weight is read whole, quantized whole (bit-equal to
single-device QLoRA) and only then chunked; torchao's NF4Tensor chunks into NF4 pieces, and FSDP2 all-gathers
those pieces through NF4Tensor's ``fsdp_pre_all_gather`` hooks.

The helpers that turn a full tensor into this rank's shard (:func:`local_rows`, :func:`as_param_like`,
:func:`assign_tensors`) also serve the sharded initialisation in :mod:`mtune.training.model_setup`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mtune.modules.lora import has_nf4_weight
from mtune.modules.nf4_linear import is_nf4, nf4_row_chunk, quantize_nf4
from mtune.training.checkpointing.hf import CheckpointError, locate_tensors, open_safetensors

__all__ = ["load_hf_checkpoint_sharded", "local_rows", "as_param_like", "assign_tensors"]


def _row_slice(param: DTensor) -> tuple[int, int]:
    """Start and length of this rank's rows of ``param`` (``Shard(0)``, torch.chunk sizes)."""
    rows = param.shape[0]
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def local_rows(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a full tensor (``full`` itself for an unsharded parameter), in memory of their own so
    the full tensor is freed. NF4 is split as ``fully_shard`` splits it (:func:`nf4_row_chunk`)."""
    if not isinstance(param, DTensor):
        return full
    if is_nf4(full):
        return nf4_row_chunk(full, param.device_mesh.size(), param.device_mesh.get_local_rank())
    start, length = _row_slice(param)
    return full.narrow(0, start, length).clone()  # own memory: the full tensor is freed


def as_param_like(local: torch.Tensor, current: torch.Tensor) -> nn.Parameter:
    """A parameter holding the shard ``local`` with the placement and ``requires_grad`` of ``current``."""
    if isinstance(current, DTensor):
        local = DTensor.from_local(local, current.device_mesh, current.placements, run_check=False,
                                   shape=current.shape, stride=current.stride())
    return nn.Parameter(local, requires_grad=current.requires_grad)


def assign_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Put each named tensor into ``model`` in place of the current one (``load_state_dict(assign=True)`` per
    owning module, so FSDP2's post-load hook re-registers the new shard), then re-tie tied weights."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        by_module.setdefault(module_name, {})[leaf] = tensor
    for module_name, state in by_module.items():
        model.get_submodule(module_name).load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


@torch.no_grad()
def load_hf_checkpoint_sharded(
    model: nn.Module,
    checkpoint_dir: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    not_in_checkpoint: Callable[[str], bool] | None = None,
) -> nn.Module:
    """Load a Hugging Face checkpoint into a model sharded by ``fully_shard`` (still on meta, or materialised).

    Each rank reads, one tensor at a time, only its own rows of each weight (safetensors ``get_slice``), casts
    them to ``dtype`` on ``device`` and keeps them as its shard. Frozen weights of NF4 modules (QLoRA) are read
    whole, quantized whole and chunked, so every rank holds NF4 shards equal to single-device QLoRA's rows.
    ``not_in_checkpoint(name)`` marks parameters the checkpoint does not hold (LoRA adapters); they stay as they
    are (meta) until the adapters are initialised. Missing / unexpected keys and wrong shapes raise
    :class:`~mtune.training.checkpointing.hf.CheckpointError` before anything is read.
    """
    device = torch.device(device)
    expected, by_file = locate_tensors(model, checkpoint_dir, not_in_checkpoint)
    loaded: dict[str, nn.Parameter | torch.Tensor] = {}
    for path, entries in by_file.items():
        with open_safetensors(path) as f:
            for name, key in entries:
                current = expected[name]
                view = f.get_slice(key)
                if tuple(view.get_shape()) != tuple(current.shape):
                    raise CheckpointError(f"{path}: tensor {key} has shape {list(view.get_shape())}, the model "
                                          f"expects {list(current.shape)}")
                module_name, _, leaf = name.rpartition(".")
                if leaf == "weight" and has_nf4_weight(model.get_submodule(module_name)):
                    full = quantize_nf4(f.get_tensor(key).to(device=device, dtype=dtype))
                    local = local_rows(full.data, current)
                    del full
                elif isinstance(current, DTensor):
                    start, length = _row_slice(current)
                    local = view[start:start + length].to(device=device, dtype=dtype, copy=True)
                else:
                    local = f.get_tensor(key).to(device=device, dtype=dtype, copy=True)
                loaded[name] = as_param_like(local, current) if isinstance(current, nn.Parameter) else local
    assign_tensors(model, loaded)
    return model
