"""Gemma 4 text (Google, April 2026): Gemma 3's decoder (four norms a block, GELU-tanh MLP, embeddings
scaled by ``sqrt(dim)``, tied head, sliding and global ``layer_types``) with these differences:

- plain-weight fp32 RMSNorms; queries, keys and values all normed, so scores are unscaled;
- global layers with their own head size (``global_head_dim``) and, where ``attention_k_eq_v``, their own KV heads
  (``num_global_key_value_heads``) and keys doubling as values; their RoPE rotates a quarter of each head's
  frequencies (``proportional``);
- per-layer input embeddings (E2B, E4B: ``hidden_size_per_layer_input``), a third residual branch per block;
- the last ``num_kv_shared_layers`` layers reuse the keys and values of the last earlier layer of their kind, and
  with ``use_double_wide_mlp`` have MLPs twice as wide;
- a scalar per layer, and final-logit soft-capping;
- in the mixture-of-experts size (26B-A4B, ``enable_moe_block``), every block runs ``n_experts`` GELU-tanh experts
  (``top_k`` per token) beside its dense MLP, each branch with its own norms, routed by a
  :class:`~mtune.modules.per_layer_block.ScaledRouter` (:class:`~mtune.modules.per_layer_block.PerLayerInputMoEBlock`); the
  checkpoints hold the experts as transformers 5 does, ``experts.gate_up_proj`` (gate and up side by side) and
  ``experts.down_proj`` (``expert_checkpoint_layout``).
"""

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from mtune.models.layer_types import checked_layer_types
from mtune.modules.expert_layout import ExpertLayout
from mtune.modules.feed_forward import FeedForward, gelu_tanh
from mtune.modules.moe import Experts
from mtune.modules.per_layer_block import PerLayerInputBlock, PerLayerInputMoEBlock, ScaledRouter
from mtune.modules.per_layer_decoder import PerLayerInputDecoder
from mtune.modules.rms_norm import FP32RMSNorm
from mtune.modules.rotary import RotaryEmbedding
from mtune.modules.sandwich_block import ScaledEmbedding
from mtune.modules.shared_kv_attention import NormedKVAttention, SharedKVAttention
from mtune.modules.transformer import DecoderArgs, LayerKind

SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(n_layers: int, pattern: int = 6) -> list[str]:
    """Every ``pattern``-th layer global, the others sliding (31B and E4B: 6; E2B: 5)."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n_layers)]


@dataclass
class Gemma4Args(DecoderArgs):
    family = "gemma4"
    tokenizer_families = ("gemma4",)
    decoder = PerLayerInputDecoder
    expert_checkpoint_layout: ClassVar[ExpertLayout] = ExpertLayout.GATE_UP_SIDE_BY_SIDE
    vocab_size: int = 262144
    n_heads: int = 8
    n_kv_heads: int = 1
    head_dim: int | None = 256
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    """The global layers' RoPE base; ``rope_local_theta`` is the sliding layers'."""
    rope_local_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    """The share of a global head's frequencies RoPE uses (the rest of its features pass unrotated)."""
    max_seq_len: int = 131072
    tie_embeddings: bool = True
    sliding_window: int | None = 512
    layer_types: list[str] = field(default_factory=list)
    """``sliding_attention`` / ``full_attention`` per layer; empty: :func:`layer_types` of ``n_layers``."""
    global_head_dim: int = 512
    global_n_kv_heads: int | None = None
    """KV heads of the global layers (``num_global_key_value_heads``, read where ``attention_k_eq_v``); None:
    ``n_kv_heads``."""
    keys_are_values: bool = False
    """``attention_k_eq_v``: the global layers have no ``v_proj``; their values are ``k_proj``'s output."""
    per_layer_dim: int = 0
    """Width of each layer's input embedding (``hidden_size_per_layer_input``); 0: none."""
    per_layer_vocab_size: int = 262144
    n_kv_shared_layers: int = 0
    """The last this many layers reuse earlier layers' keys and values (``num_kv_shared_layers``)."""
    double_wide_mlp: bool = False
    """``use_double_wide_mlp``: the KV-shared layers' MLPs are ``2 * intermediate_dim`` wide."""
    final_logit_softcap: float | None = 30.0
    n_experts: int = 0
    """Experts beside every block's dense MLP (``num_experts`` where ``enable_moe_block``); 0: a dense model."""
    top_k: int = 8
    """Experts per token (``top_k_experts``), their routing weights renormalised to sum to 1."""
    moe_intermediate_dim: int = 704
    """Each expert's intermediate width (``moe_intermediate_size``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = checked_layer_types(self.layer_types, self.n_layers, (SLIDING, FULL), layer_types)
        first_shared = self.n_layers - self.n_kv_shared_layers
        if self.n_kv_shared_layers and set(self.layer_types[first_shared:]) - set(self.layer_types[:first_shared]):
            raise ValueError(f"num_kv_shared_layers={self.n_kv_shared_layers}: a shared layer's kind has no earlier "
                             "layer to take keys and values from")

    def embedding(self) -> nn.Module:
        return ScaledEmbedding(self.vocab_size, self.dim, self.dim**0.5)

    def final_norm(self) -> nn.Module:
        return FP32RMSNorm(self.dim, self.norm_eps)

    def attention_kinds(self) -> dict[str, LayerKind]:
        proportional = {"rope_type": "proportional", "partial_rotary_factor": self.partial_rotary_factor}
        return {SLIDING: LayerKind(RotaryEmbedding(self.head_dim, self.rope_local_theta), self.sliding_window),
                FULL: LayerKind(RotaryEmbedding(self.global_head_dim, self.rope_theta, proportional))}

    def layer_kind(self, layer: int) -> str:
        return self.layer_types[layer]

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values ``layer`` reuses: for the last ``n_kv_shared_layers``, the last earlier
        layer of its kind; None for the others."""
        first_shared = self.n_layers - self.n_kv_shared_layers
        if layer < first_shared:
            return None
        return max(i for i in range(first_shared) if self.layer_types[i] == self.layer_types[layer])

    def block(self, layer: int) -> nn.Module:
        sliding = self.layer_types[layer] == SLIDING
        head_dim = self.head_dim if sliding else self.global_head_dim
        n_kv = self.n_kv_heads if sliding or self.global_n_kv_heads is None else self.global_n_kv_heads
        shared = self.kv_source(layer) is not None
        window = self.sliding_window if sliding else None
        if shared:
            attention = SharedKVAttention(self.dim, self.n_heads, n_kv, head_dim, self.norm_eps, window)
        else:
            attention = NormedKVAttention(self.dim, self.n_heads, n_kv, head_dim, self.norm_eps, window,
                                          keys_are_values=self.keys_are_values and not sliding)
        width = self.intermediate_dim * (2 if self.double_wide_mlp and shared else 1)
        mlp = FeedForward(self.dim, width, gelu_tanh)
        if self.n_experts:
            router = ScaledRouter(self.dim, self.n_experts, self.top_k, self.norm_eps)
            experts = Experts(self.n_experts, self.dim, self.moe_intermediate_dim, gelu_tanh)
            return PerLayerInputMoEBlock(self.dim, self.norm_eps, attention, mlp, router, experts, self.per_layer_dim)
        return PerLayerInputBlock(self.dim, self.norm_eps, attention, mlp, self.per_layer_dim)


