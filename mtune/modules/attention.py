"""Grouped-query self-attention, and its variants: per-head q/k RMSNorm (Qwen3), one fused q/k/v projection
(Phi-3/4), a sigmoid gate on each head's output (Qwen3.5)."""

import torch
import torch.nn.functional as F
from torch import nn

from mtune.modules.kv_cache import KVCache
from mtune.modules.packed_attention import Segments, segment_attention, sink_attention
from mtune.modules.rms_norm import RMSNorm
from mtune.modules.rotary import apply_rotary


class Attention(nn.Module):
    """Multi-head self-attention with grouped key/value heads (GQA), through ``scaled_dot_product_attention``.

    ``n_heads`` query heads share ``n_kv_heads`` key/value heads (``n_heads % n_kv_heads == 0``); ``n_kv_heads ==
    n_heads`` is plain multi-head attention.

    Args:
        dim: model width.
        n_heads, n_kv_heads, head_dim: head layout; ``q_proj`` is ``[n_heads * head_dim, dim]``.
        qkv_bias: give ``q_proj``, ``k_proj``, ``v_proj`` a bias (Qwen2).
        sliding_window: each token attends to at most this many tokens, itself included (Mistral); applied here
            when the layout comes as :class:`~mtune.modules.packed_attention.Segments`, else it is in the mask.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, qkv_bias: bool = False,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.make_projections(dim, qkv_bias)
        self.kv_cache: KVCache | None = None

    def make_projections(self, dim: int, qkv_bias: bool) -> None:
        """The linears: ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` (a fused variant makes others)."""
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x`` ``[b, s, dim]``, each ``[b, s, heads, head_dim]``, before RoPE: the one
        step the variants below change."""
        b, s, _ = x.shape
        return (self.q_proj(x).view(b, s, self.n_heads, self.head_dim),
                self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim),
                self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache_pos: torch.Tensor | None = None,
        segments: Segments | None = None,
    ) -> torch.Tensor:
        """Attend ``x`` ``[b, s, dim]`` to itself.

        Args:
            cos, sin: rotary tables ``[b, s, head_dim]``.
            mask: boolean ``[b, 1, s, kv_len]`` (True = may attend), or ``None`` for plain causal attention.
            cache_pos: LongTensor ``[s]``: cache slots of these tokens when a KV cache is set up.
            segments: segment starts in the flattened ``b * s`` tokens and their longest length (packed
                documents, rows): causal attention within each segment and the sliding window, without a mask
                (:mod:`mtune.modules.packed_attention`). Exclusive with ``mask`` and the KV cache.
        """
        return self.o_proj(self.attend(*self.project(x), cos, sin, mask, cache_pos, segments))

    def attend(self, q, k, v, cos, sin, mask=None, cache_pos=None, segments=None) -> torch.Tensor:
        """The heads' outputs ``[b, s, n_heads * head_dim]`` (before ``o_proj``) for queries, keys and values as
        :meth:`project` returns them: RoPE, the KV cache, then SDPA or attention per segment."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(cache_pos, k, v)
        return causal_attention(q, k, v, mask, segments, self.sliding_window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     segments: Segments | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The heads' outputs ``[b, s, hq * d]`` of rotated queries ``[b, hq, s, d]`` against keys and values ``[b, hkv,
    kv_len, d]`` (grouped when ``hkv < hq``): attention within each of the ``segments`` (with the sliding ``window``),
    else SDPA under ``mask`` (None: causal). ``sinks`` ``[hq]``: a sink logit per head in every softmax (gpt-oss)."""
    if segments is not None:
        return segment_attention(q, k, v, segments, window, sinks)
    b, h, s, _ = q.shape
    if sinks is not None:
        return sink_attention(q, k, v, sinks, mask).transpose(1, 2).reshape(b, s, -1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=k.shape[1] != h)
    return out.transpose(1, 2).reshape(b, s, -1)


class QKNormAttention(Attention):
    """:class:`Attention` with an RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3): ``q_norm``
    and ``k_norm``, one ``[head_dim]`` weight each, shared by all heads.

    Args:
        norm_eps: the norms' epsilon; the other arguments are :class:`Attention`'s.
        norm: the norm's class (Gemma's ``(1 + weight)`` RMSNorm for Gemma 3).
        query_pre_attn_scalar: scores are divided by its square root instead of ``head_dim``'s (Gemma 3); applied
            by scaling the normed queries, so every attention kernel (SDPA, per segment, varlen, the KV cache)
            stays as it is.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float,
                 qkv_bias: bool = False, sliding_window: int | None = None, norm: type[RMSNorm] = RMSNorm,
                 query_pre_attn_scalar: float | None = None) -> None:
        super().__init__(dim, n_heads, n_kv_heads, head_dim, qkv_bias, sliding_window)
        self.q_norm = norm(head_dim, norm_eps)
        self.k_norm = norm(head_dim, norm_eps)
        self.query_scale = 1.0 if query_pre_attn_scalar is None else (head_dim / query_pre_attn_scalar) ** 0.5

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        q = self.q_norm(q)
        return (q if self.query_scale == 1.0 else q * self.query_scale), self.k_norm(k), v


class FusedQKVAttention(Attention):
    """:class:`Attention` with one ``qkv_proj`` (``[(n_heads + 2 * n_kv_heads) * head_dim, dim]``: queries, then keys,
    then values) instead of three, as Phi-3 and Phi-4 checkpoints store it; kept fused so checkpoints and LoRA
    adapters (one adapter on ``qkv_proj``) keep the published layout."""

    def make_projections(self, dim: int, qkv_bias: bool) -> None:
        width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
        self.qkv_proj = nn.Linear(dim, width, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim], dim=-1)
        return (q.view(b, s, self.n_heads, self.head_dim), k.view(b, s, self.n_kv_heads, self.head_dim),
                v.view(b, s, self.n_kv_heads, self.head_dim))


class GatedAttention(QKNormAttention):
    """:class:`QKNormAttention` whose heads' outputs are gated before ``o_proj`` (Qwen3.5's full-attention layers):
    ``q_proj`` is twice as wide and gives each head its query and then a gate of ``head_dim`` values (per head, in
    that order), and each head's output is multiplied by ``sigmoid(gate)``."""

    def make_projections(self, dim: int, qkv_bias: bool) -> None:
        super().make_projections(dim, qkv_bias)
        self.q_proj = nn.Linear(dim, 2 * self.n_heads * self.head_dim, bias=qkv_bias)

    def forward(self, x, cos, sin, mask=None, cache_pos=None, segments=None) -> torch.Tensor:
        b, s, _ = x.shape
        query, gate = self.q_proj(x).view(b, s, self.n_heads, 2, self.head_dim).unbind(3)
        q = self.q_norm(query)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim)
        out = self.attend(q, k, v, cos, sin, mask, cache_pos, segments)
        return self.o_proj(out * torch.sigmoid(gate.reshape(b, s, -1)))
