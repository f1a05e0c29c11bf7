"""Resume state of a sharded run, written by every rank in parallel with ``torch.distributed.checkpoint`` (DCP).

DCP stores each rank's shards with their global offsets, so a checkpoint saved on N ranks loads on M ranks (or in
one process without a process group): each rank reads the rows it now owns. LoRA runs store only the trainable
adapter parameters and their optimizer state; the frozen base (possibly NF4) comes from the base checkpoint again.

Layout: ``<dir>/`` holds DCP's ``.metadata`` and ``__<rank>_0.distcp`` files, with two top-level entries,
``model`` and ``optim``. Optimizer state is keyed by parameter name (DCP's ``get_state_dict``), not by position,
so it does not depend on how parameters are grouped.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["save_distributed_state", "load_distributed_state", "DISTRIBUTED_STATE_DIRNAME"]

DISTRIBUTED_STATE_DIRNAME = "distributed_state"
"""Suggested sub-directory of ``step_<N>/`` for this state (next to ``recipe_state.pt``)."""


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optimizers", None)  # OptimizerInBackward: one optimizer per parameter
    return list(inner.values()) if isinstance(inner, dict) else [optimizer]


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
    :class:`~mtune.training.optimizers.OptimizerInBackward` (its per-parameter optimizers are saved) or None.
    """
    path = Path(checkpoint_dir)
    optimizers = _optimizers(optimizer)
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
        raise FileNotFoundError(f"{path}: no distributed checkpoint there (.metadata missing); point "
                                "resume_from_checkpoint at a step_<N> directory of a distributed run")
    optimizers = _optimizers(optimizer)
    options = _options(adapter_only)
    model_state, optim_state = get_state_dict(model, optimizers, options=options)
    state = {"model": model_state}
    if optimizers:
        state["optim"] = optim_state
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state.get("optim", {}),
                   options=options)
