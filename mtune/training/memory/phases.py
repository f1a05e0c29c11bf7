"""The one orchestrator of the memory techniques' run phases: each function below calls one phase of every
technique the run enables, in the registry's order (`mtune.training.memory.registry.TECHNIQUES`, where each line
says why it stands where it does). The rest of mtune reaches the techniques only through these functions and the
registry; none of them names a technique.

The phases, in the order a run meets them:

1. :func:`prepare_model` — on the meta model: adapters and NF4 bases, fp8 storage, weight-offloading hooks, the
   tiled MLP and attention kernel, activation checkpointing, activation offloading (its context, which the step
   enters around forward and backward), compile;
2. :func:`sharding_options` — FSDP2's ``fully_shard`` options (distributed recipes: CPU offload);
3. the techniques' `WeightPhases`: :func:`on_weights` as each module's weights arrive (loaded or drawn): NF4 / fp8
   storage, offloading (sharded: :func:`arrives_whole` says which weights are stored whole before a rank keeps its
   rows; :func:`added` which parameters no base checkpoint holds); :func:`after_weights` once all are in (fresh
   adapters, what loading did not move);
4. :func:`wrap_optimizer` — the optimizer built over the trainable parameters, or one that steps elsewhere or
   elsewhen (in backward, on the host);
5. :func:`materialized` — before saving or merging: every weight on the device in its full form
   (sharded: :func:`plain_form` turns each stored shard into the plain tensor it stands for);
6. :func:`recompute` — what the FLOPs counter reads (checkpointed blocks, tiled MLPs), from the footprints.

No global state: every phase acts on the given model (a meta-device model works).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from mtune.config.errors import ConfigError
from mtune.training.memory import registry
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.technique import BlockOffload, Footprint, MemoryTechnique, ModelFacts, Recompute

__all__ = [
    # the run's phases, in the order a run meets them
    "prepare_model", "sharding_options", "on_weights", "arrives_whole", "added", "after_weights",
    "wrap_optimizer", "materialized", "plain_form", "recompute",
    # what the planner reads
    "footprints", "planned", "parameter_settings", "shape_parameters", "lossy", "dropped_losses", "repeat_blocks",
    "frozen_bytes_per_weight", "describe",
]

log = logging.getLogger(__name__)


def _enabled(memory: MemoryConfig):
    for technique in registry.TECHNIQUES:
        settings = memory[technique]
        if technique.enabled(settings, memory):
            yield technique, settings


def describe(memory: MemoryConfig) -> str:
    """``lora=lora, weight_storage_dtype=off, ...``: every technique with keys, its settings described where it is
    on (`Settings.describe`), as the run's log line says."""
    return ", ".join(f"{t.name}={memory[t].describe() if t.enabled(memory[t], memory) else 'off'}"
                     for t in registry.TECHNIQUES if t.Settings.keys())


def _weight_phases(memory: MemoryConfig) -> list:
    """The `WeightPhases` of every enabled technique that has some, in registry order."""
    return [w for t, s in _enabled(memory) if (w := t.weights(s)) is not None]


def prepare_model(model: Any, memory: MemoryConfig, placement: Any) -> Any:
    """Transform the meta ``model`` in place, technique by technique (their ``on_model``), and log the run's
    techniques. Returns the context the step enters around forward and backward (None when no technique needs
    one)."""
    contexts = [c for t, s in _enabled(memory) if (c := t.on_model(model, s, memory, placement)) is not None]
    log.info("memory techniques: %s", describe(memory))
    if len(contexts) > 1:
        raise NotImplementedError(f"{len(contexts)} step contexts: one technique at a time moves saved activations")
    return contexts[0] if contexts else None


def compiles(memory: MemoryConfig) -> bool:
    """Whether a technique compiles the model's code (`Footprint.compiles`): the plan's dispatch modes allow it."""
    return any(f.compiles for f in footprints(memory))


def _shaping(memory: MemoryConfig) -> list:
    """The techniques whose footprint says they decide the model's parameters, in registry order."""
    return [t for t, f in zip(registry.TECHNIQUES, footprints(memory)) if f.shapes_parameters]


def parameter_settings(memory: MemoryConfig) -> tuple:
    """The settings of the techniques that decide the model's parameters (`Footprint.shapes_parameters`):
    two runs alike here have the same parameters, trainable and stored alike."""
    return tuple(memory[t] for t in _shaping(memory))


def shape_parameters(model: Any, memory: MemoryConfig) -> None:
    """The model phase of the techniques that decide the parameters only, on a meta ``model`` (the planner's cost
    model counts its parameters and FLOPs)."""
    shaping = _shaping(memory)
    for technique, settings in _enabled(memory):
        if technique in shaping:
            technique.on_model(model, settings, memory, None)


def sharding_options(memory: MemoryConfig, placement: Any) -> dict:
    """Keyword arguments for FSDP2's ``fully_shard``, from every technique that has some."""
    options: dict = {}
    for technique, settings in _enabled(memory):
        options.update(technique.sharding_options(settings, memory, placement))
    return options


def on_weights(model: Any, module: Any, memory: MemoryConfig) -> None:
    """``module``'s weights just arrived on the device: store or move them as the techniques say."""
    for weights in _weight_phases(memory):
        weights.arrived(model, module)


def arrives_whole(memory: MemoryConfig) -> Callable[[Any, str], Callable | None]:
    """``lookup(module, leaf)``: for ``module``'s parameter ``leaf`` stored from its whole tensor, the function
    ``store(full, param)`` that stores it and returns this rank's rows (sharded loading and initialisation); None:
    the rows as they come."""
    phases = _weight_phases(memory)

    def lookup(module: Any, leaf: str) -> Callable | None:
        return next((store for w in phases if (store := w.stored_whole(module, leaf)) is not None), None)

    return lookup


