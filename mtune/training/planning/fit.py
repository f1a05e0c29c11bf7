"""``mtune plan --fit``: search the memory techniques' choices for the configs that fit a device, order them by
one cost model, and write the best as a ready-to-run YAML.

The search space is :data:`KNOBS`: one per technique that declares a ``fit_knob``
(`mtune.training.memory.registry.TECHNIQUES`, in registry order), then the micro-batch. Each knob lists its choices
for the user's config (a level: higher saves more). Every candidate (one choice per knob) that the recipe's rules
accept is ordered by :func:`~mtune.training.planning.cost.step_cost`; candidates are then planned for real
(:func:`~mtune.training.planning.plan.plan_memory`, fake tensors) in that order. Pruning: when a candidate does not
fit, every candidate that saves no more on any knob (each level <= its) cannot fit either and is never planned.
The search stops after ``max_fits`` fitting candidates (the cheapest ones) or ``max_plans`` plans. Among equal
costs the larger micro-batch and the fewer techniques win.
"""

from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mtune.config import load_config
from mtune.config.errors import ConfigError
from mtune.training.memory import registry
from mtune.training.memory.technique import FitChoice, MemoryTechnique
from mtune.training.planning.cost import model_facts, step_cost
from mtune.training.planning.memory_plan import MemoryPlan, format_bytes
from mtune.training.planning.plan import plan_memory

