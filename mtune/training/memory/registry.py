"""Every memory technique, in the one order its phases run, and what is derived from them: the memory keys of the
training recipes (`MEMORY_KEYS`, `DISTRIBUTED_MEMORY_KEYS`, `LORA_KEYS`), the run's typed settings (`MemoryConfig`)
and the rules (`MEMORY_RULES`, `DISTRIBUTED_MEMORY_RULES`).

A new technique is one package under ``techniques/`` and one line in `TECHNIQUES` (docs/architecture.md, "How to
add a memory technique"). Pure Python, no torch: ``mtune validate`` reads this.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mtune.config.keys import DISTRIBUTED_KEYS, RUN_KEYS, run_kind
from mtune.config.schema import KeyGroup
from mtune.training.memory.technique import RUN_KINDS, MemoryTechnique, Settings
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
from mtune.training.memory.techniques.weight_offloading import WEIGHT_OFFLOADING
from mtune.training.memory.techniques.weight_storage import WEIGHT_STORAGE

__all__ = ["TECHNIQUES", "MEMORY_KEYS", "DISTRIBUTED_MEMORY_KEYS", "GENERATION_MEMORY_KEYS", "LORA_KEYS",
           "LoraConfig", "MemoryConfig", "RunKeys", "MEMORY_RULES", "DISTRIBUTED_MEMORY_RULES", "memory_keys",
           "reference_copy_memory"]

TECHNIQUES: tuple[MemoryTechnique, ...] = (
    LORA,                      # adapters and NF4 bases: decide which modules exist and what is frozen
    WEIGHT_STORAGE,            # fp8 storage of the frozen block linears (needs to know what LoRA froze)
    WEIGHT_OFFLOADING,         # hooks on the modules holding frozen weights (after what is frozen is decided)
    TILED_MLP,                 # the MLP over tiles, reading (and dequantizing) the frozen weights once per pass
    ATTENTION_KERNEL,          # how packed rows reach attention: segment boundaries or a dense mask
    ACTIVATION_CHECKPOINTING,  # wraps each block's forward, adapters included
    ACTIVATION_OFFLOADING,     # the context entered around forward and backward; moves what checkpointing keeps
    COMPILE,                   # per block, last: compiles the checkpointed block as a unit
    OPTIMIZER_STATE,           # the rest act through the optimizer, the loss and FSDP2, not on the model
    OPTIMIZER_IN_BACKWARD,
    CHUNKED_LOSS,
    OPTIMIZER_OFFLOAD,
    FSDP_CPU_OFFLOAD,          # distributed recipes: FSDP2's own offload policy (a sharding option)
)
"""The memory techniques in the order `mtune.training.memory.phases` runs each phase (FSDP2 sharding comes between
the model phase and the weights' arrival)."""


def _keys(technique: MemoryTechnique) -> list:
    distributed = set(technique.Settings.distributed_only())
    return [key for key in technique.Settings.keys() if key.name not in distributed]


def memory_keys(techniques=TECHNIQUES) -> KeyGroup:
    """The keys every training recipe reads of ``techniques`` (LoRA's node excluded: `LORA_KEYS`)."""
    return KeyGroup("memory", help="techniques that trade compute or transfers for memory, and compile",
                    keys=[key for technique in techniques if technique is not LORA for key in _keys(technique)])


MEMORY_KEYS = memory_keys()
"""The memory keys every training recipe reads (``SCHEMA``'s group "memory")."""

GENERATION_MEMORY_KEYS = KeyGroup(
    "offloading", help="memory techniques of generation (the generate recipe)",
    keys=[key for key in WEIGHT_OFFLOADING.Settings.keys()])
"""The memory keys the generate recipe reads: frozen-weight offloading (every weight is frozen there)."""

DISTRIBUTED_MEMORY_KEYS = KeyGroup(
    "distributed memory", help="memory techniques of FSDP2 runs (the distributed recipes only)",
    keys=[key for technique in TECHNIQUES for key in technique.Settings.keys()
          if key.name in technique.Settings.distributed_only()])
"""The memory keys only the distributed recipes read, beside `MEMORY_KEYS`."""


def _declared(group: KeyGroup, name: str) -> Any:
    return next(key.default for key in group.keys if key.name == name)


def _node(cfg: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = cfg.get(name) if cfg is not None else None
    return value if isinstance(value, Mapping) or hasattr(value, "keys") else {}


@dataclass(frozen=True)
class RunKeys:
    """The run's keys (not a technique's) that techniques read, typed; left out, the declared defaults."""

    dtype: str = _declared(RUN_KEYS, "dtype")
    batch_size: int = _declared(RUN_KEYS, "batch_size")
    gradient_accumulation_steps: int = _declared(RUN_KEYS, "gradient_accumulation_steps")
    clip_grad_norm: float | None = _declared(RUN_KEYS, "clip_grad_norm")
    max_seq_len: int | None = None
    """``tokenizer.max_seq_len``."""
    packed: bool = False
    """``dataset.packed``."""
    optimizer: tuple[tuple[str, Any], ...] = ()
    """The ``optimizer`` node's items (``_component_`` and keyword arguments)."""
    loss: tuple[tuple[str, Any], ...] = ()
    """The ``loss`` node's items."""
    fsdp_reshard_after_forward: bool = _declared(DISTRIBUTED_KEYS, "fsdp_reshard_after_forward")
    checkpoint_dir: str | None = None
    """``model.checkpoint_dir``."""
    tie_embeddings: bool | None = None
    """``model.tie_embeddings`` where a config states it (else the checkpoint's ``config.json`` says)."""

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "RunKeys":
        def items(name: str) -> tuple:
            node = _node(cfg, name)
            return tuple((str(k), _plain(node[k])) for k in node)

        given = {f.name: cfg[f.name] for f in fields(cls) if f.name in cfg and cfg[f.name] is not None}
        return cls(**{k: v for k, v in given.items() if k not in ("optimizer", "loss", "checkpoint_dir")},
                   tie_embeddings=_node(cfg, "model").get("tie_embeddings"),
                   max_seq_len=_node(cfg, "tokenizer").get("max_seq_len"),
                   packed=bool(_node(cfg, "dataset").get("packed") or False),
                   optimizer=items("optimizer"), loss=items("loss"),
                   checkpoint_dir=_node(cfg, "model").get("checkpoint_dir"))

    @property
    def optimizer_component(self) -> str:
        return str(dict(self.optimizer).get("_component_") or "")

    @property
    def loss_component(self) -> str:
        return str(dict(self.loss).get("_component_") or "")

    @property
    def micro_batch_tokens(self) -> int:
        return int(self.batch_size) * int(self.max_seq_len or 0)

    def ties_embeddings(self) -> bool | None:
        """Whether the model ties ``lm_head`` to ``embed_tokens`` (None: no checkpoint to read)."""
        if self.tie_embeddings is not None:
            return bool(self.tie_embeddings)
        if self.checkpoint_dir is None:
            return None
        config_file = Path(str(self.checkpoint_dir)) / "config.json"
        if not config_file.is_file():
            return None  # another rule reports a missing checkpoint
        # Llama, Qwen2 and Mistral configs all default to untied when the field is absent.
        return bool(json.loads(config_file.read_text()).get("tie_word_embeddings", False))


def _plain(value: Any) -> Any:
    """A config value as plain, hashable Python (lists as tuples, mappings as sorted item tuples)."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return tuple(_plain(v) for v in value)
    if isinstance(value, Mapping) or type(value).__name__ == "DictConfig":
        return tuple(sorted((str(k), _plain(value[k])) for k in value))
    return value


def _owners() -> dict[str, MemoryTechnique]:
    """Which technique declares each key (the registry as it is now: tests register techniques of their own)."""
    return {key.name: technique for technique in TECHNIQUES for key in technique.Settings.keys()}


class MemoryConfig:
    """A run's memory settings, typed, made once from the filled-in config (``MemoryConfig.from_config(cfg)``) or
    from keyword arguments under the keys' YAML names (``MemoryConfig(enable_activation_checkpointing=True)``: left
    out, each key's declared default, so every technique is off). ``memory[technique]`` is that technique's
    `Settings`; ``memory.kind`` is ``single_device`` or ``distributed``; ``memory.run`` the run keys techniques read
    (`RunKeys`). Immutable and hashable; ``memory.lora`` is the `LoraConfig`, or None for a full fine-tune."""

    __slots__ = ("kind", "run", "_settings")

    def __init__(self, kind: str = "single_device", run: RunKeys | None = None, **values: Any):
        if kind not in RUN_KINDS:
            raise ValueError(f"kind must be one of {RUN_KINDS}, got {kind!r}")
        unknown = sorted(set(values) - set(_owners()))
        if unknown:
            raise TypeError(f"MemoryConfig: unknown keys {unknown} (a technique's keys, by their YAML names)")
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "run", run or RunKeys())
        object.__setattr__(self, "_settings", {t: t.Settings.from_values(values) for t in TECHNIQUES})

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], kind: str | None = None) -> "MemoryConfig":
        """The settings of ``cfg`` (defaults filled in by the recipe's schema, as ``mtune run`` does; a key left out
        takes its declared default). ``kind`` defaults to `mtune.config.keys.run_kind`'s answer."""
        return cls(kind or run_kind(cfg), RunKeys.from_config(cfg), **{n: cfg[n] for n in _owners() if n in cfg})

    def replace(self, **values: Any) -> "MemoryConfig":
        """A copy with these keys (YAML names) set; ``lora`` takes a mapping, a `LoraConfig` or None."""
        current = {f.name: getattr(s, f.name) for s in self._settings.values() for f in fields(s)}
        return MemoryConfig(self.kind, self.run, **{**current, **values})

    def without(self, technique: MemoryTechnique) -> "MemoryConfig":
        """A copy with ``technique``'s keys at their declared defaults (off)."""
        return self.replace(**{f.name: getattr(technique.Settings(), f.name) for f in fields(technique.Settings)})

    def __getitem__(self, technique: MemoryTechnique) -> Settings:
        settings = self._settings.get(technique)
        return settings if settings is not None else technique.Settings()

    def __getattr__(self, name: str) -> Any:
        """A technique key's value under its YAML name (``memory.compile``), for reading; code that acts on a key
        asks its technique."""
        owner = _owners().get(name)
        if owner is None:
            raise AttributeError(name)
        return getattr(self[owner], name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MemoryConfig is immutable")

    @property
    def lora(self) -> LoraConfig | None:
        return self[LORA].lora

    @property
    def distributed(self) -> bool:
        return self.kind == "distributed"

    def _identity(self) -> tuple:
        return self.kind, self.run, tuple(self._settings.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemoryConfig) and self._identity() == other._identity()

    def __hash__(self) -> int:
        return hash(self._identity())

    def __repr__(self) -> str:
        changed = [repr(s) for s in self._settings.values() if s != type(s)()]
        return f"MemoryConfig({self.kind}{''.join(', ' + c for c in changed)})"


def reference_copy_memory(storage_dtype: str | None) -> MemoryConfig:
    """The memory settings of a preference run's frozen reference copy (``reference: copy``): no technique but, with
    ``storage_dtype`` (``reference_storage_dtype``, an fp8 format), weight storage's fp8 block linears."""
    return MemoryConfig() if storage_dtype is None else MemoryConfig(weight_storage_dtype=storage_dtype)


def _rules(kind: str):
    def rule(cfg) -> list[str]:
        memory = MemoryConfig.from_config(cfg, kind)
        return [problem for technique in TECHNIQUES for problem in technique.rules(memory[technique], memory)]

    rule.__name__ = f"memory_rules_{kind}"
    rule.__doc__ = f"Every technique's rules for a {kind} run, in registry order."
    return rule


MEMORY_RULES = (_rules("single_device"),)
"""The rules of every technique, for the single-device recipes' `RecipeSchema`."""
DISTRIBUTED_MEMORY_RULES = (_rules("distributed"),)
"""The rules of every technique under FSDP2, for the distributed recipes."""
