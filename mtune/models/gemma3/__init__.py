"""Gemma 3 text (Google, 2025): Llama's decoder with Gemma's parts: ``(1 + weight)`` RMSNorms, four a block
(:class:`~mtune.modules.sandwich_block.SandwichBlock`), q/k norms, scores scaled by ``query_pre_attn_scalar``, a
GELU-tanh gated MLP, embeddings scaled by ``sqrt(hidden_size)``, tied output head, and two kinds of layer
(``layer_types``): sliding-window layers with their own RoPE base (``rope_local_base_freq``, 10000) and, every sixth,
global layers (base 1e6, stretched linearly ×8 on 4B-27B).
"""

from dataclasses import dataclass, field

from torch import nn

from mtune.modules.attention import QKNormAttention
from mtune.modules.feed_forward import FeedForward, gelu_tanh
from mtune.modules.rms_norm import GemmaRMSNorm
from mtune.modules.rotary import RotaryEmbedding
from mtune.modules.sandwich_block import SandwichBlock, ScaledEmbedding
from mtune.modules.transformer import DecoderArgs

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(n_layers: int, pattern: int = 6) -> list[str]:
    """Gemma 3's interleaving: every ``pattern``-th layer global, the others sliding."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)]


@dataclass
class Gemma3Args(DecoderArgs):
    family = "gemma3"
    tokenizer_families = ("gemma3",)
    vocab_size: int = 262144
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int | None = 256
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 131072
    tie_embeddings: bool = True
    sliding_window: int | None = 1024
    """The window of the sliding layers (the global layers see everything)."""
    rope_local_theta: float = 10000.0
    """The sliding layers' RoPE base (``rope_local_base_freq``); ``rope_theta`` / ``rope_scaling`` are the global
    layers'."""
    query_pre_attn_scalar: float = 256.0
    layer_types: list[str] = field(default_factory=list)
    """``sliding_attention`` / ``full_attention`` per layer; empty: :func:`layer_types` of ``n_layers``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.layer_types:
            self.layer_types = layer_types(self.n_layers)

    def embedding(self) -> nn.Module:
        return ScaledEmbedding(self.vocab_size, self.dim, self.dim**0.5)

    def final_norm(self) -> nn.Module:
        return GemmaRMSNorm(self.dim, self.norm_eps)

    def attention_kinds(self) -> dict[str, tuple[RotaryEmbedding, int | None]]:
        return {SLIDING: (RotaryEmbedding(self.head_dim, self.rope_local_theta), self.sliding_window),
                FULL: (RotaryEmbedding(self.head_dim, self.rope_theta, self.rope_scaling), None)}

    def layer_kind(self, layer: int) -> str:
        return self.layer_types[layer]

    def attention(self, layer: int) -> nn.Module:
        window = self.sliding_window if self.layer_types[layer] == SLIDING else None
        return QKNormAttention(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.norm_eps,
                               sliding_window=window, norm=GemmaRMSNorm,
                               query_pre_attn_scalar=self.query_pre_attn_scalar)

    def block(self, layer: int) -> nn.Module:
        return SandwichBlock(self.dim, self.norm_eps, self.attention(layer),
                             FeedForward(self.dim, self.intermediate_dim, activation=gelu_tanh))


_LINEAR_8 = {"rope_type": "linear", "factor": 8.0}
# google/gemma-3-<size>-pt config.json (text_config for 4B-27B; the rest are Gemma3TextConfig's defaults there).
GEMMA3_SIZES = {
    "1B": dict(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, intermediate_dim=6912, sliding_window=512,
               max_seq_len=32768),
    "4B": dict(vocab_size=262208, dim=2560, n_layers=34, intermediate_dim=10240, rope_scaling=_LINEAR_8),
    "12B": dict(vocab_size=262208, dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, intermediate_dim=15360,
                rope_scaling=_LINEAR_8),
    "27B": dict(vocab_size=262208, dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, head_dim=128,
                intermediate_dim=21504, query_pre_attn_scalar=168.0, rope_scaling=_LINEAR_8),
    # NF4-friendly test shape; 6 layers (5 sliding, 1 global), a window of 8, scores scaled by 1/sqrt(32) (not 64)
    "tiny": dict(vocab_size=512, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_dim=512,
                 max_seq_len=512, sliding_window=8, query_pre_attn_scalar=32.0, rope_scaling=_LINEAR_8),
}