__all__ = ["Knob", "KNOBS", "registry_knobs", "Candidate", "search", "fit_command", "write_config"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Knob:
    """One dimension of the search: ``choices(cfg)`` lists ``(level, overrides)`` pairs (`FitChoice`) for the
    user's config; a higher level saves more."""

    name: str
    choices: Callable[[Any], list[FitChoice]]


def _technique_knob(technique: MemoryTechnique) -> Knob:
    return Knob(technique.fit_knob, lambda cfg: technique.fit_choices(cfg, model_facts(cfg)))


def _micro_batch(cfg) -> list[FitChoice]:
    """``batch_size`` halved down to 1, with ``gradient_accumulation_steps`` raised to keep the samples per step."""
    batch, accumulation = int(cfg.batch_size), int(cfg.get("gradient_accumulation_steps") or 1)
    choices, level = [], 0
    while batch >= 1:
        choices.append(FitChoice(level, {"batch_size": batch, "gradient_accumulation_steps": accumulation}))
        if batch % 2:
            break
        batch, accumulation, level = batch // 2, accumulation * 2, level + 1
    return choices


def registry_knobs() -> list[Knob]:
    """The techniques searched, in registry order, and the micro-batch last (the search reads its level as
    ``levels[-1]``). fp8 weight storage is a level of ``lora_method`` (with NF4) and activation offloading one of
    ``activation_checkpointing``."""
    return [_technique_knob(t) for t in registry.TECHNIQUES if t.fit_knob] + [Knob("micro_batch", _micro_batch)]


KNOBS: list[Knob] = registry_knobs()
"""`registry_knobs()` as the registry was imported."""


@dataclass
class Candidate:
    overrides: dict
    levels: tuple[int, ...]
    cost: float
    cfg: Any = None
    plan: MemoryPlan | None = None
    fits: bool | None = None
    pruned: bool = False
    changes: dict = field(default_factory=dict)


def _apply(cfg, overrides: dict):
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out


def _changes(base, cfg, keys: Iterable[str]) -> dict:
    changed = {}
    for key in keys:
        before = OmegaConf.select(base, key, default=None)
        after = OmegaConf.select(cfg, key, default=None)
        if before != after:
            changed[key] = after
    return changed


def search(cfg, schema, *, device_memory: int, host_memory: int | None = None, knobs: list[Knob] | None = None,
           max_fits: int = 5, max_plans: int = 40, progress: Callable[[str], None] | None = None,
           world_size: int = 1) -> list[Candidate]:
    """Every candidate of ``knobs`` over ``cfg`` that ``schema``'s rules accept, cheapest first, each planned or
    pruned as the module docstring says. Returns them all (``fits`` None where never planned)."""
    knobs = registry_knobs() if knobs is None else knobs
    options = [knob.choices(cfg) for knob in knobs]
    candidates = []
    for combo in itertools.product(*options):
        overrides: dict = {}
        for _, choice in combo:
            overrides.update(choice)
        variant = _apply(cfg, overrides)
        if schema is not None and any(rule(variant) for rule in schema.rules):
            continue
        keys = sorted({k for _, choice in combo for k in choice})
        candidates.append(Candidate(overrides, tuple(level for level, _ in combo), step_cost(variant), variant,
                                    changes=_changes(cfg, variant, keys)))
    # cheapest first; among equals the larger micro-batch (lower level), then the fewer techniques
    candidates.sort(key=lambda c: (round(c.cost, 15), c.levels[-1], sum(c.levels)))
    failed: list[tuple[int, ...]] = []
    state = {"fits": 0, "plans": 0}

    def dominated(levels) -> bool:
        return any(all(a <= b for a, b in zip(levels, fail)) for fail in failed)

    def plan(candidate: Candidate) -> None:
        candidate.plan = plan_memory(candidate.cfg, device_memory=device_memory, host_memory=host_memory,
                                     world_size=world_size)
        state["plans"] += 1
        spare = candidate.plan.fits()
        candidate.fits = spare["device"] >= 0 and (spare["host"] is None or spare["host"] >= 0)
        if progress is not None:
            progress(f"  plan {state['plans']}: {_describe(candidate.changes)}: "
                     f"{format_bytes(candidate.plan.device_total_bytes)} {'fits' if candidate.fits else 'does not fit'}")
        if not candidate.fits:
            failed.append(candidate.levels)

    # Candidates of equal cost and micro-batch form a tier: its most-saving member is planned first, and when that
    # does not fit, every member it dominates is pruned at once.
    for _, tier in itertools.groupby(candidates, key=lambda c: (round(c.cost, 15), c.levels[-1])):
        tier = list(tier)
        top = max(tier, key=lambda c: sum(c.levels))
        for candidate in [top] + [c for c in tier if c is not top]:
            if state["fits"] >= max_fits or state["plans"] >= max_plans:
                return candidates
            if candidate.plan is not None:
                continue
            if dominated(candidate.levels):
                candidate.pruned, candidate.fits = True, False
                continue
            plan(candidate)
        state["fits"] += sum(1 for c in tier if c.fits)
    return candidates


def _describe(changes: dict) -> str:
    return " ".join(f"{k}={_yaml(v)}" for k, v in changes.items()) or "(as configured)"


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def fit_command(cfg, *, recipe: str, config_path: Path, overrides: list[str], schema, device_memory: int | None,
                host_memory: int | None, world_size: int, output: Path) -> int:
    """``mtune plan --fit``: print the fitting configs cheapest first and write the best to ``output``."""
    if device_memory is None:
        raise ConfigError("--fit needs --device-memory SIZE (the memory of the device to fit, e.g. 24GiB)")
    print(f"mtune plan --fit: {recipe} with {config_path} into {format_bytes(device_memory)}")
    candidates = search(cfg, schema, device_memory=device_memory, host_memory=host_memory, progress=print,
                        world_size=world_size)
    fitting = [c for c in candidates if c.fits]
    planned = sum(1 for c in candidates if c.plan is not None)
    pruned = sum(1 for c in candidates if c.pruned)
    print(f"{len(candidates)} candidates, {planned} planned, {pruned} pruned without planning")
    if not fitting:
        print(f"nothing fits in {format_bytes(device_memory)}: a smaller model, a shorter tokenizer.max_seq_len or "
              "a larger device")
        return 1
    base = fitting[0].cost
    print(f"\n{'#':>2} {'cost':>6} {'device':>11} {'host':>10}  changes")
    for i, c in enumerate(fitting, 1):
        print(f"{i:>2} {c.cost / base:>5.2f}x {format_bytes(c.plan.device_total_bytes):>11} "
              f"{format_bytes(c.plan.host_peak_bytes):>10}  {_describe(c.changes)}")
    best = fitting[0]
    write_config(config_path, overrides, best.changes, output)
    print(f"\nbest written to {output}; run it with:\n  mtune run {recipe} --config {output}")
    if "clip_grad_norm" in best.changes:
        print("note: optimizer_in_bwd steps each weight during backward, so gradient clipping is off in it")
    return 0


def write_config(config_path: Path, overrides: list[str], changes: dict, output: Path) -> Path:
    """The user's config with their overrides and the fit's changes, interpolations kept, as YAML."""
    cfg = load_config(config_path, overrides)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    header = (f"# Written by `mtune plan --fit` from {config_path}; changed: {_describe(changes)}\n")
    output = Path(output)
    output.write_text(header + OmegaConf.to_yaml(cfg))
    return output
