"""The scan over chunks of the chunked gated delta rule (:func:`~mtune.modules.gated_deltanet.chunked_gated_delta_rule`)
as one autograd function with its own backward.

Per chunk ``c``, with ``S`` the state entering it (``[k_head_dim, v_head_dim]`` per batch row and head)::

    delta   = u_c - w_c S                      # the chunk's writes, solved (rows: its tokens)
    out_c   = scores_c delta + q_c S           # reads within the chunk, and of the entering state
    S_next  = decay_c * S + k_c delta          # the state leaving it

Autograd through that loop keeps, per chunk, the state and ``delta`` and a handful of graph nodes; this function
keeps the states only (one buffer, ``[n + 1, b * h, k_head_dim, v_head_dim]``), recomputes ``delta`` in backward
and writes every chunk's outputs and gradients into buffers allocated once. So each chunk allocates the same
temporaries and frees them before the next, and on ``mtune plan``'s fake tensors (bytes, no values) two chunks meet
every allocation the whole loop meets: the loops run those two (`planned_chunks`), whatever the length, where the
per-chunk autograd graph cost the planner seconds per 10K tokens (Qwen3.5 9B at 32K tokens: 28 CPU-s a plan).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["gated_delta_scan", "planned_chunks"]


def planned_chunks(n: int, like: torch.Tensor) -> range:
    """The chunks the loops run: all ``n``, but on the planner's fake tensors the first two (every chunk allocates
    and frees the same temporaries, into buffers allocated before the loop, so the peaks are the same). Keyed on the
    tensor's type, not ``is_fake``: torch.compile traces with fake tensors too, and its graph must hold every chunk
    (``test_gated_deltanet.py``)."""
    return range(min(n, 2)) if isinstance(like, FakeTensor) else range(n)


class _GatedDeltaScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, w, q, scores, k_end, decay, initial):
        bh, n, _, dv = u.shape
        dk = w.shape[-1]
        states = u.new_empty(n + 1, bh, dk, dv)  # states[c]: entering chunk c; states[n]: leaving the last
        states[0] = initial if initial is not None else 0
        out = u.new_empty(bh, n, u.shape[2], dv)
        for c in planned_chunks(n, u):
            state = states[c]
            delta = torch.baddbmm(u[:, c], w[:, c], state, alpha=-1)
            out[:, c] = torch.baddbmm(scores[:, c] @ delta, q[:, c], state)
            torch.baddbmm(state * decay[:, c], k_end[:, c], delta, out=states[c + 1])
        ctx.save_for_backward(u, w, q, scores, k_end, decay, states)
        ctx.has_initial = initial is not None
        return out, states[n].clone()

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        u, w, q, scores, k_end, decay, states = ctx.saved_tensors
        n = u.shape[1]
        grad_u, grad_w, grad_q, grad_scores, grad_k_end, grad_decay = (torch.empty_like(t) for t in (
            u, w, q, scores, k_end, decay))
        grad_state = grad_final.clone() if grad_final is not None else torch.zeros_like(states[0])
        for c in reversed(planned_chunks(n, u)):
            state, g = states[c], grad_out[:, c]
            delta = torch.baddbmm(u[:, c], w[:, c], state, alpha=-1)
            # delta feeds the chunk's reads and the leaving state
            grad_delta = torch.baddbmm(scores[:, c].transpose(-1, -2) @ g, k_end[:, c].transpose(-1, -2), grad_state)
            grad_scores[:, c] = g @ delta.transpose(-1, -2)
            grad_q[:, c] = g @ state.transpose(-1, -2)
            grad_k_end[:, c] = grad_state @ delta.transpose(-1, -2)
            grad_decay[:, c] = (grad_state * state).sum((-1, -2), keepdim=True)
            grad_u[:, c] = grad_delta
            grad_w[:, c] = -(grad_delta @ state.transpose(-1, -2))
            # the entering state: decayed into the leaving one, read by the queries, predicted by the writes
            leaving = torch.baddbmm(grad_state * decay[:, c], q[:, c].transpose(-1, -2), g)
            grad_state = torch.baddbmm(leaving, w[:, c].transpose(-1, -2), grad_delta, alpha=-1)
        return grad_u, grad_w, grad_q, grad_scores, grad_k_end, grad_decay, grad_state if ctx.has_initial else None


def gated_delta_scan(u: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scores: torch.Tensor, k_end: torch.Tensor,
                     decay: torch.Tensor, initial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over ``n`` chunks of ``C`` tokens, each row ``b * h`` of it independent, all fp32.

    Args:
        u: ``[bh, n, C, dv]``, the writes' part independent of the entering state.
        w: ``[bh, n, C, dk]``, their part linear in it.
        q: ``[bh, n, C, dk]``, the queries reading the entering state (zero rows: tokens that do not).
        scores: ``[bh, n, C, C]``, the reads within each chunk.
        k_end: ``[bh, n, dk, C]``, each write's key decayed to the chunk's end (zero: not carried on).
        decay: ``[bh, n, 1, 1]`` (may be an expanded view), the entering state's decay over each chunk.
        initial: ``[bh, dk, dv]``, the state entering the first chunk; None: zeros.

    Returns:
        ``(out [bh, n, C, dv], the state leaving the last chunk [bh, dk, dv])``.
    """
    return _GatedDeltaScan.apply(u, w, q, scores, k_end, decay, initial)
