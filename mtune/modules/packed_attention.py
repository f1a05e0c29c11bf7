"""Causal attention over segments of a row (packed documents, sliding windows) without an ``s x s`` mask.

A packed row holds several documents; a token attends only to earlier tokens of its own document (and, with a
sliding window of ``W``, only to the last ``W`` of them, itself included). The dense way to say this is a boolean
``[b, 1, s, s]`` mask: s² bytes per row (1 GiB at 32K tokens), and it keeps SDPA off its flash kernels. Here the
layout is a tensor of segment boundaries instead, ``cu_seqlens`` (int32 ``[n + 1]``: the start of each of the ``n``
documents in the flattened ``b * s`` tokens, then ``b * s``), which :func:`document_boundaries` builds once per
forward and every block receives as a tensor (so checkpointing, ``compile`` and FSDP wrap blocks unchanged).

Kernels, chosen per call by :func:`segment_kernel`:

- ``varlen_flash`` (CUDA, bf16/fp16, a torch with ``torch.nn.attention.varlen``): one flash call over every
  document of the batch; sliding windows are the kernel's ``window_size``. ``max_q`` is the row length, an upper
  bound that needs no device sync. torch 2.10's ``is_causal`` argument (no window, no GQA) is detected.
- ``sdpa_per_segment`` (any device; the CPU's): exact causal SDPA per document, queries ``[1, h, L, d]`` against
  their own keys, so memory is O(s) (the outputs and log-sum-exps) and compute is the sum of L². A document longer
  than the window runs its first ``W`` queries causally, then chunks of ``W`` queries against the ``2W - 1`` keys
  they can see, under one band mask shared by every chunk (O(W²) once, not per chunk). Reading the boundaries is
  data-dependent Python, so it is kept out of ``torch.compile`` graphs (a graph break per block).

Fake tensors (``mtune plan`` runs the model under ``FakeTensorMode``) have no values to split on: there
:func:`document_boundaries` gives one segment per row and the same kernel runs on those, which allocates what any
split of the rows does (per-segment outputs and log-sum-exps that add up to one row's, the same concatenations in
forward and backward, the one shared band mask), so plans stay true; only the FLOPs differ.

The dense mask stays as a fallback: ``TransformerDecoder.attention_kernel = "dense_mask"``.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

__all__ = ["DENSE_MASK_UP_TO", "document_boundaries", "segment_attention", "segment_kernel", "kernel_for",
           "varlen_available"]

_HALF = (torch.float16, torch.bfloat16)

DENSE_MASK_UP_TO = 256
"""How a packed or sliding-window batch tells attention what each token may see: ``segments`` (boundaries
``cu_seqlens``, O(s) memory: this module), ``dense_mask`` (a boolean ``[b, 1, s, s]`` mask, s² bytes per row: the
fallback), or ``auto``: the dense mask for rows of at most :data:`DENSE_MASK_UP_TO` tokens (at most 64 KiB a row, and
one SDPA call instead of one per document: 16 rows of 64 tokens step 16% faster on CPU), segments beyond. (Read by
``TransformerDecoder``.)"""


_VARLEN: list = []  # [(varlen_attn, its parameter names) or None] once looked up


def _varlen_api() -> tuple[object, set[str]] | None:
    """``varlen_attn`` and its parameter names, or None; imported on first use on CUDA only (the module loads
    torch._dynamo, ~85 MiB and a second of start-up that CPU runs never need)."""
    if not _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _VARLEN.append(None)
        else:
            _VARLEN.append((varlen_attn, set(inspect.signature(varlen_attn).parameters)))
    return _VARLEN[0]


def varlen_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (2.10 and later) and CUDA."""
    return torch.cuda.is_available() and _varlen_api() is not None


def segment_kernel(q: torch.Tensor, window: int | None = None) -> str:
    """The kernel :func:`segment_attention` runs for queries like ``q`` (see the module docstring)."""
    return kernel_for(q.device, q.dtype, window)


def kernel_for(device: torch.device | str, dtype: torch.dtype, window: int | None = None) -> str:
    """The kernel :func:`segment_attention` runs for queries of ``dtype`` on ``device``: ``varlen_flash`` or
    ``sdpa_per_segment``."""
    if torch.device(device).type != "cuda" or dtype not in _HALF:
        return "sdpa_per_segment"
    api = _varlen_api()
    if api is not None and (window is None or "window_size" in api[1]):
        return "varlen_flash"
    return "sdpa_per_segment"


