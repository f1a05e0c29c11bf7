"""Attention with sinks (gpt-oss): grouped-query attention whose softmax over the keys has one more logit per head,
a learned ``sinks[h]`` with no value behind it, so a head may put weight "nowhere" instead of on its keys:

    p_ij = exp(s_ij) / (exp(sinks_h) + sum_j' exp(s_ij'))

All four projections carry biases (``attention_bias``). The sink goes through every attention kernel as an extra
key (:func:`~mtune.modules.packed_attention.sink_inputs`): SDPA under the causal or dense mask, the per-segment
kernel of packed rows and sliding windows, and the KV cache's masks.
"""

import functools

import torch
from torch import nn

from mtune.modules.attention import Attention, causal_attention
from mtune.modules.rotary import apply_rotary


class SinkAttention(Attention):
    """:class:`Attention` with biased ``q/k/v/o_proj`` and ``sinks`` ``[n_heads]`` (fp32 or the model's dtype, as
    stored). Arguments are :class:`Attention`'s (``qkv_bias`` here also biases ``o_proj``)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, sliding_window: int | None = None):
        super().__init__(dim, n_heads, n_kv_heads, head_dim, qkv_bias=True, sliding_window=sliding_window)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(n_heads))

    def initializers(self, std: float = 0.02):
        """``(name, fill)`` of the sinks (normal, as transformers draws them); the linears are the decoder's."""
        yield "sinks", functools.partial(nn.init.normal_, std=std)

    def attend(self, q, k, v, cos, sin, mask=None, cache_pos=None, segments=None) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(cache_pos, k, v)
        return causal_attention(q, k, v, mask, segments, self.sliding_window, self.sinks)