def added(memory: MemoryConfig) -> Callable[[str], bool]:
    """``is_added(name)``: whether a technique adds the parameter ``name`` (adapters): a base checkpoint does not
    hold it."""
    phases = _weight_phases(memory)
    return lambda name: any(w.added(name) for w in phases)


def plain_form(memory: MemoryConfig) -> Callable[[Any], Any]:
    """``plain(tensor)``: a stored weight as the plain tensor it stands for (an NF4 shard dequantized), any other
    tensor as it is (gathered saves of a sharded model)."""
    phases = _weight_phases(memory)

    def plain(tensor: Any) -> Any:
        return next((out for w in phases if (out := w.plain(tensor)) is not None), tensor)

    return plain


def after_weights(model: Any, memory: MemoryConfig, *, sharded: bool = False) -> None:
    """Every weight is in (loaded, or drawn at random; each rank its rows when ``sharded``)."""
    for weights in _weight_phases(memory):
        weights.all_arrived(model, sharded, lambda: materialized(model, memory))


def wrap_optimizer(spec: Any, named_params: list, memory: MemoryConfig, placement: Any) -> Any:
    """The optimizer of the technique that builds one (in backward, on the host), or None: the plain one. At most
    one technique may take over the step (the rules say so too, for callers that skip the validator)."""
    takers = [t.name for t, _ in _enabled(memory) if type(t).wrap_optimizer is not MemoryTechnique.wrap_optimizer]
    if len(takers) > 1:
        raise ConfigError(f"{' and '.join(takers)} both take over the optimizer step: keep one of them")
    for technique, settings in _enabled(memory):
        optimizer = technique.wrap_optimizer(spec, named_params, settings, memory, placement)
        if optimizer is not None:
            return optimizer
    return None


@contextlib.contextmanager
def materialized(model: Any, memory: MemoryConfig) -> Iterator[None]:
    """Every weight of ``model`` on the compute device in its full form while inside (saving, merging)."""
    with contextlib.ExitStack() as stack:
        for weights in _weight_phases(memory):
            context = weights.full_form(model)
            if context is not None:
                stack.enter_context(context)
        yield


_NO_MODEL = ModelFacts(n_layers=1, dim=1, trainable_bytes=0.0, frozen_bytes=0.0, residual_bytes=1,
                       micro_batch_tokens=1, step_tokens=1)


def recompute(memory: MemoryConfig, n_layers: int, tokens: int, dim: int) -> Recompute:
    """What backward repeats of the forward, per block, folded over the techniques' footprints for ``n_layers``
    blocks of width ``dim`` at ``tokens`` tokens a micro-batch (the FLOPs counter)."""
    facts = dataclasses.replace(_NO_MODEL, n_layers=n_layers, dim=dim, micro_batch_tokens=tokens, step_tokens=tokens)
    checkpoint, tiled = (None,) * n_layers, (False,) * n_layers
    for footprint in footprints(memory, facts):
        checkpoint = footprint.recompute.checkpoint if footprint.recompute.checkpoint is not None else checkpoint
        tiled = footprint.recompute.mlp_tiled if footprint.recompute.mlp_tiled is not None else tiled
    return Recompute(checkpoint=checkpoint, mlp_tiled=tiled)



def planned(memory: MemoryConfig) -> tuple[MemoryConfig, list[str]]:
    """``memory`` as ``mtune plan`` can model it: without the techniques whose footprint says they are not planned,
    and those footprints' notes."""
    notes = []
    for technique in registry.TECHNIQUES:
        note = technique.footprint(memory[technique], memory, _NO_MODEL).not_planned
        if note:
            memory, notes = memory.without(technique), notes + [note]
    return memory, notes


def footprints(memory: MemoryConfig, facts: ModelFacts | None = None) -> list[Footprint]:
    """Every technique's footprint for a model of these ``facts``, in registry order. Without ``facts``, only the
    fields that do not depend on the model mean anything (homes, lossy, repeat blocks)."""
    facts = _NO_MODEL if facts is None else facts
    return [technique.footprint(memory[technique], memory, facts) for technique in registry.TECHNIQUES]


def lossy(memory: MemoryConfig) -> list[str]:
    """What the configured techniques give up in the numbers a step computes (empty: the same step)."""
    return [f.lossy for f in footprints(memory) if f.lossy]


def dropped_losses(memory: MemoryConfig, other: MemoryConfig) -> list[str]:
    """What ``memory``'s techniques give up that ``other``'s no longer do (a lossy base ``--fit`` found unneeded)."""
    return [mine.lossy for mine, theirs in zip(footprints(memory), footprints(other))
            if mine.lossy and not theirs.lossy]


def block_offload(memory: MemoryConfig, facts: ModelFacts) -> BlockOffload | None:
    """Which of the model's blocks save to the host (`Footprint.block_offload`), or None where no technique moves
    what blocks save."""
    return next((f.block_offload for f in footprints(memory, facts) if f.block_offload is not None), None)


def repeat_blocks(memory: MemoryConfig) -> list[int]:
    """Each technique's `Footprint.repeat_blocks`: how many consecutive blocks its per-block memory repeats over."""
    return [f.repeat_blocks for f in footprints(memory)]


def frozen_bytes_per_weight(memory: MemoryConfig) -> float | None:
    """Bytes a frozen 2-D weight takes as a technique stores it once loaded (None: its dtype's)."""
    return next((f.frozen_bytes_per_weight for f in footprints(memory)
                 if f.frozen_bytes_per_weight is not None), None)
