"""Qwen3.5 dense (Alibaba, February-March 2026), the text model: Qwen3's decoder with three of every four token
mixers replaced by Gated DeltaNet linear attention (``layer_types``: ``linear_attention`` / ``full_attention``;
the hub's pattern puts full attention on every fourth layer). The full-attention layers gate each head's output
(``q_proj`` twice as wide: query and gate per head), rotate a quarter of each head (``partial_rotary_factor`` 0.25)
and norm q and k per head. Every RMSNorm but the DeltaNet's output norm is the ``(1 + weight)`` form.

Qwen3.5-MoE (35B-A3B, ...) is the same decoder with a mixture of experts as every layer's MLP (``n_experts > 0``):
:class:`~mtune.modules.moe.MoE` with ``top_k`` of ``n_experts`` SwiGLU experts, the top-k weights always
renormalised, plus a shared expert every token goes through, scaled by ``sigmoid(shared_expert_gate(x))``
(transformers' ``Qwen3_5MoeSparseMoeBlock``).
"""

from dataclasses import dataclass, field

from torch import nn

from mtune.models.layer_types import checked_layer_types
from mtune.modules.attention import GatedAttention
from mtune.modules.feed_forward import FeedForward
from mtune.modules.gated_deltanet import GatedDeltaNet
from mtune.modules.moe import MoE
from mtune.modules.rms_norm import GemmaRMSNorm
from mtune.modules.rotary import RotaryEmbedding
from mtune.modules.pre_norm_block import TransformerBlock
from mtune.modules.transformer import DecoderArgs, LayerKind

LAYER_TYPES = ("linear_attention", "full_attention")


def hybrid_layer_types(n_layers: int, full_attention_interval: int = 4) -> list[str]:
    """Full attention on every ``full_attention_interval``-th layer (the 4th, 8th, ...), linear attention between."""
    return ["full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
            for i in range(n_layers)]


