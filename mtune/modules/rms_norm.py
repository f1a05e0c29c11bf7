"""Root-mean-square layer norm: Llama's, Gemma's ``(1 + weight)`` form, and Gemma 4's all-fp32 one."""

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

    initial_fill = staticmethod(nn.init.ones_)
    """How :meth:`TransformerDecoder.init_weights` fills ``weight``: the identity."""

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


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / sqrt(mean(x**2) + eps) * (1 + weight)``, all in fp32 and cast back to the input's dtype
    at the end (Llama's casts before the weight); ``weight`` starts at zero, the identity."""

    initial_fill = staticmethod(nn.init.zeros_)

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps)`` over the last dimension, in fp32, cast back to ``x``'s dtype (a norm without
    a weight: Gemma 4's value norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class FP32RMSNorm(RMSNorm):
    """Gemma 4's RMSNorm: ``x / sqrt(mean(x**2) + eps) * weight`` (a plain weight from ones, as Llama's), with the
    weight applied in fp32 before the cast back to the input's dtype (Llama's casts first; same in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)
