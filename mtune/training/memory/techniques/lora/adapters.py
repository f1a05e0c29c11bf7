"""LoRA in a run, beside `mtune.modules.lora` (the adapters themselves): QLoRA's NF4 bases quantized as each weight
arrives (so the model never exists whole in the compute dtype), fresh adapters once the base is in (on one device
or sharded), and FSDP2's limit with NF4 said before sharding."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mtune.config.errors import ConfigError
from mtune.modules.expert_linear import LoRAExpertLinear
from mtune.modules.lora import LoRALinear, freeze_base, has_nf4_weight, is_adapter_param, reset_lora_parameters
from mtune.modules.nf4_linear import dequantize, is_nf4, nf4_row_chunk, quantize_nf4, quantize_nf4_expert_shard
from mtune.training.memory.technique import WeightPhases
from mtune.training.shards import as_param_like, assign_tensors, local_rows

__all__ = ["LoraWeights", "check_shardable", "reset_adapters", "reset_adapters_sharded"]


class LoraWeights(WeightPhases):
    """LoRA's weight phases: NF4 bases stored as their weights arrive (from the whole weight under FSDP2, and
    dequantized for a gathered save), fresh adapters once the base is in; adapters are the parameters it adds."""

    def arrived(self, model: nn.Module, module: nn.Module) -> None:
        quantize_on_arrival(module)

    def stored_whole(self, module: nn.Module, leaf: str):
        return nf4_rows if leaf == "weight" and has_nf4_weight(module) else None

    def all_arrived(self, model: nn.Module, sharded: bool, materialized) -> None:
        reset_adapters(model, sharded=sharded, materialized=materialized)

    def added(self, name: str) -> bool:
        return is_adapter_param(name)

    def plain(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """An NF4 tensor (a QLoRA base, or a rank's shard of one) dequantized to its original dtype."""
        return dequantize(tensor) if is_nf4(tensor) else None


def quantize_on_arrival(module: nn.Module) -> None:
    """Store ``module``'s just-arrived weight as NF4 when ``apply_lora`` marked it for an NF4 base."""
    if has_nf4_weight(module) and not is_nf4(module.weight) and not module.weight.is_meta:
        module.weight = quantize_nf4(module.weight)


def nf4_rows(tensor: torch.Tensor, param: torch.Tensor, *, rank_experts: bool = False) -> torch.Tensor:
    """This rank's rows of ``param`` as NF4, bit-equal to one device's rows. ``tensor`` is the whole weight (an
    expert projection's ``[n_experts, out, in]`` stack), quantized whole (its scales are quantized against the mean
    of all of them) and then split as ``fully_shard`` splits NF4; or, ``rank_experts``, only this rank's experts of
    a sharded stack, quantized against the whole stack's mean all the same (a collective:
    :func:`~mtune.modules.nf4_linear.quantize_nf4_expert_shard`). The exception: a dense weight whose 256-scale
    blocks do not split over the ranks has smaller ones (`~mtune.modules.nf4_linear.dense_scaler_block`), so its
    rows are those of ``quantize_nf4(tensor, ranks)``, not one device's."""
    if rank_experts:
        return quantize_nf4_expert_shard(tensor, param.device_mesh.get_group())
    if not isinstance(param, DTensor):
        return quantize_nf4(tensor).data
    ranks = param.device_mesh.size()
    return nf4_row_chunk(quantize_nf4(tensor, ranks).data, ranks, param.device_mesh.get_local_rank())


def check_shardable(lora) -> None:
    """FSDP2's one-rank shortcut unshards a parameter from its first all-gather input only; an NF4 weight has three
    (scalers, factors, codes), so its forward fails: refuse a group of one with NF4 bases."""
    if lora.quantize_base and dist.is_initialized() and dist.get_world_size() == 1:
        raise ConfigError("lora.quantize_base=true under FSDP2 needs at least 2 processes (torch's FSDP2 cannot "
                          "unshard NF4 weights in a group of one): run lora_single_device on one device, or "
                          "launch with --nproc_per_node 2 or more")


def reset_adapters(model: nn.Module, *, sharded: bool, materialized) -> None:
    """Initialise every adapter over the loaded base (zero update) and freeze the base: DoRA magnitudes read the
    base weights, so they are computed inside ``materialized()`` (every offloaded weight on the device)."""
    if sharded:
        reset_adapters_sharded(model)
        return
    dora = any(isinstance(m, LoRALinear) and m.magnitude is not None for m in model.modules())
    with materialized() if dora else contextlib.nullcontext():
        reset_lora_parameters(model)  # adapters start at zero update; NF4 bases are already quantized
    freeze_base(model)


@torch.no_grad()
def reset_adapters_sharded(model: nn.Module) -> None:
    """Initialise every LoRA / DoRA adapter of a sharded model as :meth:`LoRALinear.reset_adapter` does on one
    device (its :meth:`~LoRALinear.adapter_initializers` fill full tensors in module order, each rank keeps its
    rows; DoRA magnitudes are the row norms of the rank's own rows of the base weight), whatever the number of
    ranks. Call after the base weights are loaded, with the same RNG state on every rank; freezes the base."""
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, (LoRALinear, LoRAExpertLinear)):
            continue
        local_weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        for leaf, fill in module.adapter_initializers():
            param = module.get_parameter(leaf)
            full = torch.empty(param.shape, dtype=param.dtype, device=local_weight.device)
            fill(full)
            tensors[f"{name}.{leaf}"] = as_param_like(local_rows(full, param), param)
        if module.magnitude is not None:
            norms = module.row_norms(local_weight).to(module.magnitude.dtype)
            tensors[f"{name}.magnitude"] = as_param_like(norms, module.magnitude)
    assign_tensors(model, tensors)
    freeze_base(model)
