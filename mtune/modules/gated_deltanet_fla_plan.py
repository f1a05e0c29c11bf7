"""What flash-linear-attention's ``chunk_gated_delta_rule`` allocates, for ``mtune plan`` on fake tensors.

The kernel is Triton: it cannot run on the planner's fake tensors, and its footprint differs from the PyTorch
chunked form's (it keeps bf16 normalised queries and keys, the cumulated decays and the ``[*, 64]`` write system
for backward, and recomputes the rest). :func:`fla_stand_in` takes the kernel's arguments as
:func:`~mtune.modules.gated_deltanet_fla.fla_gated_delta_rule` passes them (bf16 ``q, k`` ``[B, T, H, K]``, ``v``
``[B, T, HV, V]``, fp32 log decays ``g`` and ``beta`` ``[B, T, HV]``, ``use_qk_l2norm_in_kernel=True``, no state)
and allocates what fla-core 0.6.0's Triton path allocates, in its order and with its dtypes, saving for backward
what its autograd Function saves (``fla/ops/gated_delta_rule/chunk.py`` and the helpers it calls). Values are
not computed (the outputs are uninitialised); it is for fake tensors only.

With ``BT = 64`` (fla's chunk) and ``NT`` chunks (``ceil(T / 64)`` a row; with ``cu_seqlens`` the sum over
documents), forward: a contiguous copy of each non-contiguous input (fla's ``input_guard``, held until forward
returns); L2 norms of ``q`` and ``k`` (``[B*T*H, K]`` in their dtype plus fp32 ``rstd`` ``[B*T*H]`` each); the
chunk-local cumsum of ``g`` (fp32); ``A`` ``[B, T, HV, BT]`` (``k``'s dtype); ``w`` ``[B, T, HV, K]`` and ``u``
(``v``'s shape); ``h`` ``[B, NT, HV, K, V]`` and ``v_new``; the output ``o`` (``v``'s shape and dtype); then ``w,
u, h, v_new`` are freed, then the copies of ``k`` and ``q``. Saved: normalised ``q, k``, both ``rstd``, ``v``, the
cumsum of ``g``, ``beta`` and ``A``. Backward recomputes ``w, u, h, v_new``, makes ``dv`` (local), ``dh``
(``h``'s shape) and a second ``dv``, then ``dq, dk`` ``[B, T, HV, K]``, fp32 ``dg`` ``[NK, B, T, HV]`` (``NK =
ceil(K / BK)``, ``BK`` the device's tile: :data:`HOPPER_K_TILE`) and ``dw``, each reduced over value-head groups
(and ``dg`` over ``NK``) into a new tensor, then the WY backward's ``dk, dv, dg, db``, the reverse cumsum of
``dg`` and the L2 norms' backward (``[B*T*H, K]`` each).

Not modelled: fla's int64 chunk indices of packed rows (``prepare_chunk_indices`` and its offsets, ``O(NT)``
values: a few hundred bytes at 4096 tokens).
"""

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["CHUNK", "HOPPER_K_TILE", "fla_stand_in", "FlaGatedDeltaRuleStandIn"]

CHUNK = 64
"""fla's chunk size for the gated delta rule (its default)."""

HOPPER_K_TILE = 128
"""The key tile of fla's ``chunk_bwd_dqkwg`` on Hopper (and Ampere with 16-bit inputs): fp32 ``dg`` is made as
``ceil(K / tile)`` partial sums. Smaller GPUs tile by 64, and a device fla cannot query (Triton's interpreter) by
32."""


