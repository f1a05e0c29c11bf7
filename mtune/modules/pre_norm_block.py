"""Llama's pre-norm block, which most families stack: each sublayer after one norm, added to the residual stream."""

import torch
from torch import nn

from mtune.modules.packed_attention import Segments
from mtune.modules.rms_norm import RMSNorm


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``, of the attention and MLP it is given.

    Called with tensors (``block(x, cos, sin, mask, cache_pos, segments)``; ``segments`` a tensor and an int), so
    activation checkpointing, ``compile`` and FSDP can wrap it unchanged.

    Args:
        norm: the two norms' class (Llama's :class:`RMSNorm`; Qwen3.5's ``(1 + weight)`` form).
        mixer_name: the attribute (and checkpoint name) of the token mixer: ``self_attn``, or ``linear_attn`` for a
            linear-attention layer (Qwen3.5's Gated DeltaNet), which has no KV cache.
    """

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm, mixer_name: str = "self_attn") -> None:
        super().__init__()
        self.input_layernorm = norm(dim, norm_eps)
        self.mixer_name = mixer_name
        setattr(self, mixer_name, attention)
        self.post_attention_layernorm = norm(dim, norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache_pos: torch.Tensor | None = None,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        mixer = getattr(self, self.mixer_name)
        h = x + mixer(self.input_layernorm(x), cos, sin, mask, cache_pos, segments)
        return h + self.mlp(self.post_attention_layernorm(h))
