"""Data-parallel training with FSDP2: the process group and the sharding of a built model.

Every rank holds a 1/world_size row slice (``Shard(0)``) of every parameter; FSDP2 all-gathers a block's
parameters just before its forward/backward and reduce-scatters its gradients after. A distributed recipe calls
:func:`init_distributed`, then :func:`mtune.training.model_setup.setup_sharded_model`, which builds the model on
the meta device, applies the memory techniques, shards it with :func:`shard_model` and only then loads each rank's
rows of the checkpoint (:mod:`mtune.training.checkpointing.sharded`), so no rank ever holds the whole model.
Checkpoints of sharded models (DCP resume state, gathered Hugging Face export) are written by
:mod:`mtune.training.checkpointing.dcp`.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mtune.config.errors import ConfigError
from mtune.modules.expert_linear import ExpertLinear
from mtune.modules.lora import has_nf4_weight
from mtune.modules.nf4_linear import NF4_SCALER_BLOCK, dense_scaler_block

__all__ = ["init_distributed", "destroy_distributed", "shard_model", "all_reduce"]

log = logging.getLogger(__name__)


def all_reduce(value: torch.Tensor, op=None) -> torch.Tensor:
    """Reduce ``value`` in place over all ranks (sum by default); unchanged without a process group."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=op or dist.ReduceOp.SUM)
    return value


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
        raise ConfigError("distributed_backend=nccl needs CUDA GPUs: set distributed_backend=gloo (or null) on CPU")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if "WORLD_SIZE" not in os.environ:
        # Not launched by torchrun: a group of one, so the same code (sharding, DCP) runs in a single process.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), local_rank


def destroy_distributed() -> None:
    """Leave the process group (no-op when there is none), once every rank is here: none closes its connections
    while a peer may still be using them.

    The group's gloo threads may outlive this call: DTensor's caches (sharding propagation, redistribute plans) keep
    device meshes, and through them the group, past ``destroy_process_group``. A torchrun worker therefore ends
    without the interpreter's teardown (``mtune._cli.launch_recipe``), where freeing the group beside everything else
    aborted 2-rank CPU runs now and then (``terminate called without an active exception``)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ sharding
def shard_model(
    model: nn.Module,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    **options,
) -> nn.Module:
    """``fully_shard`` each block of ``model.layers``, then the root (embeddings, final norm, lm_head). In place.

    ``reshard_after_forward`` applies to the blocks. The root always stays gathered from its forward to the end of
    backward (FSDP2's own default for a root): backward needs its weights first anyway, and the loss calls
    ``model.lm_head`` after the forward has returned (``ChunkedCrossEntropyLoss``), which must see whole weights.

    Gradients are reduce-scattered in ``reduce_dtype`` (fp32 by default, so bf16 gradients are summed without
    rounding); ``param_dtype`` None computes in the storage dtype. ``options`` are further ``fully_shard``
    arguments, as the memory techniques give them (`mtune.training.memory.phases.sharding_options`: CPU offload's
    ``offload_policy``). Works on a meta
    model: shard first, then load with
    :func:`mtune.training.checkpointing.sharded.load_hf_checkpoint_sharded`.
    """
    kwargs: dict = {
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        **options,
    }
    _prepare_nf4(model)
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return model


def _prepare_nf4(model: nn.Module) -> None:
    """Every weight QLoRA stores as NF4 checked to split evenly over the ranks, and every expert projection among
    them held as its ``[n_experts * out, in]`` rows before sharding
    (:meth:`~mtune.modules.expert_linear.ExpertLinear.hold_nf4_rows_`). FSDP2 splits an NF4 weight's codes, scales
    and second-level factors alike, so a rank's rows must be whole experts (each expert's codes and scales are a
    block of their own) or, for a dense weight, whole 64-value blocks and whole second-level blocks: where torchao's
    256 scales a block do not split, the weight takes smaller blocks (`dense_scaler_block`), logged once with the
    weights it concerns. ConfigError naming the weight otherwise, before anything is read."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    smaller: dict[tuple[tuple[int, ...], int], list[str]] = {}  # (shape, scaler block) -> the weights
    for name, module in model.named_modules():
        if not has_nf4_weight(module):
            continue
        if isinstance(module, ExpertLinear):
            if module.n_experts % ranks:
                raise ConfigError(f"{name}.weight: its {module.n_experts} experts do not split evenly over {ranks} "
                                  "ranks, which NF4 experts (lora.quantize_base=true) under FSDP2 need: launch a "
                                  "number of processes that divides the experts, or set lora.quantize_base=false")
            module.hold_nf4_rows_()
            continue
        shape = tuple(module.weight.shape)
        try:
            scaler_block = dense_scaler_block(shape, ranks)
        except ConfigError as error:
            raise ConfigError(f"{name}.weight: {error}") from None
        if scaler_block != NF4_SCALER_BLOCK:
            smaller.setdefault((shape, scaler_block), []).append(name)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for (shape, scaler_block), names in smaller.items():
            kinds = ", ".join(sorted({name.split(".", 2)[-1] for name in names}))  # without layers.<i>.
            log.info(f"NF4 on {ranks} ranks: {len(names)} weights {list(shape)} ({kinds}) quantize their scales in "
                     f"blocks of {scaler_block}, not {NF4_SCALER_BLOCK}, whose blocks do not split over the ranks: "
                     "finer, and other values than one device's")
