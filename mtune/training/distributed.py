"""Data-parallel training with FSDP2: process groups, sharding, sharded loading and gathered export.

Every rank holds a 1/world_size row slice (``Shard(0)``) of every parameter; FSDP2 all-gathers a block's
parameters just before its forward/backward and reduce-scatters its gradients after. The order a distributed
recipe follows (no rank ever holds the whole model; one full tensor at a time at most):

    rank, world_size, local_rank = init_distributed(cfg.distributed_backend)
    device = device_for_rank(local_rank)
    model, act_ctx = setup_model(source, device=device, dtype=dtype, lora=..., materialize=False)   # meta
    shard_model(model, cpu_offload=...)                        # blocks, then the root
    load_hf_checkpoint_sharded(model, source.checkpoint_dir, dtype=dtype, device=device,
                               not_in_checkpoint=is_adapter_param)   # or init_weights_sharded(model, device)
    if lora: reset_adapters_sharded(model)                     # same values as single-device, whatever the ranks
    ... train with mtune.training.loop.train_step(..., world_size=world_size) ...
    save_gathered_hf_checkpoint(model, out_dir, source_dir=...)   # rank 0 writes

Saving (DCP resume state, gathered HF / PEFT export) lives in :mod:`mtune.training.checkpointing.dcp`.

A shard of a weight is exactly the rows ``torch.chunk(weight, world_size)[rank]``, the slice FSDP2 itself uses, so
it can be read straight out of a safetensors file with ``get_slice``. NF4 (QLoRA) weights are different: NF4 stores
one scale per 64 values and quantizes those scales against the mean of *all* of them, so each frozen weight is read
whole, quantized whole (bit-equal to single-device QLoRA) and only then chunked; torchao's NF4Tensor chunks into
NF4 pieces, and FSDP2 all-gathers those pieces through NF4Tensor's ``fsdp_pre_all_gather`` hooks.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from mtune.modules.lora import ADAPTER_PARAM_NAMES, LoRALinear
from mtune.modules.nf4_linear import FrozenNF4Linear, dequantize, is_nf4, quantize_nf4
from mtune.training.checkpointing.hf import CheckpointError, _expected, _hf_to_mtune, _open, weight_files

__all__ = [
    "init_distributed",
    "destroy_distributed",
    "device_for_rank",
    "is_rank_zero",
    "shard_model",
    "load_hf_checkpoint_sharded",
    "init_weights_sharded",
    "reset_adapters_sharded",
    "local_tensor_bytes",
]

log = logging.getLogger("mtune")


# ------------------------------------------------------------------------------------------------ process group
def init_distributed(backend: str | None = None) -> tuple[int, int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``).

    ``backend`` is the config's ``distributed_backend``: None picks nccl when CUDA is available, else gloo.
    Returns ``(rank, world_size, local_rank)``. A process not launched by torchrun joins a group of one (so a
    distributed recipe also runs, and resumes, in one process). On CUDA the current device becomes
    ``cuda:LOCAL_RANK``.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("distributed_backend=nccl needs CUDA GPUs: set distributed_backend=gloo (or null) on CPU")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" not in os.environ:
        # Not launched by torchrun: a group of one, so the same code (sharding, DCP) runs in a single process.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), local_rank


def destroy_distributed() -> None:
    """Leave the process group (no-op when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def device_for_rank(local_rank: int) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


# ------------------------------------------------------------------------------------------------ sharding
def shard_model(
    model: nn.Module,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    cpu_offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each block of ``model.layers``, then the root (embeddings, final norm, lm_head). In place.

    Gradients are reduce-scattered in ``reduce_dtype`` (fp32 by default, so bf16 gradients are summed without
    rounding); ``param_dtype`` None computes in the storage dtype. ``cpu_offload`` keeps the parameter shards,
    gradients and optimizer step on the CPU (pinned memory only when there is an accelerator). Works on a meta
    model: shard first, then load with :func:`load_hf_checkpoint_sharded` or :func:`init_weights_sharded`.
    """
    kwargs: dict = {
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    }
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _row_slice(param: DTensor) -> tuple[int, int]:
    """Start and length of this rank's rows of ``param`` (``Shard(0)``, torch.chunk sizes)."""
    rows = param.shape[0]
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


def _local_rows(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a full tensor (``full`` itself for an unsharded parameter). NF4 goes through
    NF4Tensor's own ``chunk``, which splits codes and scales into NF4 pieces as ``fully_shard`` does."""
    if not isinstance(param, DTensor):
        return full
    if is_nf4(full):
        return torch.chunk(full, param.device_mesh.size(), dim=0)[param.device_mesh.get_local_rank()]
    start, length = _row_slice(param)
    return full.narrow(0, start, length).clone()  # own memory: the full tensor is freed


def _as_param_like(local: torch.Tensor, current: torch.Tensor) -> nn.Parameter:
    if isinstance(current, DTensor):
        local = DTensor.from_local(local, current.device_mesh, current.placements, run_check=False,
                                   shape=current.shape, stride=current.stride())
    return nn.Parameter(local, requires_grad=current.requires_grad)


def _becomes_nf4(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    return leaf == "weight" and (
        isinstance(module, FrozenNF4Linear) or (isinstance(module, LoRALinear) and module.quantize_base)
    )


@torch.no_grad()
def load_hf_checkpoint_sharded(
    model: nn.Module,
    checkpoint_dir: str | os.PathLike,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    not_in_checkpoint: Callable[[str], bool] | None = None,
) -> nn.Module:
    """Load a Hugging Face checkpoint into a model sharded by :func:`shard_model` (still on meta, or materialised).

    Each rank reads, one tensor at a time, only its own rows of each weight (safetensors ``get_slice``), casts
    them to ``dtype`` on ``device`` and keeps them as its shard. Frozen weights of NF4 modules (QLoRA) are read
    whole, quantized whole and chunked, so every rank holds NF4 shards equal to single-device QLoRA's rows.
    ``not_in_checkpoint(name)`` marks parameters the checkpoint does not hold (LoRA adapters); they stay as they
    are (meta) until :func:`reset_adapters_sharded`. Missing / unexpected keys and wrong shapes raise
    :class:`~mtune.training.checkpointing.hf.CheckpointError` before anything is read.
    """
    device = torch.device(device)
    expected = _expected(model)
    if not_in_checkpoint is not None:
        expected = {k: v for k, v in expected.items() if not not_in_checkpoint(k)}
    listed: dict[str, tuple[Path, str]] = {}
    for path, keys in weight_files(checkpoint_dir).items():
        if keys is None:
            with _open(path) as f:
                keys = list(f.keys())
        listed.update((_hf_to_mtune(key), (path, key)) for key in keys)
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        listed.pop("lm_head.weight", None)
    missing, unexpected = expected.keys() - listed.keys(), listed.keys() - expected.keys()
    if missing or unexpected:
        raise CheckpointError(f"{checkpoint_dir}: checkpoint does not match the model: missing keys "
                              f"{sorted(missing)[:5]}, unexpected keys {sorted(unexpected)[:5]}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (path, key) in listed.items():
        by_file.setdefault(path, []).append((name, key))
    loaded: dict[str, nn.Parameter | torch.Tensor] = {}
    for path, entries in by_file.items():
        with _open(path) as f:
            for name, key in entries:
                current = expected[name]
                view = f.get_slice(key)
                if tuple(view.get_shape()) != tuple(current.shape):
                    raise CheckpointError(f"{path}: tensor {key} has shape {list(view.get_shape())}, the model "
                                          f"expects {list(current.shape)}")
                if _becomes_nf4(model, name):
                    full = quantize_nf4(f.get_tensor(key).to(device=device, dtype=dtype))
                    local = _local_rows(full.data, current)
                    del full
                elif isinstance(current, DTensor):
                    start, length = _row_slice(current)
                    local = view[start:start + length].to(device=device, dtype=dtype, copy=True)
                else:
                    local = f.get_tensor(key).to(device=device, dtype=dtype, copy=True)
                loaded[name] = _as_param_like(local, current) if isinstance(current, nn.Parameter) else local
    _assign(model, loaded)
    return model


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    # load_state_dict(assign=True) per owning module: FSDP2's post-load hook then re-registers the new shard.
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        by_module.setdefault(module_name, {})[leaf] = tensor
    for module_name, state in by_module.items():
        model.get_submodule(module_name).load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


@torch.no_grad()
def init_weights_sharded(model: nn.Module, device: torch.device | str, std: float = 0.02) -> nn.Module:
    """Random weights for a sharded meta model (no checkpoint): normal(0, std) linears and embeddings, zero biases,
    unit norms, the same values on any number of ranks (each full tensor is drawn on every rank from the same
    seed, then sliced). Call ``torch.manual_seed`` first; adapters are left for :func:`reset_adapters_sharded`."""
    tensors = {}
    adapters = set(_adapter_names(model))
    for name, param in model.named_parameters():
        if name in adapters:
            continue
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        if name.endswith("norm.weight"):
            full.fill_(1.0)
        elif name.endswith(".bias"):
            full.zero_()
        else:
            full.normal_(0.0, std)
        if _becomes_nf4(model, name):
            full = quantize_nf4(full).data
        tensors[name] = _as_param_like(_local_rows(full, param), param)
    _assign(model, tensors)
    return model


def _adapter_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.endswith(ADAPTER_PARAM_NAMES)]


@torch.no_grad()
def reset_adapters_sharded(model: nn.Module) -> None:
    """Initialise every LoRA / DoRA adapter of a sharded model exactly as ``reset_lora_parameters`` does on one
    device (A Kaiming-uniform drawn from the global RNG in module order, B zero, DoRA magnitude = row norm of the
    base weight), whatever the number of ranks. Call after the base weights are loaded; every rank must have the
    same RNG state. A DoRA magnitude is sharded by rows like its base weight, so each rank's norms need only its
    own rows."""
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        a, b = module.lora_a.weight, module.lora_b.weight
        full_a = torch.empty(a.shape, dtype=a.dtype, device=_local_device(module.weight))
        nn.init.kaiming_uniform_(full_a, a=math.sqrt(5))
        tensors[f"{name}.lora_a.weight"] = _as_param_like(_local_rows(full_a, a), a)
        local_b = torch.zeros(_local_shape(b), dtype=b.dtype, device=full_a.device)
        tensors[f"{name}.lora_b.weight"] = _as_param_like(local_b, b)
        if module.magnitude is not None:
            weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
            norms = torch.linalg.norm(dequantize(weight).float(), dim=1).to(module.magnitude.dtype)
            tensors[f"{name}.magnitude"] = _as_param_like(norms, module.magnitude)
    _assign(model, tensors)
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith(ADAPTER_PARAM_NAMES))


def _local_device(tensor: torch.Tensor) -> torch.device:
    return tensor.to_local().device if isinstance(tensor, DTensor) else tensor.device


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    if not isinstance(param, DTensor):
        return tuple(param.shape)
    return (_row_slice(param)[1], *param.shape[1:])


def local_tensor_bytes(model: nn.Module) -> int:
    """Bytes this rank stores for the model's parameters and buffers (NF4 shards counted by their parts)."""
    from mtune.training.memory.optimizers import _tensor_bytes

    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += _tensor_bytes(local.data if isinstance(local, nn.Parameter) else local)
    return total
