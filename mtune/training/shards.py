"""A full tensor and this rank's shard of it (FSDP2's ``Shard(0)``: the rows ``torch.chunk(weight, world)[rank]``):
for sharded loading (`mtune.training.checkpointing.sharded`), sharded random initialisation and LoRA's sharded
adapters. NF4 weights are split as ``fully_shard`` splits them."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mtune.modules.expert_linear import ExpertLinear


__all__ = ["row_slice", "local_rows", "as_param_like", "assign_tensors", "full_shape"]


def full_shape(model: nn.Module, name: str, tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of the full tensor the model's ``tensor`` (named ``name``) stands for, as checkpoints and
    initializers hold it: its own, except an expert projection held as its NF4 rows (``[n_experts * out, in]``)
    under FSDP2, which stands for ``[n_experts, out, in]``."""
    module_name, _, leaf = name.rpartition(".")
    if leaf == "weight" and isinstance(module := model.get_submodule(module_name), ExpertLinear):
        return module.weight_shape
    return tuple(tensor.shape)


def row_slice(param: DTensor) -> tuple[int, int]:
    """Start and length of this rank's rows of ``param`` (``Shard(0)``, torch.chunk sizes)."""
    rows = param.shape[0]
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def local_rows(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a full tensor (``full`` itself for an unsharded parameter), in memory of their own so
    the full tensor is freed."""
    if not isinstance(param, DTensor):
        return full
    start, length = row_slice(param)
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
