"""gpt-oss (OpenAI, August 2025): a pre-norm decoder whose every MLP is a mixture of experts, with

- attention sinks: a learned logit per query head in every softmax (:class:`~mtune.modules.sink_attention.SinkAttention`),
  biases on all four attention projections, 64 query heads of 64 over 8 KV heads;
- sliding-window (128 tokens) and full attention alternating (``layer_types``), one RoPE for both: YaRN, stretched
  x32 from a 4096-token context (``rope_theta`` 150000);
- experts with a clamped SwiGLU over interleaved gate/up features and biased projections
  (:class:`~mtune.modules.clamped_experts.ClampedSwiGLUExperts`), routed by a biased router (``mlp.router``) to the
  top ``num_experts_per_tok`` logits, weighted by a softmax over those logits alone;
- untied embeddings, Llama's RMSNorm (eps 1e-5), the weight applied in fp32.

The hub's checkpoints hold each expert projection whole (``experts.gate_up_proj [n_experts, dim, 2 * hidden]``,
``experts.gate_up_proj_bias``, ``experts.down_proj``, ``experts.down_proj_bias``; as ``save_pretrained`` writes them
too): ``expert_checkpoint_layout`` (whole and transposed, :mod:`mtune.modules.expert_layout`). The published ones
store those as MXFP4 blocks and scales, which the loaders dequantize as they arrive, the FSDP2 one each rank's
experts' rows alone (:mod:`mtune.models.gpt_oss.mxfp4`).
"""

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from mtune.models.layer_types import checked_layer_types
from mtune.modules.clamped_experts import ClampedSwiGLUExperts
from mtune.modules.expert_layout import ExpertLayout
from mtune.modules.moe import MoE
from mtune.modules.pre_norm_block import TransformerBlock
from mtune.modules.rms_norm import FP32RMSNorm
from mtune.modules.sink_attention import SinkAttention
from mtune.modules.transformer import DecoderArgs, LayerKind

SLIDING, FULL = "sliding_attention", "full_attention"


def alternating_layer_types(n_layers: int) -> list[str]:
    """Sliding, full, sliding, ... (transformers' default and every published gpt-oss)."""
    return [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)]


def _yarn(factor: float = 32.0, original: int = 4096) -> dict:
    return dict(rope_type="yarn", factor=factor, beta_fast=32.0, beta_slow=1.0,
                original_max_position_embeddings=original, truncate=False)


@dataclass
class GptOssArgs(DecoderArgs):
    family = "gpt_oss"
    tokenizer_families = ("gpt_oss",)
    expert_checkpoint_layout: ClassVar[ExpertLayout] = ExpertLayout.WHOLE_TRANSPOSED
    vocab_size: int = 201088
    dim: int = 2880
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int | None = 64
    intermediate_dim: int = 2880
    """Each expert's intermediate width (``intermediate_size``)."""
    norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict | None = field(default_factory=_yarn)
    """YaRN (``rope_type: yarn``, ``factor``, ``beta_fast``, ``beta_slow``, ``original_max_position_embeddings``,
    ``truncate``), or None for plain RoPE."""
    max_seq_len: int = 131072
    sliding_window: int | None = 128
    """The sliding layers' window (tokens seen, itself included)."""
    layer_types: list[str] = field(default_factory=list)
    """``sliding_attention`` / ``full_attention`` per layer; empty: :func:`alternating_layer_types`."""
    n_experts: int = 32
    """Experts per layer (``num_local_experts``)."""
    top_k: int = 4
    """Experts per token (``num_experts_per_tok``)."""
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_aux_loss_coef: float = 0.9
    """The load-balancing loss's weight, when ``output_router_logits``."""
    output_router_logits: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.layer_types = checked_layer_types(self.layer_types, self.n_layers, (SLIDING, FULL),
                                               alternating_layer_types)

    def final_norm(self) -> nn.Module:
        return FP32RMSNorm(self.dim, self.norm_eps)

    def attention_kinds(self) -> dict[str, LayerKind]:
        rope = self.rope()
        return {SLIDING: LayerKind(rope, self.sliding_window, sinks=True), FULL: LayerKind(rope, None, sinks=True)}

    def layer_kind(self, layer: int) -> str:
        return self.layer_types[layer]

    def attention(self, layer: int) -> nn.Module:
        window = self.sliding_window if self.layer_types[layer] == SLIDING else None
        return SinkAttention(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, window)

    def block(self, layer: int) -> nn.Module:
        experts = ClampedSwiGLUExperts(self.n_experts, self.dim, self.intermediate_dim, self.swiglu_alpha,
                                       self.swiglu_limit)
        mlp = MoE(self.dim, self.intermediate_dim, self.n_experts, self.top_k, norm_topk_prob=True,
                  aux_loss_coef=self.router_aux_loss_coef if self.output_router_logits else 0.0, experts=experts,
                  router_name="router", router_bias=True)
        return TransformerBlock(self.dim, self.norm_eps, self.attention(layer), mlp, norm=FP32RMSNorm)


# openai/gpt-oss-20b and openai/gpt-oss-120b's config.json (transformers 4.55 layout): both 2880 wide with experts of
# 2880, 64 query heads of 64 over 8 KV heads, 4 experts per token, a 128-token window on every other layer, YaRN x32
# from 4096 tokens (theta 150000), 201088 tokens, untied, router_aux_loss_coef 0.9; 20B: 24 layers of 32 experts,
# 120B: 36 layers of 128 (transformers' GptOssConfig defaults). Read from copies of those files in public
# repositories (this machine has no hub access).
GPT_OSS_SIZES = {
    "20B": dict(n_layers=24, n_experts=32),
    "120B": dict(n_layers=36, n_experts=128),
    # NF4-friendly test shape: 8 experts of 128 (gate_up 256 x 256, down 256 x 128), 2 per token; 4 heads of 64
    # over 2 KV heads; a window of 8 on layer 0; YaRN x8 from 64 tokens.
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, intermediate_dim=128,
                 n_experts=8, top_k=2, max_seq_len=512, sliding_window=8, rope_scaling=_yarn(8.0, 64)),
}
