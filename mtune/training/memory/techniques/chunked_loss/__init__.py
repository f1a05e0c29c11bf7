"""The chunked cross-entropy (``loss._component_: mtune.modules.loss.ChunkedCrossEntropyLoss``): the output
projection and the loss run over chunks of the sequence, so the fp32 logits ``[b, s, vocab]`` never exist whole.
No key of its own: the loss node names it. The implementation: `mtune.modules.loss`."""

from __future__ import annotations

from typing import Any

from mtune.training.memory.technique import FitChoice, FitKnob, MemoryTechnique, ModelFacts, advice

__all__ = ["ChunkedLoss", "CHUNKED_LOSS", "CHUNKED_LOSS_COMPONENT"]

CHUNKED_LOSS_COMPONENT = "mtune.modules.loss.ChunkedCrossEntropyLoss"
PREFERENCE_LOSS_MODULE = "mtune.modules.preference_loss."


class ChunkedLoss(MemoryTechnique):
    name = "chunked_loss"
    fit_knob = FitKnob("loss")

    def enabled(self, s: Any, memory: Any) -> bool:
        return memory.run.loss_component == CHUNKED_LOSS_COMPONENT

    def fit_choices(self, s: Any, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """The plain loss, or the chunked one (keeping the user's ``num_chunks`` where they set it): each choice
        replaces the loss node whole, so no key of one loss reaches the other (``CrossEntropyLoss`` takes no
        ``num_chunks``). A preference loss (DPO) keeps its node: the token losses are no choice there."""
        if memory.run.loss_component.startswith(PREFERENCE_LOSS_MODULE):
            return [FitChoice(0, {})]
        chunks = dict(memory.run.loss).get("num_chunks") if self.enabled(s, memory) else None
        chunked = {"_component_": CHUNKED_LOSS_COMPONENT, **({"num_chunks": int(chunks)} if chunks else {})}
        return [FitChoice(0, {"loss": {"_component_": "mtune.modules.loss.CrossEntropyLoss"}}),
                FitChoice(1, {"loss": chunked})]

    def oom_advice(self, s: Any, memory: Any) -> list[tuple[int, str]]:
        if "Chunked" in memory.run.loss_component or memory.run.loss_component.startswith(PREFERENCE_LOSS_MODULE):
            return []
        return [advice("chunked_loss", f"loss._component_={CHUNKED_LOSS_COMPONENT}")]


CHUNKED_LOSS = ChunkedLoss()
