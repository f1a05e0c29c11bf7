"""What a memory technique is: one object that declares everything about itself.

A technique (a subclass of :class:`MemoryTechnique`, one module under ``mtune/training/memory/techniques/``, one
line in :mod:`mtune.training.memory.registry`) says

- its config keys with defaults and help (``keys``: the schema, ``--help``, `MemoryConfig` and the docs read them;
  ``distributed_keys``: those only the distributed recipes read);
- its rules: incompatible flags and requirements, on one device (:meth:`rules`) and under FSDP2
  (:meth:`distributed_rules`);
- how it is applied to a built model (:meth:`apply`, called by
  :func:`mtune.training.memory.apply.apply_memory_techniques` in the registry's order);
- which of its keys a resumed run must keep (``must_match_on_resume``; the others may change);
- its ``mtune plan --fit`` choices (:attr:`fit_knob`, :meth:`fit_choices`), whether a configuration of it changes the numbers a step
  computes (:meth:`lossy`), the bytes it moves between device and host per token (:meth:`transfer_bytes_per_token`)
  and its out-of-memory advice (:meth:`oom_advice`);
- whether it runs under ``torch.compile`` (``supports_compile``).

Pure Python, no torch at import: ``mtune validate`` reads the declarations. A technique's :meth:`apply` imports its
implementation (a torch module) when it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["MemoryTechnique", "FitChoice", "ModelFacts", "get", "is_distributed", "single_device_only"]


def get(cfg: Any, dotted: str, default: Any = None) -> Any:
    """``cfg``'s value at a dotted path (``"lora.quantize_base"``); ``default`` where any part is absent or null."""
    node = cfg
    for part in dotted.split("."):
        if node is None or not hasattr(node, "get") or part not in node:
            return default
        node = node[part]
    return default if node is None else node


def is_distributed(cfg: Any) -> bool:
    """Whether ``cfg`` is a distributed recipe's config: only those declare ``fsdp_cpu_offload``."""
    return cfg is not None and "fsdp_cpu_offload" in cfg


def single_device_only(cfg: Any, key: str) -> list[str]:
    """The distributed recipes' refusal of a single-device offload technique set at ``key`` (FSDP2 offloads with
    its own ``fsdp_cpu_offload``)."""
    if get(cfg, key) is None:
        return []
    return [f"{key} is a single-device technique: the distributed recipes offload parameters, gradients and "
            f"optimizer states with fsdp_cpu_offload=true; set {key}=null"]


class FitChoice(tuple):
    """One option of a technique in the ``--fit`` search: the pair ``(level, overrides)`` (a higher level saves more
    memory; level 0 leaves the technique off), and ``lossy``: when the option changes what a step computes compared
    with the user's config, what is given up, in a few words (None: the same numbers). ``quality_cost`` ranks what
    is given up (``--fit`` tries the cheapest loss of quality first): 1 gradient clipping dropped, 2 8-bit
    optimizer states, 3 fp8 base weights, 5 NF4 base weights (their measured drifts: docs/plan.md).

    An override whose value is a mapping replaces that node whole (``{"loss": {...}}``): no key of the component
    it replaces survives."""

    def __new__(cls, level: int, overrides: dict, lossy: str | None = None, quality_cost: int = 0) -> "FitChoice":
        choice = super().__new__(cls, (level, overrides))
        choice.lossy = lossy
        choice.quality_cost = quality_cost if lossy else 0
        return choice

    @property
    def level(self) -> int:
        return self[0]

    @property
    def overrides(self) -> dict:
        return self[1]


