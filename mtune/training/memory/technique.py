"""What a memory technique is: one object that declares everything about itself, and the phases of a run it acts in.

A technique (a subclass of :class:`MemoryTechnique`, one package under ``mtune/training/memory/techniques/``, one
line in :mod:`mtune.training.memory.registry`) has

- **typed settings**: a frozen dataclass (``Settings``) whose fields are its config keys, declared with
  :func:`setting` (default, help, bounds); the schema, ``--help`` and the docs read the keys from it, and every hook
  receives the settings made once from the filled-in config, beside the run's `MemoryConfig` (the run's kind, the
  run keys techniques read, the other techniques' settings). No hook reads a raw config, none restates a default;
- **declarations**: whether it acts (:meth:`enabled`), its rules (:meth:`rules`), one planner value
  (:meth:`footprint`: where its tensors live, what it moves and steps on the host, the work backward repeats,
  whether it changes the numbers), its ``--fit`` dimension (``fit_knob``) and options (:meth:`fit_choices`),
  settings that hold at any row length (:meth:`length_overrides`) and its out-of-memory advice (:meth:`oom_advice`,
  in the named tiers of `ADVICE_TIERS`);
- **run phases**, optional hooks that `mtune.training.memory.phases` calls in the registry's order: on the meta
  model (:meth:`on_model`; it may return the context the step enters around forward and backward), on FSDP2's
  sharding options (:meth:`sharding_options`), on the weights through their life (:meth:`weights`, a
  `WeightPhases`: as each module's arrive, once all are in, before a save), and around the optimizer
  (:meth:`wrap_optimizer`).

That is thirteen members: ``name``, ``Settings``, ``fit_knob``, six declarations, four phases.

Pure Python, no torch at import: ``mtune validate`` reads the declarations. A phase imports its technique's
implementation (a torch module beside the declaration, in the same package) when it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mtune.config.schema import Key, KeyGroup, Node
from mtune.training.memory.footprint import (ADVICE_TIERS, QUALITY_TIERS, RUN_KINDS, BlockOffload, FitChoice, FitKnob,
                                             Footprint, ModelFacts, Recompute, advice)

__all__ = ["MemoryTechnique", "WeightPhases", "Settings", "NoSettings", "setting", "FitKnob", "FitChoice", "ModelFacts",
           "Footprint", "Recompute", "BlockOffload", "ADVICE_TIERS", "QUALITY_TIERS", "advice", "RUN_KINDS"]

# ---- typed settings ---------------------------------------------------------------------------------------------

def setting(default: Any, help: str, *, node: KeyGroup | None = None, convert=None,
            must_match_on_resume: bool = False, distributed_only: bool = False, **checks: Any) -> Any:
    """A field of a technique's ``Settings``: one config key of the same name with its ``default`` (the only place
    it is written), its ``help`` and its bounds (``choices=``, ``at_least=``, ``pattern=``, as `Key` takes them).
    ``node``: the key is a mapping with these inner keys (a `Node`), ``convert`` turns its YAML value into the
    field's type (None stays None). ``must_match_on_resume``: it changes what a step computes, so a resumed run must
    keep it (the others may change); ``distributed_only``: only the distributed recipes read it."""
    metadata = {"help": help, "node": node, "convert": convert, "checks": checks,
                "must_match_on_resume": must_match_on_resume, "distributed_only": distributed_only}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _key_type(hint: Any) -> Any:
    """The YAML type(s) a `Key` accepts for a field annotated ``hint`` (None is accepted through a None default)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = tuple(_key_type(arg) for arg in typing.get_args(hint) if arg is not type(None))
        return kinds[0] if len(kinds) == 1 else kinds
    if typing.get_origin(hint) in (tuple, list) or hint in (tuple, list):
        return list
    return hint


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_sequence(value: Any) -> bool:
    """A YAML list: a Python list or tuple, or OmegaConf's ListConfig (not imported here)."""
    return isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig"


@dataclass(frozen=True)
class Settings:
    """Base of every technique's typed settings: one field per config key, declared with :func:`setting`."""

    @classmethod
    def keys(cls) -> list[Key | Node]:
        """The config keys these fields declare, in field order: made once per class, so every key group that
        lists one (the training recipes', generate's) holds the same declaration."""
        if "_declared_keys" not in cls.__dict__:
            cls._declared_keys = cls._declare()
        return list(cls._declared_keys)

    @classmethod
    def must_match_on_resume(cls) -> tuple[str, ...]:
        """The keys a resumed run must keep."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("must_match_on_resume"))

    @classmethod
    def distributed_only(cls) -> tuple[str, ...]:
        """The keys only the distributed recipes read."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("distributed_only"))

    def describe(self) -> str:
        """Its setting for the run's log line of memory techniques (when the technique is on): its first key's
        value (``on`` for true)."""
        value = getattr(self, dataclasses.fields(self)[0].name) if dataclasses.fields(self) else True
        return "on" if value is True else str(value)

    @classmethod
    def _declare(cls) -> list[Key | Node]:
        hints = _hints(cls)
        declared = []
        for f in dataclasses.fields(cls):
            meta = f.metadata
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if meta.get("node") is not None:
                declared.append(Node(f.name, meta["help"], keys=meta["node"], **meta["checks"]))
            else:
                declared.append(Key(f.name, _key_type(hints[f.name]), default, meta["help"], **meta["checks"]))
        return declared

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> "Settings":
        """The settings from a mapping of key -> YAML value (a filled-in config); left-out keys take their declared
        defaults. Lists become tuples where the field is one, nodes their typed form (``convert``)."""
        hints = _hints(cls)
        given = {}
        for f in dataclasses.fields(cls):
            if f.name not in values:
                continue
            value = values[f.name]
            if value is not None and f.metadata.get("convert") is not None:
                value = f.metadata["convert"](value)
            elif _is_sequence(value) and typing.get_origin(hints[f.name]) is tuple:
                value = tuple(value)
            given[f.name] = value
        return cls(**given)


