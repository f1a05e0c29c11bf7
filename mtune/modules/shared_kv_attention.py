"""Attention with normed queries, keys and values whose keys and values later layers may reuse (Gemma 4).

Gemma 4 norms each head's query and key (``q_norm``, ``k_norm``) and its value (an RMS norm without a weight), so
its scores need no ``1 / sqrt(head_dim)``. A layer with its own keys and values (:class:`NormedKVAttention`) returns
them, rotated and normed, beside its output; the last ``num_kv_shared_layers`` layers (:class:`SharedKVAttention`)
have no key or value projections and attend to those of the last earlier layer of their kind (sliding or global),
which the decoder hands them (:class:`~mtune.modules.per_layer_decoder.PerLayerInputDecoder`). Both are called
``attn(x, cos, sin, mask, cache_pos, segments, k, v) -> (out, k, v)``, tensors only. When decoding, a layer with
its own keys and values writes them into its ``kv_cache`` and returns the whole cache, which the reusing layers
(whose ``kv_cache`` stays None) attend to under the mask against it.
"""

import torch
from torch import nn

from mtune.modules.attention import causal_attention
from mtune.modules.kv_cache import KVCache
from mtune.modules.rms_norm import FP32RMSNorm, rms_normalize
from mtune.modules.rotary import apply_rotary


class SharedKVAttention(nn.Module):
    """Queries of its own (``q_proj``, ``q_norm``), keys and values handed in (``[b, n_kv_heads, s, head_dim]``,
    rotated and normed by the layer that made them), ``o_proj``.

    Args:
        dim: model width; n_heads, n_kv_heads, head_dim: the layout (``q_proj`` is ``[n_heads * head_dim, dim]``).
        norm_eps: the norms' epsilon.
        sliding_window: each token attends to at most this many tokens, itself included (None: all earlier ones).
    Attributes:
        kv_cache: None; the decoder's ``setup_caches`` gives layers that make keys and values a
            :class:`~mtune.modules.kv_cache.KVCache`, and leaves this class's at None (it reads its source's).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.sliding_window, self.norm_eps = sliding_window, norm_eps
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.q_norm = FP32RMSNorm(head_dim, norm_eps)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.kv_cache: KVCache | None = None

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Normed, rotated queries ``[b, n_heads, s, head_dim]``, scaled by ``sqrt(head_dim)`` so that the kernels'
        ``1 / sqrt(head_dim)`` leaves the scores unscaled, as the normed queries and keys want."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_heads, self.head_dim)) * self.head_dim**0.5
        return apply_rotary(q.transpose(1, 2), cos, sin)

    def forward(self, x, cos, sin, mask=None, cache_pos=None, segments=None, k=None, v=None):
        """``x`` ``[b, s, dim]`` attending to the given ``k, v``; returns ``(out [b, s, dim], k, v)``."""
        if k is None or v is None:
            raise ValueError("a shared-KV attention layer needs the keys and values of an earlier layer")
        out = causal_attention(self.queries(x, cos, sin), k, v, mask, segments, self.sliding_window)
        return self.o_proj(out), k, v


class NormedKVAttention(SharedKVAttention):
    """:class:`SharedKVAttention` that makes its own keys and values: ``k_proj`` then ``k_norm`` and RoPE; ``v_proj``
    then an RMS norm without weight. ``keys_are_values`` (``attention_k_eq_v``, Gemma 4's global layers of 31B):
    no ``v_proj``; the values are ``k_proj``'s output, normed without weight and not rotated. Returns the keys and
    values it attended to, for layers that reuse them: with a ``kv_cache``, the whole cache after writing this call's
    tokens at ``cache_pos``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float,
                 sliding_window: int | None = None, keys_are_values: bool = False) -> None:
        super().__init__(dim, n_heads, n_kv_heads, head_dim, norm_eps, sliding_window)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = None if keys_are_values else nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.k_norm = FP32RMSNorm(head_dim, norm_eps)

    def forward(self, x, cos, sin, mask=None, cache_pos=None, segments=None, k=None, v=None):
        b, s, _ = x.shape
        keys = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        values = keys if self.v_proj is None else self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        k = apply_rotary(self.k_norm(keys).transpose(1, 2), cos, sin)
        v = rms_normalize(values, self.norm_eps).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(cache_pos, k, v)
        return super().forward(x, cos, sin, mask, cache_pos, segments, k, v)
