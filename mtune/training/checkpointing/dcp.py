"""Saving a sharded model: resume state written by every rank with ``torch.distributed.checkpoint`` (DCP), and the
gathered Hugging Face / PEFT export written by rank 0 one tensor at a time.

Resume state:

DCP stores each rank's shards with their global offsets, so a checkpoint saved on N ranks loads on M ranks (or in
one process without a process group): each rank reads the rows it now owns. LoRA runs store only the trainable
adapter parameters and their optimizer state; the frozen base (possibly NF4) comes from the base checkpoint again.

Layout: ``<dir>/`` holds DCP's ``.metadata`` and ``__<rank>_0.distcp`` files, with two top-level entries,
``model`` and ``optim``. Optimizer state is keyed by parameter name (DCP's ``get_state_dict``), not by position,
so it does not depend on how parameters are grouped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from mtune.errors import PathNotFoundError
from mtune.modules.lora import is_adapter_param
from mtune.modules.lora_experts_peft import adapted_experts, expert_peft_tensors
from mtune.modules.lora_state import peft_key
from mtune.training.checkpointing.hf import save_hf_checkpoint
from mtune.training.checkpointing.manifest import UNREADABLE_HINT, DamagedCheckpointError
from mtune.training.optimizers import inner_optimizers
from mtune.training.shards import full_shape

__all__ = [
    "save_distributed_state",
    "load_distributed_state",
    "DISTRIBUTED_STATE_DIRNAME",
    "gathered_state_dict_items",
    "gathered_peft_adapter_items",
    "save_gathered_hf_checkpoint",
]

DISTRIBUTED_STATE_DIRNAME = "distributed_state"
"""Suggested sub-directory of ``step_<N>/`` for this state (next to ``recipe_state.pt``)."""


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _options(adapter_only: bool, strict: bool = True) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=adapter_only, strict=strict and not adapter_only)


def save_distributed_state(
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    adapter_only: bool,
) -> Path:
    """Save the (sharded) model parameters and optimizer state; every rank must call it and writes its shards.

    ``adapter_only`` (LoRA/QLoRA/DoRA) skips frozen parameters. ``optimizer`` may be an
    an optimizer-in-backward wrapper (its per-parameter optimizers are saved) or None.
    """
    path = Path(checkpoint_dir)
    optimizers = inner_optimizers(optimizer)
    model_state, optim_state = get_state_dict(model, optimizers, options=_options(adapter_only))
    state = {"model": model_state}
    if optimizers:
        state["optim"] = optim_state
    dcp.save(state, checkpoint_id=str(path))
    return path


def load_distributed_state(
    checkpoint_dir: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    adapter_only: bool,
) -> None:
    """Load what :func:`save_distributed_state` wrote into ``model`` / ``optimizer``, resharding to the current
    number of ranks. Call after the base weights are loaded and the optimizer is built; every rank must call it."""
    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        raise PathNotFoundError(f"{path}: no distributed checkpoint there (.metadata missing); point "
                                "resume_from_checkpoint at a step_<N> directory of a distributed run")
    optimizers = inner_optimizers(optimizer)
    options = _options(adapter_only)
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    state = {"model": model_state}
    if optimizers:
        state["optim"] = optim_state
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as err:  # every rank raises it, carrying each failed rank's exception
        raise DamagedCheckpointError(
            f"{path} is unreadable: {_first_failure(err)}",
            UNREADABLE_HINT) from None
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optim", {}),
                   options=options)


def _first_failure(err: CheckpointException) -> str:
    """``rank N: Type: message`` of the lowest rank that failed, on one line."""
    rank = min(err.failures)
    exc = err.failures[rank][0]
    return f"rank {rank}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


# ------------------------------------------------------------------------------------------------ export
def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _gather(tensor: torch.Tensor, plain: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The full tensor (collective: every rank must call it), each stored shard made ``plain`` first."""
    if not isinstance(tensor, DTensor):
        return plain(tensor.detach())
    local = tensor.to_local()
    plain_local = plain(local)
    if plain_local is not local:  # made plain here, gathered plain (DTensor cannot all-gather an NF4 shard)
        tensor = DTensor.from_local(plain_local, tensor.device_mesh, tensor.placements, run_check=False,
                                    shape=tensor.shape, stride=tensor.stride())
    return tensor.detach().full_tensor()


def gathered_state_dict_items(model: nn.Module, adapter_only: bool = False,
                              plain: Callable[[torch.Tensor], torch.Tensor] = _as_is,
                              ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(mtune name, full tensor on CPU)`` one parameter at a time, on rank 0 only.

    Every rank must run the generator to the end (each tensor is an all-gather); other ranks yield nothing. The
    writing rank holds one full tensor at a time (plus what its consumer keeps). ``plain`` turns a stored shard
    into the plain tensor it stands for (`mtune.training.memory.phases.plain_form`: NF4 bases dequantized, in
    their original dtype; NF4 experts held as rows come back ``[n_experts, out, in]``). ``adapter_only`` yields only
    the LoRA / DoRA parameters.
    """
    rank0 = _is_rank_zero()
    for name, tensor in model.state_dict().items():
        if adapter_only and not is_adapter_param(name):
            continue
        full = _gather(tensor, plain).view(full_shape(model, name, tensor))  # NF4 experts' rows: [E, out, in]
        if rank0:
            yield name, full.cpu()
        del full


def gathered_peft_adapter_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`mtune.modules.lora.peft_adapter_state_dict` for a sharded model: PEFT-named full adapter tensors,
    yielded on rank 0 (all ranks must iterate). ``dict(...)`` of it is small: adapters only. Expert adapters come
    last, in peft's ``target_parameters`` form (`mtune.modules.lora_experts_peft`)."""
    experts = tuple(f"{name}." for name, _ in adapted_experts(model))
    for name, tensor in gathered_state_dict_items(model, adapter_only=True):
        if not name.startswith(experts):
            yield peft_key(name), tensor
    fused = expert_peft_tensors(model)  # gathers: every rank
    if _is_rank_zero():
        yield from ((name, tensor.cpu()) for name, tensor in fused.items())


def save_gathered_hf_checkpoint(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    source_dir: str | os.PathLike | None = None,
    max_shard_size: int | str = "1GB",
    dtype: torch.dtype | None = None,
    plain: Callable[[torch.Tensor], torch.Tensor] = _as_is,
) -> Path | None:
    """Write the sharded model as a Hugging Face directory from rank 0 (all ranks must call it).

    Rank 0 holds one gathered tensor plus at most ``max_shard_size`` of pending output at a time. ``dtype`` casts
    each tensor (e.g. back to bf16 after fp32 training); ``plain`` as in :func:`gathered_state_dict_items`.
    Returns the directory on rank 0, None elsewhere.
    """
    items = gathered_state_dict_items(model, plain=plain)
    if dtype is not None:
        items = ((n, t.to(dtype)) for n, t in items)
    if not _is_rank_zero():
        for _ in items:  # runs the all-gathers; nothing is yielded here
            pass
        return None
    return save_hf_checkpoint(items, out_dir, source_dir=source_dir, max_shard_size=max_shard_size,
                              model_args=getattr(model, "args", None))
