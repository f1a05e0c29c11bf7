"""Phi-4 (Microsoft; ``Phi3ForCausalLM`` checkpoints): Llama's block with the q/k/v projections fused into one
``qkv_proj`` and the gate/up projections into one ``gate_up_proj`` (kept fused, as the checkpoints and PEFT adapters
store them).

- **Phi-4-mini** (3.8B, 2025): RoPE on the first 3/4 of each head (``partial_rotary_factor``), LongRoPE frequency
  scaling from a 4096-token original context to 131072, tied embeddings, a 200k vocabulary.
- **Phi-4** (14B, December 2024; Phi-4-reasoning and -reasoning-plus share its shapes): RoPE on the whole head
  (Phi3Config's default factor of 1.0), plain RoPE with base 250,000 over a 16,384-token context, untied embeddings,
  a 100k vocabulary.
"""

import math
from dataclasses import dataclass

from torch import nn

from mtune.modules.attention import FusedQKVAttention
from mtune.modules.feed_forward import FusedFeedForward
from mtune.modules.rotary import RotaryEmbedding
from mtune.modules.pre_norm_block import TransformerBlock
from mtune.modules.transformer import DecoderArgs


@dataclass
class Phi4Args(DecoderArgs):
    family = "phi4"
    tokenizer_families = ("phi4", "phi4_mini")
    vocab_size: int = 200064
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 131072
    tie_embeddings: bool = True
    partial_rotary_factor: float = 0.75
    """The share of each head RoPE rotates (its first ``int(head_dim * factor)`` features)."""

    def rope(self) -> RotaryEmbedding:
        return RotaryEmbedding(int(self.head_dim * self.partial_rotary_factor), self.rope_theta, self.rope_scaling)

    def attention(self, layer: int) -> nn.Module:
        return FusedQKVAttention(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.qkv_bias,
                                 self.sliding_window)

    def block(self, layer: int) -> nn.Module:
        return TransformerBlock(self.dim, self.norm_eps, self.attention(layer),
                                FusedFeedForward(self.dim, self.intermediate_dim))


def longrope(short_factor: list[float], long_factor: list[float], original: int, stretch: float) -> dict:
    """A LongRoPE ``rope_scaling`` with transformers' default attention factor, ``sqrt(1 + ln(s) / ln(original))``
    for the context stretch ``s`` (the checkpoint's ``factor``, else ``max_position_embeddings / original``)."""
    factor = math.sqrt(1 + math.log(stretch) / math.log(original)) if stretch > 1 else 1.0
    return dict(rope_type="longrope", short_factor=list(short_factor), long_factor=list(long_factor),
                original_max_position_embeddings=original, attention_factor=factor)


# The named sizes: microsoft/Phi-4-mini-instruct's and microsoft/phi-4's config.json shapes. Phi-4-mini's 48 short
# and 48 long LongRoPE factors are not written out here: the named size (random weights, planning) uses factors of
# 1.0, which changes no shape, byte or FLOP; a checkpoint's config.json always supplies its own.
PHI4_SIZES = {
    "mini": dict(dim=3072, n_layers=32, n_heads=24, n_kv_heads=8, intermediate_dim=8192,
                 rope_scaling=longrope([1.0] * 48, [1.0] * 48, 4096, 131072 / 4096)),
    # microsoft/phi-4's config.json: 14,659,507,200 parameters (lm_head untied).
    "14B": dict(vocab_size=100352, dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, intermediate_dim=17920,
                rope_theta=250000.0, max_seq_len=16384, tie_embeddings=False, partial_rotary_factor=1.0),
    # NF4-friendly test shape: 4 heads of 64 rotated on their first 48 features, stretched from a 64-token context.
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=512, max_seq_len=512,
                 rope_scaling=longrope([1.0 + 0.1 * i for i in range(24)], [2.0 + 0.5 * i for i in range(24)],
                                       64, 512 / 64)),
}
