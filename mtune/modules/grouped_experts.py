"""Every expert of a mixture-of-experts layer on its rows in one ``torch._grouped_mm`` call per projection.

:func:`grouped_experts` runs an experts module (:class:`~mtune.modules.moe.Experts` or a subclass: its
``projections()``, the first ones' outputs combined by ``hidden(...)`` and fed to the last) over rows sorted by
expert. The base weights are frozen: read in place when plain, dequantized as each is used when NF4
(:meth:`~mtune.modules.expert_linear.ExpertLinear.stacked`), never saved; each row's bias is picked by its expert.
A projection with per-expert LoRA factors (:class:`~mtune.modules.expert_linear.LoRAExpertLinear`, without dropout)
adds ``s * (x A_e^T) B_e^T`` by two more grouped calls, and its factors get their gradients. Backward saves the
rows, the first projections' outputs and the ``rows x rank`` products, and recomputes the rest.
:mod:`mtune.modules.moe` says when this path is used.
"""

from __future__ import annotations

import torch

from mtune.modules.expert_linear import ExpertLinear, LoRAExpertLinear

__all__ = ["adapted", "grouped_experts"]


def adapted(projection: ExpertLinear) -> bool:
    """Whether ``projection`` adds its LoRA factors (an adapter, enabled)."""
    return isinstance(projection, LoRAExpertLinear) and projection.adapters_enabled


def grouped_experts(x: torch.Tensor, offsets: torch.Tensor, experts) -> torch.Tensor:
    """``experts`` on ``x [rows, in]`` sorted by expert, expert ``e`` on rows ``offsets[e-1]:offsets[e]``
    (``offsets``: int32 ends of the groups) -> ``[rows, out]``."""
    factors = [t for p in experts.projections() if adapted(p) for t in (p.lora_a.weight, p.lora_b.weight)]
    return _GroupedExperts.apply(x, offsets, experts, *factors)


def _gmm(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows ``offsets[e-1]:offsets[e]`` of ``x [rows, k]`` times ``weights[e] [k, n]`` -> ``[rows, n]``."""
    return torch._grouped_mm(x, weights, offs=offsets)


def _per_expert_outer(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``a[rows_e]^T b[rows_e]`` for each expert ``e``: ``a [rows, m]``, ``b [rows, n]`` -> ``[n_experts, m, n]``
    (zeros for an expert without rows): a factor's gradient."""
    return torch._grouped_mm(a.t(), b, offs=offsets)


def _row_experts(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Each of ``rows`` rows' expert ``[rows]``, from the ends of the experts' groups of rows ``offsets``."""
    return torch.searchsorted(offsets, torch.arange(rows, device=offsets.device, dtype=offsets.dtype), right=True)


def _project(x: torch.Tensor, projection: ExpertLinear, offsets: torch.Tensor, row_experts: torch.Tensor | None):
    """The base projection of every expert on its rows, its bias (when it has one) picked by each row's expert."""
    out = _gmm(x, projection.stacked().transpose(-2, -1), offsets)
    return out if projection.bias is None else out + projection.bias[row_experts]


def _recompute_hidden(experts, outs: list[torch.Tensor], compiling: bool):
    """``experts.hidden(*outs)`` again, and the function from its gradient to ``outs``' gradients. Under
    torch.compile by ``torch.func.vjp``, which dynamo traces into the block's graph (``torch.autograd.grad`` would
    break the graph at every MoE layer); eagerly by ``torch.autograd.grad``, which frees each saved intermediate as
    it goes where a vjp keeps them all until it returns (gpt-oss's clamped SwiGLU keeps several)."""
    if compiling:
        return torch.func.vjp(experts.hidden, *outs)
    outs = [out.detach().requires_grad_() for out in outs]
    with torch.enable_grad():
        hidden = experts.hidden(*outs)
    return hidden.detach(), lambda grad: torch.autograd.grad(hidden, outs, grad)


class _GroupedExperts(torch.autograd.Function):
    """The experts' ``down(hidden(first projections(x)))`` (SwiGLU's gate and up, gpt-oss's fused gate/up) by grouped
    matmuls (see the module docstring). ``factors``: each adapted projection's ``lora_a.weight`` and
    ``lora_b.weight``, in :meth:`projections` order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offsets: torch.Tensor, experts, *factors: torch.Tensor) -> torch.Tensor:
        projections = experts.projections()
        *firsts, down = projections
        biased = any(p.bias is not None for p in projections)
        row_experts = _row_experts(offsets, x.shape[0]) if biased else None
        lora = dict(zip([p for p in projections if adapted(p)], zip(factors[::2], factors[1::2])))
        lows = {}

        def project(rows: torch.Tensor, p: ExpertLinear) -> torch.Tensor:
            out = _project(rows, p, offsets, row_experts)
            if p in lora:
                a, b = lora[p]
                lows[p] = _gmm(rows, a.transpose(-2, -1), offsets)
                out = out + p.scaling * _gmm(lows[p], b.transpose(-2, -1), offsets)
            return out

        outs = [project(x, p) for p in firsts]
        out = project(experts.hidden(*outs), down)
        keep_x = any(p in lora for p in firsts)  # their factors' gradients read the rows
        ctx.save_for_backward(x if keep_x else None, offsets, *outs, *lows.values(), *factors)
        ctx.experts, ctx.adapted, ctx.firsts = experts, list(lora), len(firsts)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, offsets, *saved = ctx.saved_tensors
        n_adapted = len(ctx.adapted)
        outs, lows = saved[:ctx.firsts], saved[ctx.firsts:ctx.firsts + n_adapted]
        factors = saved[ctx.firsts + n_adapted:]
        *firsts, down = ctx.experts.projections()
        factor_grads: list[torch.Tensor | None] = [None] * len(factors)

        def back(grad: torch.Tensor, p: ExpertLinear, rows: torch.Tensor | None) -> torch.Tensor:
            """The gradient of ``p``'s input from its output's ``grad``; its factors' gradients recorded."""
            grad = grad.contiguous()
            grad_in = _gmm(grad, p.stacked(), offsets)
            if p in ctx.adapted:
                i = ctx.adapted.index(p)
                a, b = factors[2 * i], factors[2 * i + 1]
                grad_low = p.scaling * _gmm(grad, b, offsets)
                factor_grads[2 * i + 1] = p.scaling * _per_expert_outer(grad, lows[i], offsets)
                factor_grads[2 * i] = _per_expert_outer(grad_low, rows, offsets)
                grad_in = grad_in + _gmm(grad_low, a, offsets)
            return grad_in

        # the hidden rows live only while needed: from down's input gradient where its factors read them, else from
        # their own gradient; never through the first projections' backward
        compiling = torch.compiler.is_compiling()
        hidden, hidden_grads = _recompute_hidden(ctx.experts, outs, compiling) if down in ctx.adapted else (None, None)
        grad_hidden = back(grad_out, down, hidden)
        del hidden
        if hidden_grads is None:
            hidden_grads = _recompute_hidden(ctx.experts, outs, compiling)[1]
        grads = hidden_grads(grad_hidden)
        del hidden_grads
        grad_x = back(grads[0], firsts[0], x)
        for grad, projection in zip(grads[1:], firsts[1:]):
            grad_x = grad_x + back(grad, projection, x)
        return grad_x, None, None, *factor_grads