def _pattern(n_layers: int, every: int) -> list[str]:
    return layer_types(n_layers, every)


# The text_config of each google/gemma-4-<size> config.json (E2B: 35 layers, global every 5th, 1 KV head, 20 layers
# sharing KV with double-wide MLPs; E4B: 42 layers, global every 6th, 2 KV heads, 18 sharing; both per-layer inputs
# of 256 and a 512-token window; 31B: 60 layers, 16 KV heads, global layers 4 KV heads with keys as values, a
# 1024-token window, 262144 positions), as published on the hub in April 2026 (read here from copies of those files
# in public repositories; this machine has no hub access).
GEMMA4_SIZES = {
    "E2B": dict(dim=1536, n_layers=35, n_kv_heads=1, intermediate_dim=6144, layer_types=_pattern(35, 5),
                per_layer_dim=256, n_kv_shared_layers=20, double_wide_mlp=True),
    "E4B": dict(dim=2560, n_layers=42, n_kv_heads=2, intermediate_dim=10240, per_layer_dim=256,
                n_kv_shared_layers=18),
    "31B": dict(dim=5376, n_layers=60, n_heads=32, n_kv_heads=16, intermediate_dim=21504, sliding_window=1024,
                global_n_kv_heads=4, keys_are_values=True, max_seq_len=262144),
    # 26B-A4B, the mixture of experts: 30 layers (global every 6th), hidden 2816, 16 heads of 256 over 8 KV heads,
    # global heads of 512 over 2 KV heads with keys as values, a dense MLP of 2112 beside 128 experts of 704 (8 per
    # token) in every layer, no per-layer inputs or KV sharing, a 1024-token window, 262144 positions, tied; from
    # the text_config of google/gemma-4-26B-A4B's config.json (hub, April 2026; read from public repositories that
    # quote it, as above).
    "26B_A4B": dict(dim=2816, n_layers=30, n_heads=16, n_kv_heads=8, intermediate_dim=2112, sliding_window=1024,
                    global_n_kv_heads=2, keys_are_values=True, max_seq_len=262144, n_experts=128, top_k=8,
                    moe_intermediate_dim=704),
    # Every Gemma 4 difference in one NF4-friendly shape: 6 layers (sliding, global) x 3, the last two reusing the
    # keys and values of layers 2 and 3 with double-wide MLPs; global heads of 128 over 1 KV head with keys as
    # values; per-layer inputs of 128; a window of 8.
    "tiny": dict(vocab_size=512, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_dim=512,
                 max_seq_len=512, sliding_window=8, layer_types=[SLIDING, FULL] * 3, global_head_dim=128,
                 global_n_kv_heads=1, keys_are_values=True, per_layer_dim=128, per_layer_vocab_size=512,
                 n_kv_shared_layers=2, double_wide_mlp=True),
    # 26B-A4B's block in an NF4-friendly shape: 4 layers (sliding, global) x 2, global heads of 128 over 1 KV head with
    # keys as values; a dense MLP of 512 beside 8 experts of 128 (each projection 128 x 256), 2 per token.
    "tiny_moe": dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_dim=512,
                     max_seq_len=512, sliding_window=8, layer_types=[SLIDING, FULL] * 2, global_head_dim=128,
                     global_n_kv_heads=1, keys_are_values=True, n_experts=8, top_k=2, moe_intermediate_dim=128),
}