@dataclass(frozen=True)
class ModelFacts:
    """What the cost model knows of a candidate: the model's shape and stored bytes, and the tokens of a
    micro-batch and of an optimizer step."""

    n_layers: int
    dim: int
    trainable_bytes: float
    """Trainable parameters as stored (fp32 under ``dtype=fp16``: its weights are fp32)."""
    frozen_bytes: float
    """Frozen parameters as stored (NF4 about 0.53 byte a weight with its scales, fp8 one byte)."""
    residual_bytes: int
    """Bytes per element of the residual stream between blocks (what offloaded block inputs hold): the storage
    dtype's, since under fp16 autocast the stream stays fp32."""
    micro_batch_tokens: int
    step_tokens: int
    cuda: bool = False
    """Whether the run computes on a CUDA device (paged optimizer states exist only there)."""
    trainable_numel: int = 0
    """Trainable parameter elements (optimizer states and the host optimizer step scale with them)."""
    world_size: int = 1
    """Ranks the model is sharded over (FSDP2); the bytes above are the whole model's."""

    @property
    def micro_batches(self) -> int:
        return max(1, self.step_tokens // max(1, self.micro_batch_tokens))


class MemoryTechnique:
    """The contract. Every method has a neutral default (no rule, no transfer, no advice, lossless, not searched),
    so a technique overrides only what it has to say."""

    name: str = ""
    """The technique's name in logs and docs (its main key where it has one)."""
    keys: tuple = ()
    """Its top-level config keys (`mtune.config.schema.Key` / `Node`), in the order the docs list them."""
    distributed_keys: tuple = ()
    """Keys only the distributed recipes read (`mtune.training.memory.registry.DISTRIBUTED_MEMORY_KEYS`)."""
    must_match_on_resume: tuple[str, ...] = ()
    """Those of its keys a resumed run must keep (they change what a step computes); the rest may change."""
    from_yaml: Mapping[str, Any] = {}
    """``{key: convert}`` for keys whose YAML value becomes another type in `MemoryConfig` (a node its typed
    dataclass, a list a tuple); the others are carried as they are."""
    supports_compile: bool = True
    """Whether it runs with ``compile=true`` (a rule refuses the pair otherwise)."""
    fit_knob: str | None = None
    """The name of its ``mtune plan --fit`` dimension (:meth:`fit_choices`), or None when the search leaves it as
    configured."""
    fit_saves_floor_only: bool = False
    """Whether all its choices save is in the floor ``--fit`` computes before planning (weights, optimizer states,
    gradients), none in activations: then a choice whose floor saving is negligible for the budget is not searched
    (an optimizer offload for LoRA's few adapter states)."""

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        """Whether the run's `MemoryConfig` (and `LoraConfig`, None for a full fine-tune) turn it on; :meth:`apply`
        is called only then."""
        return False

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> Any:
        """Transform ``model`` in place; return a context manager the step enters around forward and backward, or
        None."""
        return None

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """The options ``--fit`` tries for the user's ``cfg`` (its model's ``facts``), level 0 first."""
        return [FitChoice(0, {})]

    def for_any_length(self, cfg: Any) -> dict:
        """Overrides that make this technique's setting in ``cfg`` hold at every row length (``--fit --maximize
        seq_len`` plans one config at many lengths): e.g. a tile count written for one length as ``auto``, the
        dense mask as segments. Empty: the setting holds already."""
        return {}

    def describe(self, memory: Any, lora: Any = None) -> str:
        """The technique's setting, for the run's one log line of memory techniques."""
        return "on" if self.enabled(memory, lora) else "off"

    def rules(self, cfg: Any) -> list[str]:
        """One-line problems of ``cfg`` (defaults filled in), each naming the keys and the fix."""
        return []

    def distributed_rules(self, cfg: Any) -> list[str]:
        """Problems under the distributed (FSDP2) recipes, beyond :meth:`rules`."""
        return []

    def lossy(self, cfg: Any) -> str | None:
        """What this technique, as ``cfg`` configures it, gives up in the numbers a step computes (None: nothing;
        the same step as without it, up to floating-point round-off)."""
        return None

    def transfer_bytes_per_token(self, cfg: Any, facts: ModelFacts) -> float:
        """Bytes moved between the device and the host per trained token, as ``cfg`` configures it."""
        return 0.0

    def state_home(self, cfg: Any) -> str | None:
        """Where this technique, as ``cfg`` configures it, keeps the optimizer states: ``"host"`` (stepped there),
        ``"managed"`` (CUDA managed memory: paged by the driver, outside the caching allocator), or None (it says
        nothing: the device)."""
        return None

    def frozen_weights_home(self, cfg: Any) -> str | None:
        """``"host"`` when this technique keeps the frozen weights in host memory between uses, else None."""
        return None

    def trainable_weights_home(self, cfg: Any) -> str | None:
        """``"host"`` when this technique keeps the trainable weights in host memory between uses (the device
        holds them only while a block computes), else None."""
        return None

    def planning_blocks(self, cfg: Any) -> int:
        """The fewest consecutive transformer blocks over which this technique, as ``cfg`` configures it, repeats
        its per-block memory in its steady state (every Nth block checkpointed: N; weight offloading's groups, two
        of them with prefetch). ``--fit`` plans shortened models of multiples of it and extrapolates per layer."""
        return 1

    def state_bytes_per_element(self, cfg: Any, facts: ModelFacts) -> float | None:
        """Optimizer-state bytes per trainable element, where this technique decides them (None: not its say)."""
        return None

    def host_step_elements(self, cfg: Any, facts: ModelFacts) -> int:
        """Trainable elements whose optimizer step runs on the host CPU each step (the cost model prices them)."""
        return 0

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        """``(rank, flag)`` settings that would lower the peak and are not set in ``cfg`` yet; a lower rank is
        more effective (`mtune.training.memory.oom` merges every technique's advice by rank)."""
        return []
