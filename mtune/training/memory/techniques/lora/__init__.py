"""LoRA / DoRA adapters, and QLoRA's NF4 base weights (the ``lora`` node): the base is frozen and only low-rank
adapters train, so gradients and optimizer states shrink to the adapters'. The implementation:
`mtune.modules.lora` (``apply_lora``) and, for the weights' phases (NF4 bases on arrival and under FSDP2, fresh
adapters), `adapters` beside this declaration."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mtune.config.keys import LORA_TARGETS
from mtune.config.schema import Key, KeyGroup, Node
from mtune.training.memory.technique import Footprint, MemoryTechnique, ModelFacts, Settings, advice, setting

__all__ = ["Lora", "LORA", "LORA_KEYS", "LoraConfig", "LoraSettings"]

_LORA_NODE = Node(
    "lora",
    "adapter settings; module names are Hugging Face's",
    keys=KeyGroup(
        "lora",
        [
            Key("modules", list, ["q_proj", "v_proj"], "linears to adapt: " + " ".join(LORA_TARGETS)),
            Key("rank", int, 8, "adapter rank r", at_least=1),
            Key("alpha", float, 16.0, "scale numerator: the update is scaled by alpha / rank", above=0),
            Key("dropout", float, 0.0, "dropout on the adapter input", at_least=0, below=1),
            Key("use_dora", bool, False, "DoRA: learn a per-output magnitude as well"),
            Key("quantize_base", bool, False, "QLoRA: store the frozen base linears as NF4"),
            Key("adapter_dir", str, None, "start from this saved PEFT adapter instead of a fresh one"),
        ],
    ),
    required=True,
)

LORA_KEYS = KeyGroup(
    "lora",
    help="low-rank adapters (LoRA, DoRA, QLoRA)",
    keys=[
        _LORA_NODE,
        Key("save_adapter_weights_only", bool, False, "save only the PEFT adapter, not the merged model as well"),
    ],
)
"""The keys the LoRA recipes read besides `MEMORY_KEYS`."""


def _default(name: str) -> Any:
    return next(key.default for key in _LORA_NODE.keys.keys if key.name == name)


@dataclass(frozen=True)
class LoraConfig:
    """The ``lora`` node, typed; left-out keys take their declared defaults."""

    modules: tuple[str, ...] = tuple(_default("modules"))
    rank: int = _default("rank")
    alpha: float = _default("alpha")
    dropout: float = _default("dropout")
    use_dora: bool = _default("use_dora")
    quantize_base: bool = _default("quantize_base")
    adapter_dir: str | None = _default("adapter_dir")

    @classmethod
    def from_node(cls, node: "Mapping[str, Any] | LoraConfig | None") -> "LoraConfig | None":
        """None stays None (a full fine-tune)."""
        if node is None or isinstance(node, LoraConfig):
            return node
        values = {f.name: node[f.name] for f in fields(cls) if f.name in node and node[f.name] is not None}
        if "modules" in values:
            values["modules"] = tuple(values["modules"])
        return cls(**values)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "LoraConfig | None":
        """The config's ``lora`` node, typed; None for a full fine-tune."""
        return cls.from_node(cfg.get("lora"))

    @property
    def method(self) -> str:
        """``lora``, ``dora``, ``lora+nf4`` or ``dora+nf4`` (for logs)."""
        return ("dora" if self.use_dora else "lora") + ("+nf4" if self.quantize_base else "")


@dataclass(frozen=True)
class LoraSettings(Settings):
    # modules, rank, alpha, dropout, DoRA, NF4: the trainable parameters, so a resume keeps them
    lora: LoraConfig | None = setting(None, "adapter settings; module names are Hugging Face's",
                                      node=_LORA_NODE.keys, convert=LoraConfig.from_node, must_match_on_resume=True,
                                      required=True)

    def describe(self) -> str:
        return self.lora.method if self.lora is not None else "off"


class Lora(MemoryTechnique):
    """LoRA is the recipe's method, declared and applied as a technique with the same phases: adapters on the meta
    model, NF4 bases quantized as their weights arrive, fresh adapters once the base is in, PEFT-compatible state."""

    name = "lora"
    Settings = LoraSettings

    def enabled(self, s: LoraSettings, memory: Any) -> bool:
        return s.lora is not None

    def rules(self, s: LoraSettings, memory: Any) -> list[str]:
        """The lora node's values; QLoRA needs adapters (a full fine-tune cannot train NF4 weights); a tied
        lm_head shares its weight with embed_tokens, so an adapter (or NF4) on one would change the other."""
        lora = s.lora
        if lora is None:
            return []
        problems = []
        if not lora.modules:
            if lora.quantize_base:
                problems.append("lora.quantize_base=true without lora.modules: NF4 base weights are frozen, so a full "
                                "fine-tune cannot use them: set lora.modules (QLoRA) or remove lora.quantize_base")
            else:
                problems.append("lora.modules is empty: list the layers to adapt, e.g. lora.modules=[q_proj,v_proj]")
        unknown = sorted(set(lora.modules) - set(LORA_TARGETS))
        if unknown:
            problems.append(f"lora.modules has unknown names {unknown}: choose from {list(LORA_TARGETS)}")
        if "lm_head" in lora.modules and memory.run.ties_embeddings():
            problems.append("lora.modules contains lm_head but the model ties lm_head to embed_tokens "
                            "(tie_word_embeddings): remove lm_head from lora.modules")
        if memory.distributed and lora.adapter_dir is not None:
            problems.append("lora.adapter_dir is not supported by the distributed recipes yet: start from the adapter "
                            "with lora_single_device, or resume a distributed run with resume_from_checkpoint")
        return problems

    def footprint(self, s: LoraSettings, memory: Any, facts: ModelFacts) -> Footprint:
        if s.lora is None:
            return Footprint()
        if not s.lora.quantize_base:
            return Footprint(shapes_parameters=True)  # adapters, a frozen base
        # 4 bits a weight and an int8 scale per block of 64 (torchao's NF4 adds an fp32 scale per 256 of those
        # blocks, 0.0002 byte a weight: left out, so that the floors built on it stay under the stored bytes)
        return Footprint(shapes_parameters=True, lossy="NF4 base weights", frozen_bytes_per_weight=0.5 + 1 / 64)

    def oom_advice(self, s: LoraSettings, memory: Any) -> list[tuple[int, str]]:
        if s.lora is None:
            return [advice("lora", "a LoRA recipe (lora_single_device) instead of a full fine-tune")]
        if not s.lora.quantize_base:
            return [advice("qlora", "lora.quantize_base=true (QLoRA)")]
        return []

    def on_model(self, model: Any, s: LoraSettings, memory: Any, placement: Any) -> None:
        from mtune.modules.lora import apply_lora

        lora = s.lora
        apply_lora(model, modules=list(lora.modules), rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                   use_dora=lora.use_dora, quantize_base=lora.quantize_base)

    def weights(self, s: LoraSettings) -> Any:
        from mtune.training.memory.techniques.lora.adapters import LoraWeights

        return LoraWeights()

    def sharding_options(self, s: LoraSettings, memory: Any, placement: Any) -> dict:
        from mtune.training.memory.techniques.lora.adapters import check_shardable

        check_shardable(s.lora)
        return {}


LORA = Lora()
