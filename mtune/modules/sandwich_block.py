"""Gemma's block and embedding: each sublayer between two norms, and token embeddings scaled by ``sqrt(dim)``."""

import torch
from torch import nn

from mtune.modules.packed_attention import Segments
from mtune.modules.rms_norm import GemmaRMSNorm


class SandwichBlock(nn.Module):
    """``h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h)))`` (Gemma 2 and 3:
    four norms a block, ``input_layernorm``, ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
    ``post_feedforward_layernorm``). Called with tensors only, as :class:`~mtune.modules.transformer.TransformerBlock`.
    """

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, mlp: nn.Module,
                 norm: type[nn.Module] = GemmaRMSNorm) -> None:
        super().__init__()
        self.input_layernorm = norm(dim, norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = norm(dim, norm_eps)
        self.pre_feedforward_layernorm = norm(dim, norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = norm(dim, norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                cache_pos: torch.Tensor | None = None, segments: Segments | None = None) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_pos, segments)
        h = x + self.post_attention_layernorm(attended)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class ScaledEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose output is multiplied by ``scale`` rounded to the weight's dtype (Gemma: ``sqrt(dim)``,
    in bf16 for a bf16 model, as the reference does). The weight is the plain table, so checkpoints and tied output
    heads are unchanged."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype)
        return super().forward(tokens) * scale.to(self.weight.device)
