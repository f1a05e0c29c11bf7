"""Qwen3-MoE (Alibaba, 2025): Qwen3's decoder (q/k norms, ``head_dim`` 128) with a mixture-of-experts MLP
(:class:`~mtune.modules.moe.MoE`: ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts, top-k weights
renormalised) in every block but those ``mlp_only_layers`` names or ``decoder_sparse_step`` skips, which keep a dense
MLP of ``intermediate_size``. The load-balancing loss (``router_aux_loss_coef``) is added only when
``output_router_logits`` is on, as in transformers.
"""

from dataclasses import dataclass, field

from torch import nn

from mtune.models.qwen3 import Qwen3Args
from mtune.modules.feed_forward import FeedForward
from mtune.modules.moe import MoE
from mtune.modules.pre_norm_block import TransformerBlock


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    family = "qwen3_moe"
    intermediate_dim: int = 6144
    """The dense MLP's width, in the layers without experts."""
    n_experts: int = 128
    """Experts per sparse layer (``num_experts``; transformers 5 writes ``num_local_experts``)."""
    top_k: int = 8
    """Experts per token (``num_experts_per_tok``)."""
    moe_intermediate_dim: int = 768
    """Each expert's intermediate width (``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights to sum to 1 (every published Qwen3-MoE; transformers' default: false)."""
    decoder_sparse_step: int = 1
    """Layer ``i`` has experts when ``(i + 1) % decoder_sparse_step == 0`` and it is not in ``mlp_only_layers``."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers with a dense MLP instead of experts."""
    router_aux_loss_coef: float = 0.001
    """The load-balancing loss's weight, when ``output_router_logits``."""
    output_router_logits: bool = False
    """Add ``router_aux_loss_coef`` x the load-balancing loss to the training loss (off on the hub, as in
    transformers)."""

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.n_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def block(self, layer: int) -> nn.Module:
        if not self.is_sparse(layer):
            mlp = FeedForward(self.dim, self.intermediate_dim)
        else:
            mlp = MoE(self.dim, self.moe_intermediate_dim, self.n_experts, self.top_k, self.norm_topk_prob,
                      aux_loss_coef=self.router_aux_loss_coef if self.output_router_logits else 0.0)
        return TransformerBlock(self.dim, self.norm_eps, self.attention(layer), mlp)


# The Hub's config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (transformers 4.51 layout): both 128 experts,
# 8 per token, norm_topk_prob true, every layer sparse (mlp_only_layers [], decoder_sparse_step 1), 4 KV heads of
# 128, rope_theta 1e6, 40960 positions, untied, router_aux_loss_coef 0.001 with output_router_logits false.
QWEN3_MOE_SIZES = {
    "30B_A3B": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, intermediate_dim=6144,
                    moe_intermediate_dim=768),
    "235B_A22B": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, intermediate_dim=12288,
                      moe_intermediate_dim=1536),
    # NF4-friendly test shape: 8 experts of 128 (each projection 128 x 256 = 32768 weights), 2 per token; Qwen3's
    # tiny attention (8 heads of 64 on a 256-wide model).
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64, intermediate_dim=512,
                 n_experts=8, top_k=2, moe_intermediate_dim=128, max_seq_len=512),
}
