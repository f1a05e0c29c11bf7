"""LoRA / DoRA adapters, and QLoRA's NF4 base weights (the ``lora`` node): the base is frozen and only low-rank
adapters train, so gradients and optimizer states shrink to the adapters'. The implementation:
`mtune.modules.lora` (``apply_lora``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from mtune.config.keys import LORA_TARGETS
from mtune.config.schema import Key, KeyGroup, Node
from mtune.training.memory.technique import MemoryTechnique, get

__all__ = ["Lora", "LORA", "LORA_KEYS", "LoraConfig"]

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


def _ties_embeddings(cfg: Any) -> bool | None:
    explicit = get(cfg, "model.tie_embeddings")
    if explicit is not None:
        return bool(explicit)
    checkpoint_dir = get(cfg, "model.checkpoint_dir")
    if checkpoint_dir is None:
        return None
    config_file = Path(str(checkpoint_dir)) / "config.json"
    if not config_file.is_file():
        return None  # another rule reports a missing checkpoint
    # Llama, Qwen2 and Mistral configs all default to untied when the field is absent.
    return bool(json.loads(config_file.read_text()).get("tie_word_embeddings", False))


class Lora(MemoryTechnique):
    name = "lora"
    keys = (_LORA_NODE,)
    must_match_on_resume = ("lora",)  # modules, rank, alpha, dropout, DoRA, NF4: the trainable parameters

    def enabled(self, memory: Any, lora: LoraConfig | None = None) -> bool:
        return lora is not None

    def apply(self, model: Any, memory: Any, *, lora: LoraConfig, placement: Any) -> None:
        from mtune.modules.lora import apply_lora

        apply_lora(model, modules=list(lora.modules), rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                   use_dora=lora.use_dora, quantize_base=lora.quantize_base)

    def describe(self, memory: Any, lora: LoraConfig | None = None) -> str:
        return lora.method if lora is not None else "off"

    def rules(self, cfg: Any) -> list[str]:
        """The lora node's values; QLoRA needs adapters (a full fine-tune cannot train NF4 weights); a tied
        lm_head shares its weight with embed_tokens, so an adapter (or NF4) on one would change the other."""
        problems = []
        if get(cfg, "quantize_base") is not None or get(cfg, "model.quantize_base") is not None:
            problems.append("quantize_base belongs in the lora node: use lora.quantize_base=true (QLoRA); a full "
                            "fine-tune cannot train NF4 weights")
        if get(cfg, "lora") is None:
            return problems
        if not get(cfg, "lora.modules"):
            if get(cfg, "lora.quantize_base", False):
                problems.append("lora.quantize_base=true without lora.modules: NF4 base weights are frozen, so a full "
                                "fine-tune cannot use them: set lora.modules (QLoRA) or remove lora.quantize_base")
            else:
                problems.append("lora.modules is empty: list the layers to adapt, e.g. lora.modules=[q_proj,v_proj]")
        unknown = sorted(set(get(cfg, "lora.modules", [])) - set(LORA_TARGETS))
        if unknown:
            problems.append(f"lora.modules has unknown names {unknown}: choose from {list(LORA_TARGETS)}")
        if "lm_head" in (get(cfg, "lora.modules") or []) and _ties_embeddings(cfg):
            problems.append("lora.modules contains lm_head but the model ties lm_head to embed_tokens "
                            "(tie_word_embeddings): remove lm_head from lora.modules")
        return problems

    def distributed_rules(self, cfg: Any) -> list[str]:
        if get(cfg, "lora.adapter_dir") is not None:
            return ["lora.adapter_dir is not supported by the distributed recipes yet: start from the adapter with "
                    "lora_single_device, or resume a distributed run with resume_from_checkpoint"]
        return []

    def lossy(self, cfg: Any) -> str | None:
        return "NF4 base weights" if get(cfg, "lora.quantize_base", False) else None

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        lora = cfg.get("lora")
        if lora is None:
            return [(40, "a LoRA recipe (lora_single_device) instead of a full fine-tune")]
        if not lora.get("quantize_base"):
            return [(50, "lora.quantize_base=true (QLoRA)")]
        return []


LORA = Lora()
