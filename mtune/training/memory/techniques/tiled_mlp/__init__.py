"""Tiled MLP (``mlp_tiles``): each block's SwiGLU MLP runs over tiles of the micro-batch's tokens and is recomputed
tile by tile in backward, so its ``[tokens, hidden]`` intermediates exist one tile at a time instead of whole from
forward to backward. At long context they are the largest activation of a block (four ``[s, hidden]`` tensors,
``hidden`` ~3.5x the width). The implementation: `mtune.modules.tiled_mlp`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtune.training.memory.technique import (FitChoice, FitKnob, Footprint, MemoryTechnique, ModelFacts, Recompute,
                                             Settings, advice, setting)
from mtune.training.memory.techniques.activation_checkpointing import ACTIVATION_CHECKPOINTING

__all__ = ["TiledMLP", "TILED_MLP", "TiledMLPSettings", "LONG_MICRO_BATCH_TOKENS"]

LONG_MICRO_BATCH_TOKENS = 8192
"""From this many tokens per micro-batch the out-of-memory advice names ``mlp_tiles=auto``."""


@dataclass(frozen=True)
class TiledMLPSettings(Settings):
    mlp_tiles: int | str = setting(
        1, "run each block's MLP over this many tiles of the micro-batch's tokens, recomputing each tile in backward "
        "(its intermediates exist one tile at a time; one extra MLP forward per token); auto: tiles of at most the "
        "model width (hidden_size) tokens, none for shorter micro-batches; 1: off", at_least=1, pattern="auto")

    def tiles(self, tokens: int, dim: int) -> int:
        """The tiles a micro-batch of ``tokens`` tokens runs each MLP over (1: untiled) in a model of width ``dim``
        (`mtune.modules.tiled_mlp.tile_count`, without torch)."""
        if self.mlp_tiles == "auto":
            return max(1, -(-tokens // dim))
        return max(1, min(int(self.mlp_tiles), tokens))


def _selective(memory: Any) -> bool:
    checkpointing = memory[ACTIVATION_CHECKPOINTING]
    return checkpointing.enable_activation_checkpointing and \
        checkpointing.activation_checkpointing_policy == "selective_op"


class TiledMLP(MemoryTechnique):
    name = "mlp_tiles"
    Settings = TiledMLPSettings
    fit_knob = FitKnob("mlp_tiles")
    # Runs under compile: the tiled MLP runs eagerly inside a compiled block (torch.compiler.disable: a graph break
    # per block); the rest of the block compiles.

    def enabled(self, s: TiledMLPSettings, memory: Any) -> bool:
        return s.mlp_tiles != 1

    def footprint(self, s: TiledMLPSettings, memory: Any, facts: ModelFacts) -> Footprint:
        """Backward recomputes each tiled MLP (its memory is in the activations the planner measures)."""
        return Footprint(recompute=Recompute(mlp_tiled=(s.tiles(facts.micro_batch_tokens, facts.dim) > 1,)
                                             * facts.n_layers))

    def rules(self, s: TiledMLPSettings, memory: Any) -> list[str]:
        """A count or ``auto``; not with ``selective_op`` checkpointing, whose policy keeps every matmul output,
        the tiles' included (the MLP's intermediates stay whole, and the tiling only costs its recompute)."""
        if s.mlp_tiles != 1 and _selective(memory):
            return [f"mlp_tiles={s.mlp_tiles} saves nothing under activation_checkpointing_policy=selective_op (the "
                    "policy keeps every tile's matmul outputs, so the MLP's intermediates stay whole): set "
                    "mlp_tiles=1, or activation_checkpointing_policy=block"]
        return []

    def fit_choices(self, s: TiledMLPSettings, memory: Any, facts: ModelFacts) -> list[FitChoice]:
        """Untiled, then, when the micro-batch has more tokens than the model's width, ``auto``'s tile count
        written out (tiles of at most ``dim`` tokens). Lossless; costs one MLP forward per token."""
        choices = [FitChoice(0, {"mlp_tiles": 1})]
        tiles = TiledMLPSettings(mlp_tiles="auto").tiles(facts.micro_batch_tokens, facts.dim)
        if tiles > 1 and memory[ACTIVATION_CHECKPOINTING].activation_checkpointing_policy != "selective_op":
            choices.append(FitChoice(1, {"mlp_tiles": tiles}))
        return choices

    def length_overrides(self, s: TiledMLPSettings, memory: Any, facts: ModelFacts, any_length: bool) -> dict:
        """A tile count is written for one row length (``--fit`` writes ``auto``'s count out, as `fit_choices`);
        ``auto`` keeps tiles of at most the model's width at every length."""
        if any_length:
            return {"mlp_tiles": "auto"} if s.mlp_tiles not in (1, "auto") else {}
        tiles = s.tiles(facts.micro_batch_tokens, facts.dim) if s.mlp_tiles == "auto" else 1
        return {"mlp_tiles": tiles} if tiles > 1 else {}

    def oom_advice(self, s: TiledMLPSettings, memory: Any) -> list[tuple[int, str]]:
        """For long micro-batches, where the MLP's intermediates are the largest activations of a block."""
        if s.mlp_tiles == 1 and memory.run.micro_batch_tokens >= LONG_MICRO_BATCH_TOKENS and not _selective(memory):
            return [advice("mlp_tiles", "mlp_tiles=auto")]
        return []

    def on_model(self, model: Any, s: TiledMLPSettings, memory: Any, placement: Any) -> None:
        from mtune.modules.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, s.mlp_tiles)


TILED_MLP = TiledMLP()
