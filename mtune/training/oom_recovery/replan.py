"""oom_recovery's decision: :func:`replan` (``mtune plan --fit``'s search over :func:`adoptable_knobs`, for what the
run measured), the micro-batch split it adopts (:func:`halve_micro_batches`), and the helper process a distributed
run re-plans in (``python -m mtune.training.oom_recovery.replan``). See the package docstring."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import OmegaConf

from mtune.training.memory import registry
from mtune.training.memory.registry import DISTRIBUTED_MEMORY_RULES, MEMORY_RULES, MemoryConfig
from mtune.training.memory.technique import FitChoice
from mtune.training.planning.candidates import Knob, registry_knobs, with_overrides
from mtune.training.planning.cost import model_facts
from mtune.training.planning.estimate import Estimator
from mtune.training.planning.fit import best_of, search
from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES

__all__ = ["replan", "replan_in_helper", "adoptable_knobs", "halve_micro_batches", "batch_samples", "RUN_CONFIG_NAME",
           "MAX_RECOVERIES", "PAIR_BATCH_FIELDS"]

RUN_CONFIG_NAME = "mtune_fit.yaml"
"""The config a run runs, in ``output_dir``, when a plan chose it (``mtune run --fit``, or a recovery): a resume
reads it with ``--config``."""

MAX_RECOVERIES = 3
"""Re-plans in one run; the next out-of-memory error ends the run (with a checkpoint) as when nothing fits."""

# The knob of the techniques a running model can take on: activation checkpointing (its levels include activation
# offloading), whose ``on_model`` works in place on a materialized model (and on FSDP2's sharded blocks), and which
# change no number a step computes. Every other knob keeps the config's choice.
_ADOPTABLE_KNOB = "activation_checkpointing"

# What a batch of token rows holds (mtune.data.collate), and a preference batch besides (mtune.data.preference: its
# pairs' chosen rows first, their rejected rows next); a batch with anything else is not split.
TOKEN_BATCH_FIELDS = {"tokens", "labels", "input_pos", "document_ids", "longest_document", "num_tokens"}
PAIR_BATCH_FIELDS = TOKEN_BATCH_FIELDS | {"pair_index", "pairs_of"}


def batch_samples(batch: dict) -> int:
    """The samples of a micro-batch: its pairs for a preference batch, else its rows (``batch_size`` counts them)."""
    return int(batch["pair_index"].shape[0]) if "pair_index" in batch else int(batch["tokens"].shape[0])


def halve_micro_batches(micro_batches: Sequence[dict]) -> list[dict] | None:
    """Each micro-batch split into two of half its samples, in order: the step's samples, their order and its
    loss unchanged (`mtune.training.loop.train_step` divides by the step's trained tokens, or a pair loss by its
    pairs), twice the accumulation. A preference batch keeps each pair's chosen and rejected rows together (rows
    ``i`` and ``n + i`` of its ``n`` pairs go to the same half). None when a micro-batch holds a single sample, or
    fields other than a token or preference batch's. ``num_tokens`` (a throughput count) is shared in proportion;
    ``longest_document`` is kept, still a bound on each half's documents."""
    halves: list[dict] = []
    for batch in micro_batches:
        pairs = "pair_index" in batch
        n, rows = batch_samples(batch), int(batch["tokens"].shape[0])
        if n < 2 or set(batch) - (PAIR_BATCH_FIELDS if pairs else TOKEN_BATCH_FIELDS):
            return None
        cut = n // 2
        parts = ((slice(0, cut), slice(cut, rows)) if not pairs else
                 (torch.cat([torch.arange(cut), n + torch.arange(cut)]),
                  torch.cat([torch.arange(cut, n), n + torch.arange(cut, n)])))
        first, second = {}, {}
        for key, value in batch.items():
            if key == "num_tokens":
                first[key] = value * cut // n
                second[key] = value - first[key]
            elif key == "pair_index":
                first[key], second[key] = value[:cut], value[cut:]
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
                first[key], second[key] = value[parts[0]], value[parts[1]]
            else:
                first[key] = second[key] = value
        halves += [first, second]
    return halves


# ------------------------------------------------------------------------------------------------- re-planning
def _reachable(cfg, overrides: dict) -> bool:
    """Whether the running model can take on ``overrides``: a technique that is on stays as it is (a checkpointed
    block stays checkpointed, with its policy; offloading stays on); one that is off may be turned on."""
    now, after = MemoryConfig.from_config(cfg), MemoryConfig.from_config(with_overrides(cfg, overrides))
    return all(now[t] == after[t] for t in registry.TECHNIQUES if t.enabled(now[t], now))


