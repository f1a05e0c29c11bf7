"""Frozen-weight offloading (``weight_offloading``): frozen weights wait in host memory and each group of blocks
(or each leaf module) comes to the compute device just before it runs, in forward, backward and recomputation.
The implementation: `offloader` beside this declaration."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mtune.config.schema import Key, KeyGroup, Node
from mtune.training.memory.technique import (FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, Settings,
                                             advice, setting)
from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING
from mtune.training.memory.techniques.compile import COMPILE

__all__ = ["WeightOffloadingTechnique", "WEIGHT_OFFLOADING", "WEIGHT_OFFLOADING_NODE", "WeightOffloading",
           "WeightOffloadingSettings", "WEIGHT_OFFLOADING_TYPES"]

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
    """The ``weight_offloading`` node, typed (`offloader` beside this declaration acts on it)."""

    type: str = _default("type")
    blocks_per_group: int = _default("blocks_per_group")
    use_streams: bool = _default("use_streams")

    @classmethod
    def from_node(cls, node: "Mapping[str, Any] | WeightOffloading | None") -> "WeightOffloading | None":
        """None stays None (off); a mapping's left-out keys take their declared defaults."""
        if node is None or isinstance(node, WeightOffloading):
            return node
        return cls(**{f.name: node[f.name] for f in fields(cls) if f.name in node})


@dataclass(frozen=True)
class WeightOffloadingSettings(Settings):
    weight_offloading: WeightOffloading | None = setting(None, WEIGHT_OFFLOADING_NODE.help,
                                                         node=WEIGHT_OFFLOADING_NODE.keys,
                                                         convert=WeightOffloading.from_node)


class WeightOffloadingTechnique(MemoryTechnique):
    name = "weight_offloading"
    Settings = WeightOffloadingSettings
    fit_knob = FitKnob("weight_offloading", floor_only=True, offloads=True)

    def enabled(self, s: WeightOffloadingSettings, memory: Any) -> bool:
        return s.weight_offloading is not None

    def rules(self, s: WeightOffloadingSettings, memory: Any) -> list[str]:
        """weight_offloading keeps frozen weights in host memory: a run must have some (the base of LoRA), and
        torch.compile is not run over blocks whose weights come and go (compiled blocks would capture weights that
        are freed between uses). The distributed recipes offload with fsdp_cpu_offload."""
        if s.weight_offloading is None:
            return []
        if memory.distributed:
            return ["weight_offloading is a single-device technique: the distributed recipes offload parameters, "
                    "gradients and optimizer states with fsdp_cpu_offload=true; set weight_offloading=null"]
        problems = []
        if memory.lora is None:
            problems.append("weight_offloading is set but every weight is trained (no lora node): it offloads frozen "
                            "weights only; fine-tune with LoRA (lora.modules) or set weight_offloading=null (for "
                            "optimizer states, optimizer_offload=cpu)")
        if memory[COMPILE].compile:
            problems.append("weight_offloading cannot be combined with compile=true (compiled blocks would capture "
                            "weights that are freed between uses): set compile=false or weight_offloading=null")
        return problems

    def footprint(self, s: WeightOffloadingSettings, memory: Any, facts: ModelFacts) -> Footprint:
        """Frozen weights on the host (block_level: the blocks' only; the embedding and output projection stay on the
        device); the blocks' come in for forward and again for backward, a third time for
        leaf_level's recomputation under checkpointing. leaf_level also moves the embedding and the output
        projection, each once, in forward (backward reads neither: the chunked loss fetches the head and computes
        in forward; a tied one comes twice but is counted once). block_level repeats over a group of
        ``blocks_per_group`` blocks and the next one beside it when prefetching (a leaf_level group is one module,
        inside a block)."""
        offloading = s.weight_offloading
        if offloading is None:
            return Footprint()
        leaf = offloading.type == "leaf_level"
        checkpointing = memory[ACTIVATION_CHECKPOINTING].enable_activation_checkpointing
        visits = 3 if leaf and checkpointing else 2
        moved = visits * facts.frozen_in_blocks + (facts.frozen_bytes - facts.frozen_in_blocks if leaf else 0.0)
        repeat = 1 if leaf else int(offloading.blocks_per_group) * (2 if offloading.use_streams else 1)
        return Footprint(frozen_weights_home="host" if leaf else "host_blocks", repeat_blocks=repeat,
                         transfer_bytes_per_token=moved / facts.micro_batch_tokens)

    def fit_choices(self, s: WeightOffloadingSettings, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """Frozen weights in host memory, one block (block_level) or one module (leaf_level) on the device at a
        time; only with frozen weights (a lora node)."""
        if memory.lora is None:
            return [FitChoice(0, {"weight_offloading": None})]
        return [FitChoice(0, {"weight_offloading": None}),
                FitChoice(1, {"weight_offloading": {"type": "block_level", "blocks_per_group": 1,
                                                    "use_streams": True}}),
                FitChoice(2, {"weight_offloading": {"type": "leaf_level", "blocks_per_group": 1,
                                                    "use_streams": True}})]

    def oom_advice(self, s: WeightOffloadingSettings, memory: Any) -> list[tuple[int, str]]:
        if not memory.distributed and memory.lora is not None and s.weight_offloading is None \
                and not memory[COMPILE].compile:
            return [advice("weight_offloading", "weight_offloading={type: block_level, blocks_per_group: 1}")]
        return []

    def on_model(self, model: Any, s: WeightOffloadingSettings, memory: Any, placement: Any) -> None:
        from mtune.training.memory.techniques.weight_offloading.offloader import apply_weight_offloading

        apply_weight_offloading(model, s.weight_offloading, placement=placement)

    def weights(self, s: WeightOffloadingSettings) -> Any:
        from mtune.training.memory.techniques.weight_offloading.offloader import OffloadedWeights

        return OffloadedWeights()


WEIGHT_OFFLOADING = WeightOffloadingTechnique()