def _held_copy(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()  # fla's input_guard: a copy only where the input is not contiguous


def _l2norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., K]`` contiguous -> (normalised ``x``'s shape and dtype, fp32 ``rstd`` ``x.shape[:-1]``)."""
    flat = x.view(-1, x.shape[-1])
    y = torch.empty_like(flat)
    rstd = torch.empty(flat.shape[0], dtype=torch.float32, device=x.device)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _forward(k, v, g, chunks):
    """fla's ``chunk_gated_delta_rule_fwd``: returns (fp32 cumsum of ``g``, ``o``, ``A``)."""
    b, t, hv, dk = *k.shape[:2], v.shape[2], k.shape[-1]
    g_cum = torch.empty_like(g, dtype=torch.float32)
    a = torch.zeros(b, t, hv, CHUNK, dtype=k.dtype, device=k.device)
    w = k.new_empty(b, t, hv, dk)
    u = torch.empty_like(v)
    h = k.new_empty(b, chunks, hv, dk, v.shape[-1])
    v_new = torch.empty_like(u)
    o = torch.empty_like(v_new)
    del w, u, h, v_new  # freed in this order as fla's function returns
    return g_cum, o, a


def _backward(q, k, v, g, beta, do, chunks, k_tile):
    """fla's ``chunk_gated_delta_rule_bwd`` before the L2 norms' backward: returns ``dq, dk`` ``[B, T, H, K]``,
    ``dv``, fp32 ``dg`` and ``db``."""
    b, t, heads, dk = k.shape
    hv, dv_dim = v.shape[2], v.shape[-1]
    w = k.new_empty(b, t, hv, dk)
    u = torch.empty_like(v)
    h = k.new_empty(b, chunks, hv, dk, dv_dim)
    v_new = torch.empty_like(u)
    dv = torch.empty_like(do)  # chunk_bwd_dv_local
    dh = q.new_empty(b, chunks, hv, dk, dv_dim)
    dv = torch.empty_like(dv)  # chunk_gated_delta_rule_bwd_dhu's dv2 replaces it
    tile = min(max(1 << (dk - 1).bit_length(), 16), k_tile)
    dq = q.new_empty(b, t, hv, dk)
    dk_ = k.new_empty(b, t, hv, dk)
    dg = torch.empty(-(-dk // tile), *g.shape, dtype=torch.float32, device=g.device)
    dw = torch.empty_like(w)
    if heads != hv:  # grouped value heads: each group's gradients summed onto its query/key head
        dq = dq.view(b, t, heads, hv // heads, dk).sum(3)
        dk_ = dk_.view(b, t, heads, hv // heads, dk).sum(3)
    dg = dg.sum(0)
    dk2 = k.new_empty(b, t, hv, dk)  # prepare_wy_repr_bwd
    dv_wy = torch.empty_like(v)
    dg2 = torch.empty_like(g)
    db = torch.empty_like(beta)
    if heads != hv:
        dk2 = dk2.view(b, t, heads, hv // heads, dk).sum(3)
    dv = dv_wy
    dk_.add_(dk2)
    dg.add_(dg2)
    dg = torch.empty_like(dg, dtype=torch.float32)  # the reverse chunk-local cumsum
    del w, u, h, v_new, dh, dw, dk2, dg2  # freed in this order as fla's function returns
    return dq, dk_, dv, dg, db


class FlaGatedDeltaRuleStandIn(torch.autograd.Function):
    """fla's ``ChunkGatedDeltaRuleFunction`` as it allocates (see the module docstring); ``chunks``: ``NT``,
    ``k_tile``: the device's key tile of ``chunk_bwd_dqkwg``."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, chunks: int, k_tile: int):
        held = [_held_copy(t) for t in (q, k, v, g, beta)]  # freed last to first as forward returns, as fla's are
        q_in, k_in, v, g, beta = held
        q, q_rstd = _l2norm(q_in)
        k, k_rstd = _l2norm(k_in)
        del q_in, k_in
        g, o, a = _forward(k, v, g, chunks)
        ctx.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, a)
        ctx.chunks, ctx.k_tile = chunks, k_tile
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        do = _held_copy(do)
        q, q_rstd, k, k_rstd, v, g, beta, a = ctx.saved_tensors
        dq, dk, dv, dg, db = _backward(q, k, v, g, beta, do, ctx.chunks, ctx.k_tile)
        dq = torch.empty_like(q.view(-1, q.shape[-1])).view(dq.shape)  # the L2 norms' backward
        dk = torch.empty_like(k.view(-1, k.shape[-1])).view(dk.shape)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), None, None


def planned_chunks(b: int, s: int, cu_seqlens: torch.Tensor | None) -> int:
    """fla's ``NT`` (chunks a row) for ``b`` rows of ``s`` tokens as the kernel is called: ``ceil(s / 64)``; with
    ``cu_seqlens`` (``b == 1``: documents in one flattened row) the sum over documents, or, where they have no
    values (fake tensors), equal documents, as :func:`~mtune.modules.packed_attention.document_boundaries` gives
    the planner's rows (the plan cannot see where documents end: each adds up to one chunk)."""
    if cu_seqlens is None:
        return -(-s // CHUNK)
    if is_fake(cu_seqlens):  # equal rows: b * s tokens flattened into one row of len(cu_seqlens) - 1 documents
        rows = cu_seqlens.shape[0] - 1
        return rows * -(-(b * s // rows) // CHUNK)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return sum(-(-n // CHUNK) for n in lengths)


def fla_stand_in(k_tile: int = HOPPER_K_TILE):
    """A callable with the arguments :func:`~mtune.modules.gated_deltanet_fla.fla_gated_delta_rule` passes
    ``chunk_gated_delta_rule``, returning ``(o, None)`` through :class:`FlaGatedDeltaRuleStandIn`."""

    def stand_in(q, k, v, g, beta, scale=None, use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        if not use_qk_l2norm_in_kernel:
            raise ValueError("the planner's stand-in for flash-linear-attention models use_qk_l2norm_in_kernel=True "
                             "only, as GatedDeltaNet calls it")
        chunks = planned_chunks(q.shape[0], q.shape[1], cu_seqlens)
        return FlaGatedDeltaRuleStandIn.apply(q, k, v, g, beta, chunks, k_tile), None

    return stand_in
