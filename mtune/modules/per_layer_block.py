"""Gemma 4's block: Gemma's four-norm sandwich, a third residual branch fed by the layer's own input, a scalar."""

import torch
from torch import nn

from mtune.modules.feed_forward import gelu_tanh
from mtune.modules.rms_norm import FP32RMSNorm


class PerLayerInputBlock(nn.Module):
    """``h = x + post_attn_norm(attn(input_norm(x)))``, ``h = h + post_ff_norm(mlp(pre_ff_norm(h)))``, then with
    a per-layer input ``p`` (``[b, s, per_layer_dim]``) ``h = h + post_per_layer_input_norm(per_layer_projection(
    gelu_tanh(per_layer_input_gate(h)) * p))``, and the output ``h * layer_scalar``.

    Called ``block(x, cos, sin, mask, cache_pos, cu_seqlens, per_layer_input, k, v) -> (h, k, v)``, tensors only (so
    checkpointing, ``compile`` and FSDP wrap it unchanged): ``k, v`` are the keys and values a shared-KV attention
    reuses (None for a layer that makes its own), and the ones it attended to come back out.

    Args:
        attention: a :class:`~mtune.modules.shared_kv_attention.NormedKVAttention` or ``SharedKVAttention``.
        per_layer_dim: width of the per-layer input (``hidden_size_per_layer_input``); 0: no third branch.
    ``layer_scalar`` (``[1]``, ones) is a frozen parameter (transformers keeps it as a buffer; same checkpoint key).
    """

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, mlp: nn.Module, per_layer_dim: int = 0) -> None:
        super().__init__()
        self.input_layernorm = FP32RMSNorm(dim, norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = FP32RMSNorm(dim, norm_eps)
        self.pre_feedforward_layernorm = FP32RMSNorm(dim, norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = FP32RMSNorm(dim, norm_eps)
        if per_layer_dim:
            self.per_layer_input_gate = nn.Linear(dim, per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(per_layer_dim, dim, bias=False)
            self.post_per_layer_input_norm = FP32RMSNorm(dim, norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def initializers(self, std: float = 0.02):
        """What ``TransformerDecoder.init_weights`` fills beyond linears and norms: the scalar, with ones."""
        yield "layer_scalar", nn.init.ones_

    def forward(self, x, cos, sin, mask=None, cache_pos=None, cu_seqlens=None, per_layer_input=None, k=None, v=None):
        attended, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_pos, cu_seqlens, k, v)
        h = x + self.post_attention_layernorm(attended)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if per_layer_input is not None:
            gated = gelu_tanh(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar, k, v
