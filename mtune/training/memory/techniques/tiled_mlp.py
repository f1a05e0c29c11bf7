"""Tiled MLP (``mlp_tiles``): each block's SwiGLU MLP runs over tiles of the micro-batch's tokens and is recomputed
tile by tile in backward, so its ``[tokens, hidden]`` intermediates exist one tile at a time instead of whole from
forward to backward. At long context they are the largest activation of a block (four ``[s, hidden]`` tensors,
``hidden`` ~3.5x the width). The implementation: `mtune.modules.tiled_mlp`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtune.config.schema import Key
from mtune.training.memory.technique import FitChoice, MemoryTechnique, ModelFacts, get

__all__ = ["TiledMLP", "TILED_MLP", "LONG_MICRO_BATCH_TOKENS"]

LONG_MICRO_BATCH_TOKENS = 8192
"""From this many tokens per micro-batch the out-of-memory advice names ``mlp_tiles=auto``."""


def _tiles(setting: Any, tokens: int, dim: int) -> int:
    """`mtune.modules.tiled_mlp.tile_count` without torch (``mtune validate`` and ``--fit`` read this module)."""
    if setting == "auto":
        return max(1, -(-tokens // dim))
    return max(1, min(int(setting), tokens))


class TiledMLP(MemoryTechnique):
    name = "mlp_tiles"
    keys = (
        Key("mlp_tiles", (int, str), 1,
            "run each block's MLP over this many tiles of the micro-batch's tokens, recomputing each tile in backward "
            "(its intermediates exist one tile at a time; one extra MLP forward per token); auto: tiles of at most "
            "the model width (hidden_size) tokens, none for shorter micro-batches; 1: off", at_least=1,
            pattern="auto"),
    )
    fit_knob = "mlp_tiles"
    # supports_compile: True. The tiled MLP runs eagerly inside a compiled block (torch.compiler.disable: a graph
    # break per block); the rest of the block compiles.

    def enabled(self, memory: Any, lora: Any = None) -> bool:
        return memory.mlp_tiles != 1

    def apply(self, model: Any, memory: Any, *, lora: Any, placement: Any) -> None:
        from mtune.modules.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, memory.mlp_tiles)

    def describe(self, memory: Any, lora: Any = None) -> str:
        return "off" if memory.mlp_tiles == 1 else str(memory.mlp_tiles)

    def tiles(self, memory: Any, tokens: int, dim: int) -> int:
        """The tiles a micro-batch of ``tokens`` tokens runs each MLP over (1: untiled), as ``memory`` sets
        ``mlp_tiles`` for a model of width ``dim`` (the FLOPs counter reads recomputation from this)."""
        return _tiles(getattr(memory, "mlp_tiles", 1), tokens, dim)

    def fit_choices(self, cfg: Any, facts: ModelFacts) -> list[FitChoice]:
        """Untiled, then, when the micro-batch has more tokens than the model's width, ``auto``'s tile count
        written out (tiles of at most ``dim`` tokens). Lossless; costs one MLP forward per token."""
        choices = [FitChoice(0, {"mlp_tiles": 1})]
        tiles = _tiles("auto", facts.micro_batch_tokens, facts.dim)
        if tiles > 1 and get(cfg, "activation_checkpointing_policy", "block") != "selective_op":
            choices.append(FitChoice(1, {"mlp_tiles": tiles}))
        return choices

    def for_any_length(self, cfg: Any) -> dict:
        """A tile count is written for one row length (``--fit`` writes ``auto``'s count out); ``auto`` keeps
        tiles of at most the model's width at every length."""
        return {"mlp_tiles": "auto"} if get(cfg, "mlp_tiles", 1) not in (1, "auto") else {}

    def rules(self, cfg: Any) -> list[str]:
        """A count or ``auto``; not with ``selective_op`` checkpointing, whose policy keeps every matmul output,
        the tiles' included (the MLP's intermediates stay whole, and the tiling only costs its recompute)."""
        tiles = get(cfg, "mlp_tiles", 1)
        if tiles == 1:
            return []
        if get(cfg, "enable_activation_checkpointing", False) and \
                get(cfg, "activation_checkpointing_policy", "block") == "selective_op":
            return [f"mlp_tiles={tiles} saves nothing under activation_checkpointing_policy=selective_op (the policy "
                    "keeps every tile's matmul outputs, so the MLP's intermediates stay whole): set mlp_tiles=1, or "
                    "activation_checkpointing_policy=block"]
        return []

    def oom_advice(self, cfg: Mapping[str, Any]) -> list[tuple[int, str]]:
        """For long micro-batches, where the MLP's intermediates are the largest activations of a block."""
        seq_len = (cfg.get("tokenizer") or {}).get("max_seq_len") or 0
        tokens = int(cfg.get("batch_size") or 1) * int(seq_len)
        selective = cfg.get("enable_activation_checkpointing") and \
            cfg.get("activation_checkpointing_policy") == "selective_op"
        if cfg.get("mlp_tiles", 1) == 1 and tokens >= LONG_MICRO_BATCH_TOKENS and not selective:
            return [(15, "mlp_tiles=auto")]
        return []


TILED_MLP = TiledMLP()
