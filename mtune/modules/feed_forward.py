"""SwiGLU feed-forward network."""

import torch
import torch.nn.functional as F
from torch import nn


class FeedForward(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, the MLP of Llama, Mistral and Qwen2.

    Args:
        dim: model width.
        hidden_dim: the intermediate width (``intermediate_size`` in Hugging Face configs).
    """

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
