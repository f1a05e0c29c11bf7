"""The ``--fit`` search space: one :class:`Knob` per technique that declares a `FitKnob` (registry order), then
the micro-batch; :func:`candidates_of` combines their choices into every :class:`Candidate` the recipe's rules
accept; :func:`floor_reason` says why a candidate's floor (weights, states, gradients that nothing frees) is over a
budget before anything is planned."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mtune.config.keys import is_preference, reference_choice, run_kind, samples_per_step
from mtune.training.memory import registry
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.technique import FitChoice, MemoryTechnique
from mtune.training.planning.cost import device_floor, model_facts, step_costs
from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES, MemoryPlan
from mtune.units import format_bytes

__all__ = ["Knob", "KNOBS", "registry_knobs", "Candidate", "candidates_of", "floor_reason", "describe",
           "with_overrides", "changed_keys",
           "NEGLIGIBLE_SAVING"]


@dataclass(frozen=True)
class Knob:
    """One dimension of the search: ``choices(cfg)`` lists `FitChoice` ``(level, overrides)`` pairs for the user's
    config; a higher level saves more."""

    name: str
    choices: Callable[[Any], list[FitChoice]]
    floor_only: bool = False
    """What its choices save is all in the floor (`FitKnob.floor_only`)."""
    offloads: bool = False
    """Its higher levels move bytes to the host (`FitKnob.offloads`)."""


def _technique_knob(technique: MemoryTechnique) -> Knob:
    def choices(cfg) -> list[FitChoice]:
        memory = MemoryConfig.from_config(cfg)
        return technique.fit_choices(memory[technique], memory, model_facts(cfg))

    return Knob(technique.fit_knob.name, choices, technique.fit_knob.floor_only, technique.fit_knob.offloads)


def _micro_batch(cfg) -> list[FitChoice]:
    """The config's samples per step (``batch_size`` x ``gradient_accumulation_steps``) as micro-batches of every
    power-of-two split: all of them in one micro-batch first, halved down to 1 (or an odd size)."""
    samples = samples_per_step(cfg)
    choices, batch, level = [], samples, 0
    while batch >= 1:
        choices.append(FitChoice(level, {"batch_size": batch, "gradient_accumulation_steps": samples // batch}))
        if batch % 2:
            break
        batch, level = batch // 2, level + 1
    return choices


def _reference(cfg) -> list[FitChoice]:
    """A preference run's reference model, searched like a technique: a frozen copy, else nothing to choose; the
    policy with adapters disabled (LoRA) or precomputed log-probs (full) hold no second model, losslessly; a copy
    in fp8 (``reference_storage_dtype``, one device) is lossy unless the user's copy is fp8 already."""
    adapters = is_preference(cfg) and MemoryConfig.from_config(cfg).lora is not None
    if not is_preference(cfg) or reference_choice(cfg, adapters) != "copy":
        return [FitChoice(0, {})]
    exact = {"reference": "adapters_off" if adapters else "precomputed", "reference_storage_dtype": None}
    if run_kind(cfg) == "distributed":
        return [FitChoice(0, {}), FitChoice(1, exact)]
    theirs = cfg.get("reference_storage_dtype")
    return [FitChoice(0, {}), FitChoice(1, {"reference": "copy", "reference_storage_dtype": "float8_e4m3fn"},
                                        lossy=None if theirs else "fp8 reference weights", quality="fp8_base"),
            FitChoice(2, exact)]


def registry_knobs() -> list[Knob]:
    """The techniques searched, in registry order, a preference run's reference model, and the micro-batch last
    (the search reads its level as ``levels[-1]``). fp8 weight storage is a level of ``lora_method`` (with NF4) and
    activation offloading one of ``activation_checkpointing``."""
    return ([_technique_knob(t) for t in registry.TECHNIQUES if t.fit_knob] + [Knob("reference", _reference)]
            + [Knob("micro_batch", _micro_batch)])


KNOBS: list[Knob] = registry_knobs()
"""`registry_knobs()` as the registry was imported."""


@dataclass
class Candidate:
    overrides: dict
    levels: tuple[int, ...]
    cost: float
    base: Any = None
    """The user's config; :attr:`cfg` is it with :attr:`overrides`, made when first asked for."""
    plan: MemoryPlan | None = None
    fits: bool | None = None
    pruned: bool = False
    lossy: tuple[str, ...] = ()
    quality_cost: int = 0
    reason: str | None = None
    """Why it was rejected without a plan (its floor over a budget), one line."""
    micro_batch: int = 0
    transfer: float = 0.0
    """Bytes moved between device and host per trained token (`cost.transfer_bytes_per_token`): a tie-break."""
    _cfg: Any = None

    @property
    def cfg(self):
        if self._cfg is None:
            self._cfg = with_overrides(self.base, self.overrides)
        return self._cfg

    @property
    def changes(self) -> dict:
        """The keys the candidate changes in the user's config, with their new values."""
        return changed_keys(self.base, self.cfg, sorted(self.overrides))

    @property
    def techniques(self) -> int:
        return sum(1 for level in self.levels[:-1] if level)


