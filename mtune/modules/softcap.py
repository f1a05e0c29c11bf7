"""Logit soft-capping: ``cap * tanh(logits / cap)`` bounds every logit to ``(-cap, cap)`` (Gemma 2 and 4)."""

import torch
from torch import nn


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)``, in ``logits``' dtype."""
    return torch.tanh(logits / cap) * cap


class SoftcappedLinear(nn.Linear):
    """An output projection whose logits are soft-capped (``final_logit_softcapping``); its weight is the plain
    ``lm_head.weight`` (tied or not), so checkpoints and adapters see an ``nn.Linear``. The chunked loss applies the
    cap itself (:class:`~mtune.modules.loss.ChunkedCrossEntropyLoss`)."""

    def __init__(self, in_features: int, out_features: int, cap: float) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.softcap = cap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softcap(super().forward(x), self.softcap)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, softcap={self.softcap}"
