"""SwiGLU feed-forward network, with separate or fused gate and up projections."""

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, the gated MLP of Llama, Mistral and Qwen (SiLU: SwiGLU) and
    Gemma (GELU-tanh: GeGLU).

    Args:
        dim: model width.
        hidden_dim: the intermediate width (``intermediate_size`` in Hugging Face configs).
        activation: the gate's activation, :func:`torch.nn.functional.silu` or :func:`gelu_tanh`.
        bias: the three projections carry biases (gpt-oss's experts; none in the dense families).
    """

    def __init__(self, dim: int, hidden_dim: int, activation=F.silu, bias: bool = False) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class FusedFeedForward(nn.Module):
    """:class:`FeedForward` with the gate and up projections in one ``gate_up_proj`` (``[2 * hidden_dim, dim]``,
    gate rows first), as Phi-3 and Phi-4 checkpoints store it: ``down_proj(silu(gate) * up)``."""

    activation = staticmethod(F.silu)

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
