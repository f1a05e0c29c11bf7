"""The chunked cross-entropy (``loss._component_: mtune.modules.loss.ChunkedCrossEntropyLoss``): the output
projection and the loss run over chunks of the sequence, so the fp32 logits ``[b, s, vocab]`` never exist whole.
No key of its own: the loss node names it. The implementation: `mtune.modules.loss`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtune.training.memory.technique import FitChoice, MemoryTechnique, ModelFacts, get

__all__ = ["ChunkedLoss", "CHUNKED_LOSS"]


class ChunkedLoss(MemoryTechnique):
    name = "chunked_loss"
    fit_knob = "loss"

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """The plain loss, or the chunked one (keeping the user's ``num_chunks``): each choice replaces the loss node
        whole, so no key of one loss reaches the other (``CrossEntropyLoss`` takes no ``num_chunks``)."""
        chunks = get(cfg, "loss.num_chunks", 8)
        return [FitChoice(0, {"loss": {"_component_": "mtune.modules.loss.CrossEntropyLoss"}}),
                FitChoice(1, {"loss": {"_component_": "mtune.modules.loss.ChunkedCrossEntropyLoss",
                                       "num_chunks": int(chunks)}})]

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        loss = str((cfg.get("loss") or {}).get("_component_", ""))
        return [] if "Chunked" in loss else [(100, "loss._component_=mtune.modules.loss.ChunkedCrossEntropyLoss")]


CHUNKED_LOSS = ChunkedLoss()
