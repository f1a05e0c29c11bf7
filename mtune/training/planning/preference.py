"""What planning a preference (DPO) recipe's config adds to :func:`~mtune.training.planning.plan.plan_memory`: the
loss the step runs (the recipe's own `PreferenceObjective` over pair batches of ``2 x batch_size`` rows: chosen and
rejected in one forward), the reference model the config chooses, and the precompute pass as its own phase.

- ``adapters_off``: the policy's no-gradient forward with adapters disabled, inside each micro-batch before the
  policy's forward (its logits are freed before the policy's activations exist);
- ``copy``: a frozen copy of the starting model, materialized (and sharded) like the policy (its weights count as
  parameters; its block linears in fp8 with ``reference_storage_dtype``), and its no-gradient forward;
- ``precomputed``: no reference model and no reference forward while training; the pass before training (a
  no-gradient forward of the starting model per batch, before any optimizer state exists) is planned as a phase
  of its own, and the plan's peak is the largest of the phases.

With ``dataset.packed`` a micro-batch is ``batch_size`` packed rows of ``2 x max_seq_len`` tokens, each planned
holding the longest pair (its two responses as two documents): the same tokens as an unpacked batch of as many
pairs, through the block-causal attention path.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from mtune.config import instantiate
from mtune.config.keys import is_preference, reference_choice, run_kind
from mtune.modules.lora import adapters_disabled
from mtune.modules.preference_loss import PreferenceObjective
from mtune.training.memory.registry import MemoryConfig, reference_copy_memory
from mtune.training.model_setup import (
    build_sharded_model,
    materialize_model,
    materialize_sharded_model,
    setup_model,
)
from mtune.training.reference import ModelReference

__all__ = ["PlannedPreference", "planned_preference", "rows_per_sample", "row_length", "packed_pair_fields"]


def _packed_pairs(cfg) -> bool:
    return is_preference(cfg) and bool((cfg.get("dataset") or {}).get("packed"))


def rows_per_sample(cfg) -> int:
    """Rows of a batch per sample: 2 for a pair (chosen and rejected), 1 otherwise (a sample, or a packed row of
    pairs)."""
    return 2 if is_preference(cfg) and not _packed_pairs(cfg) else 1


def row_length(cfg, seq_len: int) -> int:
    """A planned row's tokens: ``2 x seq_len`` for packed pairs (`mtune.data.PackedPreferenceDataset`: a row holds
    the longest pair, both responses at max_seq_len), else ``seq_len``."""
    return 2 * seq_len if _packed_pairs(cfg) else seq_len


def packed_pair_fields(cfg, batch: dict) -> dict:
    """What a packed batch of pairs adds (`mtune.data.collate_packed_pairs`), for planned rows of two documents
    each (one pair: document 0 its chosen, 1 its rejected response): ``sequence_ids`` and ``pair_index``; nothing
    for other configs."""
    if not _packed_pairs(cfg):
        return {}
    rows = batch["tokens"].shape[0]
    return {"sequence_ids": torch.arange(rows).unsqueeze(1) + rows * batch["document_ids"],
            "pair_index": torch.arange(rows)}


class PlannedPreference:
    """``loss``: the step's objective; ``precompute``: the reference pass before training (None unless
    ``precomputed``); ``frozen_copy``: the reference copy's parameters and buffers (``copy``), for the tracker."""

    def __init__(self, loss, precompute=None, frozen_copy=()):
        self.loss, self.precompute, self.frozen_copy = loss, precompute, list(frozen_copy)

    def before_steps(self, tracker, make_batch):
        """Count the reference copy's weights as parameters and run the precompute pass (no gradient, before any
        optimizer state) under ``tracker``; returns that phase's peaks (a `StepMemory`), or None without one."""
        for tensor in self.frozen_copy:
            tracker.track(tensor, "parameters")
        if self.precompute is None:
            return None
        with tracker, torch.no_grad():
            self.precompute(make_batch())
        return tracker.take_interval()


def _zeros(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    n = PreferenceObjective.count(batch)
    return (torch.zeros(n, device=batch["tokens"].device),) * 2


def planned_preference(cfg, model, source, *, dtype, memory: MemoryConfig, placement, autocast,
                       device=torch.device("cpu")) -> PlannedPreference | None:
    """The preference parts of the plan of ``cfg`` (None for a config of another recipe); call under the plan's
    fake tensor mode (the copy's weights are made there)."""
    if not is_preference(cfg):
        return None
    loss = instantiate(cfg.loss)
    kind = reference_choice(cfg, adapters=memory.lora is not None)
    starting = ModelReference(model, partial(adapters_disabled, model) if memory.lora is not None
                              else contextlib.nullcontext, autocast=autocast)
    if loss.reference_free:
        return PlannedPreference(PreferenceObjective(loss, None))
    if kind == "adapters_off":
        return PlannedPreference(PreferenceObjective(loss, starting))
    if kind == "precomputed":
        return PlannedPreference(PreferenceObjective(loss, _zeros), precompute=starting)
    sharded, stored = run_kind(cfg) == "distributed", reference_copy_memory(cfg.get("reference_storage_dtype"))
    with unset_fake_temporarily():  # built on the meta device as the policy was, outside the fake mode
        if sharded:  # sharded like the policy, as the run shards it
            copy, _ = build_sharded_model(source, device=device, dtype=dtype, memory=MemoryConfig(),
                                          placement=placement, fsdp_reshard_after_forward=True)
        else:  # fp8 block linears with reference_storage_dtype (the rules keep it off distributed configs)
            copy, _ = setup_model(source, device=device, dtype=dtype, memory=stored, materialize=False,
                                  placement=placement, trainable=False)
    if sharded:
        materialize_sharded_model(copy, source, device=device, dtype=dtype, seed=0, memory=MemoryConfig())
        copy.requires_grad_(False)
    else:
        materialize_model(copy, source, device=device, dtype=dtype, memory=stored, trainable=False)
    return PlannedPreference(PreferenceObjective(loss, ModelReference(copy.eval(), autocast=autocast)),
                             frozen_copy=[*copy.parameters(), *copy.buffers()])
