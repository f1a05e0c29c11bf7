"""gpt-oss's experts: a clamped SwiGLU over one fused, biased gate/up projection whose gate and up features
interleave (feature ``2j`` is gate ``j``, ``2j + 1`` up ``j``), then a biased down projection:

    gate = min(g, limit);  up = clamp(u, -limit, limit)
    out = down((up + 1) * gate * sigmoid(alpha * gate))

with ``alpha`` 1.702 and ``limit`` 7 in the published models (``swiglu_alpha``, ``swiglu_limit``). The clamp stops
gradients where it bites, as ``torch.clamp`` does in transformers.

Each projection is an :class:`~mtune.modules.expert_linear.ExpertLinear` (``gate_up_proj`` ``[n_experts, 2 *
hidden, dim]``, ``down_proj`` ``[n_experts, dim, hidden]``, as ``[out, in]`` rows), so LoRA adapts and QLoRA stores
them as it does Qwen3-MoE's; the checkpoints hold them transposed and whole (``experts.gate_up_proj`` ``[n_experts,
dim, 2 * hidden]`` and ``experts.gate_up_proj_bias``): ``GptOssArgs.expert_checkpoint_layout``, translated by
:mod:`mtune.modules.expert_layout`.
"""

import torch
from torch import nn

from mtune.modules.expert_linear import ExpertLinear
from mtune.modules.moe import Experts

__all__ = ["ClampedSwiGLUExperts", "clamped_swiglu"]


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """``[rows, 2 * hidden]`` with interleaved gate and up features -> ``[rows, hidden]`` (see the module
    docstring)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLUExperts(Experts):
    """``n_experts`` clamped-SwiGLU MLPs, run on rows sorted by expert as :class:`~mtune.modules.moe.Experts` are.

    Args:
        n_experts, dim, hidden_dim: experts, width, each expert's intermediate width (``intermediate_size``).
        alpha, limit: ``swiglu_alpha`` and ``swiglu_limit``.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, alpha: float = 1.702, limit: float = 7.0):
        nn.Module.__init__(self)
        self.n_experts, self.alpha, self.limit = n_experts, alpha, limit
        self.gate_up_proj = ExpertLinear(n_experts, dim, 2 * hidden_dim, bias=True)
        self.down_proj = ExpertLinear(n_experts, hidden_dim, dim, bias=True)

    def projections(self) -> list[ExpertLinear]:
        return [self.gate_up_proj, self.down_proj]

    def hidden(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"
