"""Key/value cache for incremental decoding."""

import torch
from torch import nn


class KVCache(nn.Module):
    """Preallocated keys and values ``[batch, kv_heads, max_seq_len, head_dim]`` of one attention layer.

    Slot ``p`` holds the token at position ``p``; :meth:`update` writes new tokens at their positions and returns
    the whole cache, so attention masks unwritten slots by position (see ``TransformerDecoder``).
    """

    def __init__(self, batch_size: int, max_seq_len: int, kv_heads: int, head_dim: int, dtype, device) -> None:
        super().__init__()
        shape = (batch_size, kv_heads, max_seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` ``[b, kv_heads, s, head_dim]`` at ``positions`` ``[s]``; return the full caches."""
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
        return self.k, self.v
