"""Every expert of a mixture-of-experts layer on its rows in one ``torch._grouped_mm`` call per projection.

:func:`grouped_experts` runs an experts module (:class:`~mtune.modules.moe.Experts` or a subclass: its
``projections()``, the first ones' outputs combined by ``hidden(...)`` and fed to the last) over rows sorted by
expert, the weights frozen: read in place when plain, dequantized as each is used when NF4
(:meth:`~mtune.modules.expert_linear.ExpertLinear.stacked`), each row's bias picked by its expert. Its backward
computes the input's gradient only. :mod:`mtune.modules.moe` says when it is used.
"""

from __future__ import annotations

import torch

from mtune.modules.expert_linear import ExpertLinear

__all__ = ["grouped_experts"]


def grouped_experts(x: torch.Tensor, offsets: torch.Tensor, experts) -> torch.Tensor:
    """``experts`` on ``x [rows, in]`` sorted by expert, expert ``e`` on rows ``offsets[e-1]:offsets[e]``
    (``offsets``: int32 ends of the groups) -> ``[rows, out]``."""
    return _GroupedExperts.apply(x, offsets, experts)


def _gmm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x [rows, k]`` times ``weights[e] [k, n]`` -> ``[rows, n]``."""
    return torch._grouped_mm(x, weights, offs=offsets)


def _row_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Each of ``rows`` rows' expert ``[rows]``, from the ends of the experts' groups of rows ``offsets``."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def _project(x: torch.Tensor, projection: ExpertLinear, offsets: torch.Tensor, row_experts: torch.Tensor | None):
    """One projection of every expert on its rows, its bias (when it has one) picked by each row's expert."""
    out = _gmm(x, projection.stacked().transpose(-2, -1), offsets)
    return out if projection.bias is None else out + projection.bias[row_experts]


class _GroupedExperts(torch.autograd.Function):
    """The experts' ``down(hidden(first projections(x)))`` (SwiGLU's gate and up, gpt-oss's fused gate/up) as
    grouped matmuls over the frozen 3-D weights, read in place (NF4: dequantized as each is used, never saved), biases
    added by each row's expert. Saves the first projections' outputs (as autograd would), not the hidden rows
    (recomputed in backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, experts) -> torch.Tensor:
        *firsts, down = experts.projections()
        biased = any(p.bias is not None for p in (*firsts, down))
        row_experts = _row_experts(offsets, x.shape[0]) if biased else None
        outs = [_project(x, p, offsets, row_experts) for p in firsts]
        out = _project(experts.hidden(*outs), down, offsets, row_experts)
        ctx.save_for_backward(offsets, *outs)
        ctx.experts = experts
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        offsets, *outs = ctx.saved_tensors
        *firsts, down = ctx.experts.projections()
        grad_hidden = _gmm(grad_out.contiguous(), down.stacked(), offsets)
        with torch.enable_grad():
            outs = [out.detach().requires_grad_() for out in outs]
            grads = torch.autograd.grad(ctx.experts.hidden(*outs), outs, grad_hidden)
        grad_x = _gmm(grads[0], firsts[0].stacked(), offsets)
        for grad, projection in zip(grads[1:], firsts[1:]):
            grad_x = grad_x + _gmm(grad, projection.stacked(), offsets)
        return grad_x, None, None
