"""Root-mean-square layer norm."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension.

    The statistic is computed in fp32 and the result cast back to the input's dtype before the weight is applied,
    as Llama, Mistral and Qwen2 do, so bf16 models match their reference implementation.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square for numerical safety.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