@dataclass
class Qwen3_5Args(DecoderArgs):
    family = "qwen3_5"
    tokenizer_families = ("qwen3_5",)
    vocab_size: int = 248320
    head_dim: int | None = 256
    norm_eps: float = 1e-6
    rope_theta: float = 10000000.0
    max_seq_len: int = 262144
    partial_rotary_factor: float = 0.25
    """The share of each full-attention head RoPE rotates."""
    layer_types: list[str] = field(default_factory=list)
    """Per layer: ``linear_attention`` or ``full_attention``; empty means :func:`hybrid_layer_types`."""
    linear_n_k_heads: int = 16
    """Query/key heads of the DeltaNet layers (``linear_num_key_heads``)."""
    linear_n_v_heads: int = 32
    """Value heads of the DeltaNet layers, each with its own state (``linear_num_value_heads``)."""
    linear_k_head_dim: int = 128
    linear_v_head_dim: int = 128
    linear_conv_kernel: int = 4
    """Taps of the DeltaNet's causal convolution (``linear_conv_kernel_dim``)."""
    n_experts: int = 0
    """Routed experts in every layer's MLP (``num_experts``); 0: a dense MLP of ``intermediate_dim`` (Qwen3.5)."""
    top_k: int = 8
    """Experts per token (``num_experts_per_tok``), their weights renormalised to sum to 1."""
    moe_intermediate_dim: int = 512
    """Each routed expert's intermediate width (``moe_intermediate_size``)."""
    shared_expert_intermediate_dim: int = 512
    """The shared expert's intermediate width (``shared_expert_intermediate_size``)."""
    router_aux_loss_coef: float = 0.001
    """The load-balancing loss's weight, when ``output_router_logits``."""
    output_router_logits: bool = False
    """Add ``router_aux_loss_coef`` x the load-balancing loss to the training loss (off on the hub)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = checked_layer_types(self.layer_types, self.n_layers, LAYER_TYPES, hybrid_layer_types)

    def rope(self) -> RotaryEmbedding:
        return RotaryEmbedding(int(self.head_dim * self.partial_rotary_factor), self.rope_theta, self.rope_scaling)

    def attention_kinds(self) -> dict[str, LayerKind]:
        return {"full_attention": LayerKind(self.rope()), "linear_attention": LayerKind(None, recurrent=True)}

    def layer_kind(self, layer: int) -> str:
        return self.layer_types[layer]

    def final_norm(self) -> nn.Module:
        return GemmaRMSNorm(self.dim, self.norm_eps)

    def mlp(self) -> nn.Module:
        if not self.n_experts:
            return FeedForward(self.dim, self.intermediate_dim)
        moe = MoE(self.dim, self.moe_intermediate_dim, self.n_experts, self.top_k, norm_topk_prob=True,
                  shared_expert=FeedForward(self.dim, self.shared_expert_intermediate_dim),
                  shared_expert_gate=nn.Linear(self.dim, 1, bias=False),
                  aux_loss_coef=self.router_aux_loss_coef if self.output_router_logits else 0.0)
        # the shared expert's one-row gate is routing, not a weight to quantize (nor NF4-sized): QLoRA keeps it as is
        moe.kept_in_model_dtype = ("shared_expert_gate",)
        return moe

    def block(self, layer: int) -> nn.Module:
        mlp = self.mlp()
        if self.layer_types[layer] == "linear_attention":
            mixer = GatedDeltaNet(self.dim, self.linear_n_k_heads, self.linear_n_v_heads, self.linear_k_head_dim,
                                  self.linear_v_head_dim, self.linear_conv_kernel, self.norm_eps)
            return TransformerBlock(self.dim, self.norm_eps, mixer, mlp, norm=GemmaRMSNorm, mixer_name="linear_attn")
        attention = GatedAttention(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.norm_eps,
                                   norm=GemmaRMSNorm)
        return TransformerBlock(self.dim, self.norm_eps, attention, mlp, norm=GemmaRMSNorm)


# Source: each Qwen/Qwen3.5-<size> checkpoint's config.json text_config (every size: 248320-token vocabulary,
# attention heads of 256 with 64 rotated dimensions, DeltaNet q/k heads 16 x 128 and value heads of 128, full
# attention every 4th layer, 262144 positions), written from the published numbers as public code that reads those
# files quotes them (no network here), and the model cards' layer layouts and hidden sizes. Each count equals what
# transformers' Qwen3_5ForCausalLM builds from the same text config (tests/mtune/models/test_sizes.py).
QWEN3_5_SIZES = {
    # 0.8B: 24 layers (6 x (3 DeltaNet + 1 attention)), hidden 1024, attention 8 / 2 KV heads, DeltaNet 16 value
    # heads, intermediate 3584, tie_word_embeddings true.
    "0.8B": dict(dim=1024, n_layers=24, n_heads=8, n_kv_heads=2, intermediate_dim=3584, linear_n_v_heads=16,
                 tie_embeddings=True),
    # 2B: 24 layers, hidden 2048, attention 8 / 2 KV heads, DeltaNet 16 value heads (its GGUF conversion says the
    # same: ssm.time_step_rank 16, inner size 2048), intermediate 6144, tied.
    "2B": dict(dim=2048, n_layers=24, n_heads=8, n_kv_heads=2, intermediate_dim=6144, linear_n_v_heads=16,
               tie_embeddings=True),
    # 4B: 32 layers (8 x (3 + 1)), hidden 2560, attention 16 / 4 KV heads, DeltaNet 32 value heads, intermediate
    # 9216, tied.
    "4B": dict(dim=2560, n_layers=32, n_heads=16, n_kv_heads=4, intermediate_dim=9216, tie_embeddings=True),
    # 9B (the model card): 32 layers, hidden 4096, attention 16 / 4 KV heads, DeltaNet 32 value heads, intermediate
    # 12288; the card lists the output layer apart from the token embedding, so not tied.
    "9B": dict(dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, intermediate_dim=12288),
    # 27B: 64 layers (16 x (3 + 1)), hidden 5120, attention 24 / 4 KV heads, DeltaNet 48 value heads, intermediate
    # 17408, not tied.
    "27B": dict(dim=5120, n_layers=64, n_heads=24, n_kv_heads=4, intermediate_dim=17408, linear_n_v_heads=48),
    # 35B-A3B (Qwen3.5-MoE): 40 layers (10 x (3 + 1)), hidden 2048, attention 16 / 2 KV heads, DeltaNet 32 value
    # heads, 256 experts of 512 with 8 per token and a shared expert of 512 in every layer, not tied (its
    # config.json: Qwen3_5MoeForConditionalGeneration, text_config model_type qwen3_5_moe_text).
    "35B_A3B": dict(dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, intermediate_dim=512, n_experts=256, top_k=8,
                    moe_intermediate_dim=512, shared_expert_intermediate_dim=512),
    # 122B-A10B (Qwen3.5-MoE): 48 layers (12 x (3 + 1)), hidden 3072, attention 32 / 2 KV heads, DeltaNet 64 value
    # heads, 256 experts of 1024 with 8 per token and a shared expert of 1024 in every layer, not tied (the
    # text_config of Qwen/Qwen3.5-122B-A10B's config.json, quoted by public code that reads it: no network here).
    "122B_A10B": dict(dim=3072, n_layers=48, n_heads=32, n_kv_heads=2, intermediate_dim=1024, linear_n_v_heads=64,
                      n_experts=256, top_k=8, moe_intermediate_dim=1024, shared_expert_intermediate_dim=1024),
    # NF4-friendly test shape: one block of each kind twice (linear, full, linear, full); 4 DeltaNet value heads of
    # 64 over 2 q/k heads, attention 4 heads of 64 over 2 KV heads, a quarter of each rotated.
    "tiny": dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_dim=512,
                 max_seq_len=512, tie_embeddings=True, layer_types=hybrid_layer_types(4, 2), linear_n_k_heads=2,
                 linear_n_v_heads=4, linear_k_head_dim=64, linear_v_head_dim=64),
}
