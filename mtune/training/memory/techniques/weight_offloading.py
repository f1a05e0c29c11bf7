"""Frozen-weight offloading (``weight_offloading``): frozen weights wait in host memory and each group of blocks
(or each leaf module) comes to the compute device just before it runs, in forward, backward and recomputation.
The implementation: `mtune.training.memory.weight_offloading`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mtune.config.schema import Key, KeyGroup, Node
from mtune.training.memory.technique import (FitChoice, MemoryTechnique, ModelFacts, get, is_distributed,
                                             single_device_only)

__all__ = ["WeightOffloadingTechnique", "WEIGHT_OFFLOADING", "WEIGHT_OFFLOADING_NODE", "WeightOffloading",
           "WEIGHT_OFFLOADING_TYPES"]

WEIGHT_OFFLOADING_TYPES = ("block_level", "leaf_level")

WEIGHT_OFFLOADING_NODE = Node(
    "weight_offloading",
    "frozen weights wait in host memory; each group of blocks (or each leaf module) is copied to the compute device "
    "just before it runs and freed after, in forward, backward and recomputation (null: off)",
    keys=KeyGroup(
        "weight_offloading",
        [
            Key("type", str, "block_level", "block_level: groups of blocks_per_group transformer blocks; leaf_level: "
                "each module holding weights on its own (least memory, most transfers)",
                choices=WEIGHT_OFFLOADING_TYPES),
            Key("blocks_per_group", int, 1, "block_level: transformer blocks copied in together", at_least=1),
            Key("use_streams", bool, True, "prefetch the next group while the current one computes (twice the groups "
                "on the device): on CUDA on a side stream from pinned memory; elsewhere in line, no overlap"),
        ],
    ),
)
"""``weight_offloading``: read by the training recipes (through `MEMORY_KEYS`) and by ``generate``; one
declaration."""


def _default(name: str) -> Any:
    return next(key.default for key in WEIGHT_OFFLOADING_NODE.keys.keys if key.name == name)


@dataclass(frozen=True)
class WeightOffloading:
    """The ``weight_offloading`` node, typed (`mtune.training.memory.weight_offloading` acts on it)."""

    type: str = _default("type")
    blocks_per_group: int = _default("blocks_per_group")
    use_streams: bool = _default("use_streams")

    @classmethod
    def from_node(cls, node: "Mapping[str, Any] | WeightOffloading | None") -> "WeightOffloading | None":
        """None stays None (off); a mapping's left-out keys take their declared defaults."""
        if node is None or isinstance(node, WeightOffloading):
            return node
        return cls(**{f.name: node[f.name] for f in fields(cls) if f.name in node})


class WeightOffloadingTechnique(MemoryTechnique):
    name = "weight_offloading"
    keys = (WEIGHT_OFFLOADING_NODE,)
    from_yaml = {"weight_offloading": WeightOffloading.from_node}
    supports_compile = False  # compiled blocks would capture weights that are freed between uses
    fit_knob = "weight_offloading"
    fit_saves_floor_only = True

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.weight_offloading is not None

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> None:
        from mtune.training.memory.weight_offloading import apply_weight_offloading

        apply_weight_offloading(model, memory.weight_offloading, placement=placement)

    def describe(self, memory: Any, lora: Any = None) -> str:
        return str(memory.weight_offloading)

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """Frozen weights in host memory, one block (block_level) or one module (leaf_level) on the device at a
        time; only with frozen weights (a lora node)."""
        if cfg.get("lora") is None:
            return [FitChoice(0, {"weight_offloading": None})]
        return [FitChoice(0, {"weight_offloading": None}),
                FitChoice(1, {"weight_offloading": {"type": "block_level", "blocks_per_group": 1, "use_streams": True}}),
                FitChoice(2, {"weight_offloading": {"type": "leaf_level", "blocks_per_group": 1, "use_streams": True}})]

    def rules(self, cfg: Any) -> list[str]:
        """weight_offloading keeps frozen weights in host memory: a run must have some (the base of LoRA), and
        torch.compile is not run over blocks whose weights come and go."""
        if get(cfg, "weight_offloading") is None:
            return []
        problems = []
        if get(cfg, "lora") is None:
            problems.append("weight_offloading is set but every weight is trained (no lora node): it offloads frozen "
                            "weights only; fine-tune with LoRA (lora.modules) or set weight_offloading=null (for "
                            "optimizer states, optimizer_offload=cpu)")
        if get(cfg, "compile", False):
            problems.append("weight_offloading cannot be combined with compile=true (compiled blocks would capture "
                            "weights that are freed between uses): set compile=false or weight_offloading=null")
        return problems

    def distributed_rules(self, cfg: Any) -> list[str]:
        return single_device_only(cfg, "weight_offloading")

    def frozen_weights_home(self, cfg: Any) -> str | None:
        return "host" if get(cfg, "weight_offloading") else None

    def planning_blocks(self, cfg: Any) -> int:
        """block_level: a group of ``blocks_per_group`` blocks, and the next one beside it when prefetching; a
        leaf_level group is one module, inside a block."""
        offloading = get(cfg, "weight_offloading")
        if not offloading or get(offloading, "type", "block_level") != "block_level":
            return 1
        return int(get(offloading, "blocks_per_group", 1)) * (2 if get(offloading, "use_streams", True) else 1)

    def transfer_bytes_per_token(self, cfg: Any, facts: ModelFacts) -> float:
        """Every frozen weight comes in for forward and again for backward, a third time for leaf_level's
        recomputation under checkpointing."""
        offloading = cfg.get("weight_offloading")
        if not offloading:
            return 0.0
        visits = 3 if offloading.get("type") == "leaf_level" and cfg.get("enable_activation_checkpointing") else 2
        return visits * facts.frozen_bytes / facts.micro_batch_tokens

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        single_device = not is_distributed(cfg)  # the distributed recipes offload with fsdp_cpu_offload
        if single_device and cfg.get("lora") is not None and cfg.get("weight_offloading") is None \
                and not cfg.get("compile"):
            return [(90, "weight_offloading={type: block_level, blocks_per_group: 1}")]
        return []


WEIGHT_OFFLOADING = WeightOffloadingTechnique()