def adoptable_knobs(cfg, rows: int) -> list:
    """``mtune plan --fit``'s knobs (`registry_knobs`) cut to what a running model can take on: the micro-batch
    (sizes that divide ``rows``, the rows of the micro-batches the loader makes), activation checkpointing and
    offloading where :func:`_reachable`; every other knob keeps the config's choice (one choice, no change)."""

    def as_configured(_cfg):
        return [FitChoice(0, {})]

    def micro_batch(knob):
        return lambda c: [ch for ch in knob.choices(c) if rows % int(ch.overrides["batch_size"]) == 0]

    def checkpointing(knob):
        def choices(c):
            kept = [ch for ch in knob.choices(c) if _reachable(c, ch.overrides)]
            same = [ch for ch in kept if not ch.overrides or all(c.get(k) == v for k, v in ch.overrides.items())]
            return kept if same else [FitChoice(0, {}), *(ch for ch in kept if ch.level > 0)]
        return choices

    knobs = []
    for knob in registry_knobs():
        if knob.name == "micro_batch":
            knobs.append(Knob(knob.name, micro_batch(knob)))
        elif knob.name == _ADOPTABLE_KNOB:
            knobs.append(Knob(knob.name, checkpointing(knob), knob.floor_only))
        else:
            knobs.append(Knob(knob.name, as_configured, knob.floor_only))
    return knobs


def _schema(cfg, world_size: int):
    """The technique rules a candidate must keep (the run's own keys were checked at launch)."""
    sharded = world_size > 1 or "fsdp_reshard_after_forward" in cfg
    return SimpleNamespace(rules=DISTRIBUTED_MEMORY_RULES if sharded else MEMORY_RULES)


def replan(cfg, *, limit: int, longest_tokens: int, held_bytes: int, fragmentation: int = 0, world_size: int = 1,
           rows: int | None = None) -> dict[str, Any]:
    """The fastest lossless config that keeps ``cfg``'s samples per step and fits ``limit`` bytes of device memory,
    planned for rows of ``longest_tokens`` tokens, among :func:`adoptable_knobs` (``rows``: the loader's rows per
    micro-batch; default ``cfg.batch_size``). ``held_bytes``: what the run held on the device when it ran out;
    when the plan of ``cfg`` is below it, the budget is ``limit`` scaled by plan / held (the plan under-counts this
    run by that much). ``fragmentation``: the allocator's reserved-minus-allocated bytes, kept free.

    Returns a JSON-able dict: ``changes`` (the keys to change, with their values; None when nothing fits),
    ``planned`` (the answer's planned device bytes), ``budget`` (the bytes searched), ``current`` (``cfg``'s own
    plan), ``leanest`` and ``leanest_bytes`` (the most saving adoptable config and its plan, to say what would
    fit), ``floor`` (why the leanest's floor alone is over the budget, or None). Planner errors are raised."""
    rows = int(cfg.batch_size) if rows is None else rows
    plan_cfg = with_overrides(cfg, {"tokenizer.max_seq_len": int(longest_tokens)})
    context = CUDA_CONTEXT_BYTES if model_facts(cfg).cuda else 0  # in the plan's total, outside the allocator's limit
    estimator = Estimator(device_memory=limit + context, host_memory=None, world_size=world_size)
    current = estimator.estimate(plan_cfg).device_peak_bytes
    budget = limit if current >= held_bytes or not held_bytes else int(limit * current / held_bytes)
    candidates = search(plan_cfg, _schema(cfg, world_size), device_memory=budget + context, host_memory=None,
                        knobs=adoptable_knobs(cfg, rows), world_size=world_size, lossy="never",
                        margin=fragmentation, estimator=estimator)
    best = best_of(candidates)
    answer: dict[str, Any] = {"budget": budget, "current": current, "seq_len": int(longest_tokens)}
    if best is not None:
        return {**answer, "changes": best.changes, "planned": best.plan.device_total_bytes - context}
    leanest = max(candidates, key=lambda c: sum(c.levels)) if candidates else None
    if leanest is None:
        return {**answer, "changes": None, "leanest": {}, "leanest_bytes": None, "floor": None}
    plan = leanest.plan if leanest.plan is not None and not leanest.plan.lower_bound else \
        estimator.whole(with_overrides(plan_cfg, leanest.overrides))
    return {**answer, "changes": None, "leanest": leanest.changes, "leanest_bytes": plan.device_total_bytes - context,
            "floor": leanest.reason}


# What torchrun tells its workers: the helper process must not take itself for one of them.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def replan_in_helper(cfg, **measured) -> dict[str, Any]:
    """:func:`replan` in a helper process (this module as a script): in a distributed run the planner's fake
    process group cannot stand beside the run's."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC")}
    request = {"cfg": OmegaConf.to_container(cfg, resolve=True), "measured": measured}
    done = subprocess.run([sys.executable, "-m", "mtune.training.oom_recovery.replan"], env=env, capture_output=True,
                          text=True, input=json.dumps(request), timeout=1800)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"the re-plan failed: {tail}"}
    return json.loads(lines[-1])


if __name__ == "__main__":  # the helper process of a distributed run's re-plan (see replan_in_helper)
    _request = json.load(sys.stdin)
    try:
        _answer = replan(OmegaConf.create(_request["cfg"]), **_request["measured"])
    except Exception as _err:  # the run says it in its own words
        _answer = {"error": f"the re-plan failed: {str(_err).splitlines()[0] if str(_err) else type(_err).__name__}"}
    print(json.dumps(_answer))