def document_boundaries(document_ids: torch.Tensor | None, batch: int, seq_len: int,
                        device: torch.device | None = None) -> torch.Tensor:
    """``cu_seqlens`` (int32 ``[n + 1]``): where each document starts in the flattened ``batch * seq_len`` tokens,
    then ``batch * seq_len``. A document is a run of equal ``document_ids`` in a row (packing writes them so); rows
    are always boundaries. ``document_ids=None`` (or fake tensors, which have no values) gives one segment per row.
    """
    device = document_ids.device if document_ids is not None else device
    rows = torch.arange(0, batch * seq_len + 1, seq_len, device=device, dtype=torch.int32)
    if document_ids is None or is_fake(document_ids):
        return rows
    starts = torch.ones(batch, seq_len, dtype=torch.bool, device=device)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.cat([starts.view(-1).nonzero().view(-1).to(torch.int32), rows[-1:]])


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention within each segment of ``cu_seqlens``: ``q`` ``[b, hq, s, d]``, ``k, v`` ``[b, hkv, s, d]``
    (grouped-query when ``hkv < hq``) -> ``[b, s, hq * d]``, ready for the output projection. ``window``: each
    token attends to at most this many tokens of its segment, itself included."""
    kernel = segment_kernel(q, window)
    b, h, s, d = q.shape
    if kernel == "varlen_flash":
        return _varlen(q, k, v, cu_seqlens, window).view(b, s, h * d)
    return _per_segment(q, k, v, cu_seqlens, window)


def _varlen(q, k, v, cu_seqlens, window):
    varlen_attn, params = _varlen_api()
    b, h, s, d = q.shape
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    kwargs = {}
    if "window_size" in params:  # 2.11+: causal is a right window of 0
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    else:  # 2.10: is_causal, no window (segment_kernel never picks this kernel with one)
        kwargs["is_causal"] = True
    if k.shape[1] != h:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            flat[1], flat[2] = (t.repeat_interleave(h // k.shape[1], dim=1) for t in flat[1:])
    return varlen_attn(*flat, cu_seqlens, cu_seqlens, s, s, **kwargs)


def _band_mask(window: int, like: torch.Tensor) -> torch.Tensor:
    """Additive mask ``[window, 2 * window - 1]`` for ``window`` queries against the ``2 * window - 1`` keys ending
    at the last of them: query ``i`` sees keys ``i .. i + window - 1``. Additive in the queries' dtype, so SDPA
    uses it as it is (a boolean one is converted, and saved for backward, once per call)."""
    i = torch.arange(window, device=like.device)[:, None]
    j = torch.arange(2 * window - 1, device=like.device)[None, :]
    allowed = (j >= i) & (j <= i + window - 1)
    return torch.zeros(allowed.shape, dtype=like.dtype, device=like.device).masked_fill_(~allowed, float("-inf"))


# Reads the boundaries' values (data-dependent Python), so it is kept out of compiled graphs. torch's lazy form of
# torch.compiler.disable: it imports torch._dynamo (~85 MiB, a second of start-up) on the first call, not when this
# module loads, so runs that never pack nor compile never load it.
@torch._disable_dynamo
def _per_segment(q, k, v, cu_seqlens, window):
    b, h, s, d = q.shape
    gqa = k.shape[1] != h
    bounds = list(range(0, b * s + 1, s)) if is_fake(cu_seqlens) else cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    # One split per tensor into documents [L, heads, d] (a view when the rows are laid out [b, s, heads, d], as the
    # projections leave them): its backward writes every document's gradient into one tensor, where slicing the
    # batch per document would build a batch-sized gradient per document.
    docs = [t.transpose(1, 2).reshape(b * s, t.shape[1], d).split(lengths) for t in (q, k, v)]
    band = None
    pieces = []
    for q_doc, k_doc, v_doc in zip(*docs):
        q_doc, k_doc, v_doc = (t.transpose(0, 1)[None] for t in (q_doc, k_doc, v_doc))  # [1, heads, L, d]
        n = q_doc.shape[2]
        head = n if window is None else min(n, window)  # the first `window` queries: plain causal
        pieces.append(F.scaled_dot_product_attention(q_doc[:, :, :head], k_doc[:, :, :head], v_doc[:, :, :head],
                                                     is_causal=True, enable_gqa=gqa))
        for c in range(head, n, window or 1):  # later queries of a long document: chunks of `window`
            if band is None:
                band = _band_mask(window, q)
            ce, k0 = min(c + window, n), c - window + 1
            pieces.append(F.scaled_dot_product_attention(q_doc[:, :, c:ce], k_doc[:, :, k0:ce], v_doc[:, :, k0:ce],
                                                         attn_mask=band[:ce - c, :ce - k0], enable_gqa=gqa))
    out = torch.cat([p.transpose(1, 2) for p in pieces], dim=1)  # [1, b * s, h, d]
    return out.view(b, s, h * d)
