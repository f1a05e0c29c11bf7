"""Every memory technique, in the one order they are applied, and what is derived from them: the memory keys of
the training recipes (`MEMORY_KEYS`), their typed carrier (`MemoryConfig`), and the rules (`MEMORY_RULES`,
`DISTRIBUTED_MEMORY_RULES`).

A new technique is one module under ``techniques/`` and one line in `TECHNIQUES` (docs/architecture.md, "How to add
a memory technique"). Pure Python, no torch: ``mtune validate`` reads this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, make_dataclass
from typing import Any

from mtune.config.schema import KeyGroup, Node
from mtune.training.memory.technique import MemoryTechnique
from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING
from mtune.training.memory.techniques.activation_offloading import ACTIVATION_OFFLOADING
from mtune.training.memory.techniques.attention_kernel import ATTENTION_KERNEL
from mtune.training.memory.techniques.chunked_loss import CHUNKED_LOSS
from mtune.training.memory.techniques.compile import COMPILE
from mtune.training.memory.techniques.fsdp_cpu_offload import FSDP_CPU_OFFLOAD
from mtune.training.memory.techniques.lora import LORA, LORA_KEYS, LoraConfig
from mtune.training.memory.techniques.optimizer_in_backward import OPTIMIZER_IN_BACKWARD
from mtune.training.memory.techniques.optimizer_offload import OPTIMIZER_OFFLOAD
from mtune.training.memory.techniques.optimizer_state import OPTIMIZER_STATE
from mtune.training.memory.techniques.tiled_mlp import TILED_MLP
from mtune.training.memory.techniques.weight_offloading import WEIGHT_OFFLOADING, WeightOffloading
from mtune.training.memory.techniques.weight_storage import WEIGHT_STORAGE

__all__ = ["TECHNIQUES", "MEMORY_KEYS", "DISTRIBUTED_MEMORY_KEYS", "MemoryConfig", "LORA_KEYS", "LoraConfig",
           "WeightOffloading", "MEMORY_RULES", "DISTRIBUTED_MEMORY_RULES", "memory_keys", "technique_keys",
           "make_memory_config", "LORA", "WEIGHT_STORAGE", "WEIGHT_OFFLOADING", "ACTIVATION_CHECKPOINTING",
           "ACTIVATION_OFFLOADING", "COMPILE", "OPTIMIZER_STATE", "OPTIMIZER_IN_BACKWARD", "CHUNKED_LOSS",
           "OPTIMIZER_OFFLOAD", "FSDP_CPU_OFFLOAD", "TILED_MLP", "ATTENTION_KERNEL"]

TECHNIQUES: tuple[MemoryTechnique, ...] = (
    LORA,                      # adapters and NF4 bases: decide which modules exist and what is frozen
    WEIGHT_STORAGE,            # fp8 storage of the frozen block linears (needs to know what LoRA froze)
    WEIGHT_OFFLOADING,         # hooks on the modules holding frozen weights (after what is frozen is decided)
    TILED_MLP,                 # the MLP over tiles, reading (and dequantizing) the frozen weights once per pass
    ATTENTION_KERNEL,          # how packed rows reach attention: segment boundaries or a dense mask
    ACTIVATION_CHECKPOINTING,  # wraps each block's forward, adapters included
    ACTIVATION_OFFLOADING,     # the context entered around forward and backward; moves what checkpointing keeps
    COMPILE,                   # per block, last: compiles the checkpointed block as a unit
    OPTIMIZER_STATE,           # the rest act through the optimizer and the loss, not on the model
    OPTIMIZER_IN_BACKWARD,
    CHUNKED_LOSS,
    OPTIMIZER_OFFLOAD,
    FSDP_CPU_OFFLOAD,          # distributed recipes: set on FSDP2's sharding (training.distributed), not here
)
"""The memory techniques in the order `mtune.training.memory.apply.apply_memory_techniques` applies them (FSDP2
sharding comes after, in `mtune.training.model_setup`)."""


def technique_keys(techniques=TECHNIQUES) -> list:
    """The top-level keys the techniques declare, in registry order (LoRA's node excluded: `LORA_KEYS`)."""
    return [key for technique in techniques if technique is not LORA for key in technique.keys]


def memory_keys(techniques=TECHNIQUES) -> KeyGroup:
    return KeyGroup("memory", help="techniques that trade compute or transfers for memory, and compile",
                    keys=technique_keys(techniques))


MEMORY_KEYS = memory_keys()
"""The memory keys every training recipe reads (``SCHEMA``'s group "memory")."""

DISTRIBUTED_MEMORY_KEYS = KeyGroup(
    "distributed memory", help="memory techniques of FSDP2 runs (the distributed recipes only)",
    keys=[key for technique in TECHNIQUES for key in technique.distributed_keys])
"""The memory keys only the distributed recipes read, beside `MEMORY_KEYS`."""


def _from_config(cls, cfg: Mapping[str, Any]):
    """Read every field from a config whose defaults the recipe's schema has filled in (as ``mtune run`` does)."""
    missing = [f.name for f in fields(cls) if f.name not in cfg]
    if missing:
        raise KeyError(f"the config lacks {missing}: fill it with the recipe's SCHEMA.fill_defaults first")
    values = {f.name: cfg[f.name] for f in fields(cls)}
    for name, convert in _CONVERTERS.items():
        if name in values:
            values[name] = convert(values[name])
    return cls(**values)


# How a YAML value becomes a field of the frozen MemoryConfig, as each technique declares it.
_CONVERTERS = {key: convert for technique in TECHNIQUES for key, convert in technique.from_yaml.items()}


def make_memory_config(keys: list, name: str = "MemoryConfig"):
    """A frozen dataclass with one field per key: its YAML name, its declared default (converted as
    ``from_config`` converts the YAML value)."""
    specs = []
    for key in keys:
        default = None if isinstance(key, Node) else key.default
        specs.append((key.name, Any, _CONVERTERS.get(key.name, lambda value: value)(default)))
    cls = make_dataclass(name, specs, frozen=True, namespace={"from_config": classmethod(_from_config)})
    cls.__module__ = __name__
    return cls


MemoryConfig = make_memory_config(technique_keys())
MemoryConfig.__doc__ = (
    "The `MEMORY_KEYS` of a run, one field per key under its YAML name (built from the techniques' declarations), "
    "made once by ``MemoryConfig.from_config(cfg)`` and passed to the code that acts on them "
    "(`mtune.training.memory.apply.apply_memory_techniques`, `build_optimizer`). Defaults are the declarations' "
    "own; left out, every technique is off. ``weight_offloading`` is a `WeightOffloading` or None.")


def _collect(method: str):
    def rule(cfg) -> list[str]:
        return [problem for technique in TECHNIQUES for problem in getattr(technique, method)(cfg)]

    rule.__name__ = f"memory_{method}"
    rule.__doc__ = f"Every technique's ``{method}``, in registry order."
    return rule


MEMORY_RULES = (_collect("rules"),)
"""The rules of every technique, for every training recipe's `RecipeSchema`."""
DISTRIBUTED_MEMORY_RULES = MEMORY_RULES + (_collect("distributed_rules"),)
"""`MEMORY_RULES` and what each technique refuses under FSDP2, for the distributed recipes."""