@dataclass(frozen=True)
class NoSettings(Settings):
    """A technique without keys of its own (its setting is another node's, e.g. the optimizer's component)."""


# ---- the contract -----------------------------------------------------------------------------------------------

class WeightPhases:
    """What a technique does to the model's weights through a run, for a technique that stores or moves them
    (NF4 or fp8 bases, offloaded weights, adapters over a loaded base). Every method is optional: the default
    leaves the weights as they are. `mtune.training.memory.phases` calls them in the registry's order."""

    def arrived(self, model: Any, module: Any) -> None:
        """``module``'s weights just arrived on the device (loaded or drawn, before the next module's): store or
        move them."""

    def stored_whole(self, module: Any, leaf: str) -> Any:
        """FSDP2 loading reads each rank's rows of a weight only; for a weight this technique stores from the whole
        tensor (NF4: its scales span every row), ``store(full, param) -> this rank's rows`` as it stores them; for a
        sharded expert stack (3-D in checkpoints), ``store(own experts, param, rank_experts=True)``, a collective
        each rank calls in the same order. None: the rows as they come."""
        return None

    def all_arrived(self, model: Any, sharded: bool, materialized: Any) -> None:
        """Every weight is in (each rank its rows when ``sharded``); ``materialized()`` is a context with every
        weight on the device in its full form."""

    def added(self, name: str) -> bool:
        """Whether the parameter ``name`` is one this technique adds to the model (an adapter): a base checkpoint
        does not hold it, and the run's summary counts it apart."""
        return False

    def full_form(self, model: Any) -> Any:
        """A context manager inside which every weight is on the device in its full form (saving, merging), or
        None."""
        return None

    def plain(self, tensor: Any) -> Any:
        """A weight this technique stores in another form (an NF4 shard) as the plain tensor it stands for, for a
        gathered save; None: not one of its."""
        return None


class MemoryTechnique:
    """The contract. Every member has a neutral default (no keys, no rule, nothing moved, lossless, not searched,
    no phase), so a technique overrides only what it has to say. ``s`` is the technique's own settings
    (``memory[self]``); ``memory`` the run's `MemoryConfig`."""

    name: str = ""
    """Its name in logs and docs (its main key where it has one)."""
    Settings: type[Settings] = NoSettings
    """Its typed settings: the keys the training recipes read."""
    fit_knob: FitKnob | None = None
    """Its ``mtune plan --fit`` dimension (options: :meth:`fit_choices`); None: left as configured."""

    # -- declarations
    def enabled(self, s: Any, memory: Any) -> bool:
        """Whether it acts in this run (its phases are called only then)."""
        return False

    def rules(self, s: Any, memory: Any) -> list[str]:
        """One-line problems of these settings in this run (``memory.kind`` says single device or distributed), each
        naming the keys and the fix."""
        return []

    def footprint(self, s: Any, memory: Any, facts: ModelFacts) -> Footprint:
        """What it does to memory and time for a model of these ``facts``, the work backward repeats included."""
        return Footprint()

    def fit_choices(self, s: Any, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """The options ``--fit`` tries for the user's settings, level 0 first."""
        return [FitChoice(0, {})]

    def length_overrides(self, s: Any, memory: Any, facts: ModelFacts, any_length: bool) -> dict:
        """For ``--maximize seq_len``, which plans one config at many row lengths: with ``any_length``, overrides
        that make its setting hold at every length (a tile count written for one length as ``auto``); without,
        the reverse at the config's own length (``auto``'s count written out, as ``--fit``'s candidate has it: the
        same plan under one cache key). Empty: nothing to change."""
        return {}

    def oom_advice(self, s: Any, memory: Any) -> list[tuple[int, str]]:
        """Settings that would lower the peak and are not set yet, as :func:`advice` pairs."""
        return []

    # -- run phases (`mtune.training.memory.phases` calls them in registry order, for enabled techniques only)
    def on_model(self, model: Any, s: Any, memory: Any, placement: Any) -> Any:
        """Transform the model built on the meta device, in place (adapters, hooks, wrappers, compile). Returns a
        context manager the step enters around forward and backward (activation offloading), or None."""

    def weights(self, s: Any) -> WeightPhases | None:
        """What it does to the weights as they arrive, once all are in, and before a save (`WeightPhases`); None:
        nothing."""
        return None

    def sharding_options(self, s: Any, memory: Any, placement: Any) -> dict:
        """Keyword arguments for FSDP2's ``fully_shard`` (distributed recipes)."""
        return {}

    def wrap_optimizer(self, spec: Any, named_params: list, s: Any, memory: Any, placement: Any) -> Any:
        """An optimizer over ``named_params`` (``(name, parameter)`` pairs) that steps elsewhere or elsewhen, built
        from the config's ``spec`` (`mtune.training.optimizers.OptimizerSpec`: ``cls``, ``kwargs_for(device)``,
        ``allocate(optimizer)``); None: the plain optimizer."""
        return None