def with_overrides(cfg, overrides: dict):
    """A copy of ``cfg`` with ``overrides`` (dotted keys; a node value replaces the node whole)."""
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out


def changed_keys(base, cfg, keys: Iterable[str]) -> dict:
    """Those of ``keys`` whose value in ``cfg`` differs from ``base``, with their values in ``cfg``."""
    changed = {}
    for key in keys:
        before = OmegaConf.select(base, key, default=None)
        after = OmegaConf.select(cfg, key, default=None)
        if isinstance(before, DictConfig):
            before = OmegaConf.to_container(before, resolve=True)
        if isinstance(after, DictConfig):
            after = OmegaConf.to_container(after, resolve=True)
        if before != after:
            changed[key] = after
    return changed


def floor_reason(cfg, device_budget: int, host_budget: int | None, context: int, world_size: int) -> str | None:
    device, host = device_floor(cfg, world_size)
    need = sum(device.values()) + context
    if need > device_budget:
        parts = [f"{name} {format_bytes(v)}" for name, v in device.items() if v]
        if len(parts) == 1:
            parts[0] += " alone"
        parts += ["context"] if context else []
        return f"{' + '.join(parts)} = {format_bytes(need)} > {format_bytes(device_budget)}"
    if host_budget is not None and sum(host.values()) > host_budget:
        parts = " + ".join(f"{name} {format_bytes(v)}" for name, v in host.items() if v)
        return f"host: {parts} = {format_bytes(sum(host.values()))} > {format_bytes(host_budget)}"
    return None


NEGLIGIBLE_SAVING = 0.02
"""A floor-only choice that saves less than this share of the device budget (less the CUDA context) on the device
floor is not searched: it would only add a technique (an optimizer offload for LoRA's few adapter states). A choice
of the search, not a measurement (benchmarks/results/README.md): 2% is under the allocator margin's 5%, so a saving
it drops could not have decided a fit."""


def _worth_searching(cfg, knob: Knob, options: list[FitChoice], device_memory: int | None,
                     world_size: int) -> list[FitChoice]:
    """``options`` less the floor-only choices whose saving on ``cfg``'s device floor is negligible."""
    if not knob.floor_only or device_memory is None or len(options) < 2:
        return options

    def floor(choice: FitChoice) -> float:
        return sum(device_floor(with_overrides(cfg, choice.overrides), world_size)[0].values())

    plain = floor(options[0])
    for_tensors = device_memory - (CUDA_CONTEXT_BYTES if model_facts(cfg).cuda else 0)
    return [options[0]] + [c for c in options[1:] if plain - floor(c) >= NEGLIGIBLE_SAVING * for_tensors]


def candidates_of(cfg, schema, knobs: list[Knob] | None = None, *, device_memory: int | None = None,
                  world_size: int = 1) -> list[Candidate]:
    """Every combination of the knobs' choices over ``cfg`` that ``schema``'s rules accept, unordered, less the
    floor-only choices that save a negligible share of ``device_memory``. The last knob is the micro-batch: it is
    set in place on one copy per combination of the others."""
    knobs = registry_knobs() if knobs is None else knobs
    options = [_worth_searching(cfg, knob, knob.choices(cfg), device_memory, world_size) for knob in knobs]
    out = []
    for combo in itertools.product(*options[:-1]):
        overrides: dict = {}
        for choice in combo:
            overrides.update(choice.overrides)
        variant = with_overrides(cfg, overrides)
        for last in options[-1]:
            for key, value in last.overrides.items():
                OmegaConf.update(variant, key, value, merge=False, force_add=True)
            if schema is not None and any(rule(variant) for rule in schema.rules):
                continue
            chosen = (*combo, last)
            lossy = tuple(c.lossy for c in chosen if c.lossy)
            costs = step_costs(variant, world_size=world_size)
            out.append(Candidate({**overrides, **last.overrides}, tuple(c.level for c in chosen),
                                 costs.seconds_per_token, base=cfg, lossy=lossy, micro_batch=int(variant.batch_size),
                                 quality_cost=sum(c.quality_cost for c in chosen),
                                 transfer=costs.transfer_bytes_per_token))
    return out


def describe(changes: dict) -> str:
    """``changes`` as ``key=value ...`` (a component node by its class name), or ``(as configured)``."""
    return " ".join(f"{k}={_yaml(v)}" for k, v in changes.items()) or "(as configured)"


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        component = value.get("_component_")
        if component:
            return str(component).rsplit(".", 1)[-1]
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)
