"""Causal attention over segments of a row (packed documents, sliding windows) without an ``s x s`` mask.

A packed row holds several documents; a token attends only to earlier tokens of its own document (and, with a
sliding window of ``W``, only to the last ``W`` of them, itself included). The dense way to say this is a boolean
``[b, 1, s, s]`` mask: s² bytes per row (1 GiB at 32K tokens), and it keeps SDPA off its flash kernels. Here the
layout is :class:`Segments` instead (the segments' starts and a bound on their lengths), which the model builds once
per forward and every block receives as an argument (a tensor and an int: checkpointing, ``compile`` and FSDP wrap
blocks unchanged).

Kernels, chosen per call by :func:`segment_kernel`:

- ``varlen_flash`` (CUDA, bf16/fp16, a torch with ``torch.nn.attention.varlen``): one flash call over every
  document of the batch; sliding windows are the kernel's ``window_size``. Its maximum lengths are ``longest``,
  by which the flash kernels size a grid of about ``ceil(longest / 128)`` blocks for every document: the collator's
  longest document (:func:`longest_document`, counted on the host) rounded up by :func:`segment_bound`, else the
  row length (reading the boundaries on the device would cost a synchronisation). torch 2.10's ``is_causal``
  argument (no window, no GQA) is detected.
- ``sdpa_per_segment`` (any device; the CPU's): exact causal SDPA per document, queries ``[1, h, L, d]`` against
  their own keys, so memory is O(s) (the outputs and log-sum-exps) and compute is the sum of L². A document longer
  than the window runs its first ``W`` queries causally, then chunks of ``W`` queries against the ``2W - 1`` keys
  they can see, under one band mask shared by every chunk (O(W²) once, not per chunk). Rows that are whole
  segments (a sliding window without packing) run together, one call per chunk for the batch. Reading the
  boundaries is data-dependent Python, so it is kept out of ``torch.compile`` graphs (a graph break per block).

Fake tensors (``mtune plan`` runs the model under ``FakeTensorMode``) have no values to split on: there
:func:`document_boundaries` gives one segment per row and the same kernel runs on those, which allocates what any
split of the rows does (per-segment outputs and log-sum-exps that add up to one row's, the same concatenations in
forward and backward, the one shared band mask), so plans stay true; only the FLOPs differ.

The dense mask stays as a fallback: ``TransformerDecoder.attention_kernel = "dense_mask"``.

Attention sinks (gpt-oss: a learned logit per query head that joins every softmax's denominator and adds no value)
ride on the same kernels as one more key: :func:`sink_inputs` widens queries and keys by a few features so that a
key of zeros but one feature scores each head's sink exactly, its value zero; each segment (or row) sees that key
first. A causal call then holds one key more than queries, so a query row of zeros is put first too (it sees only
the sink key and its output is dropped): the square causal fast path stays. ``varlen_flash`` has no sink argument,
so layers with sinks run ``sdpa_per_segment``.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

__all__ = ["DENSE_MASK_UP_TO", "Segments", "segments_apply", "batch_segments", "document_boundaries",
           "longest_document", "segment_bound", "segment_attention", "segment_kernel", "kernel_for", "varlen_available",
           "sink_inputs", "sink_attention"]

_HALF = (torch.float16, torch.bfloat16)

DENSE_MASK_UP_TO = 256
"""How a packed or sliding-window batch tells attention what each token may see: ``segments`` (boundaries
:class:`Segments`, O(s) memory: this module), ``dense_mask`` (a boolean ``[b, 1, s, s]`` mask, s² bytes per row: the
fallback), or ``auto``: the dense mask for rows of at most :data:`DENSE_MASK_UP_TO` tokens (at most 64 KiB a row, and
one SDPA call instead of one per document: 16 rows of 64 tokens step 16% faster on CPU), segments beyond
(:func:`segments_apply`)."""


def segments_apply(attention_kernel: str, seq_len: int) -> bool:
    """Whether rows of ``seq_len`` tokens run by segments, not the dense mask, under ``attention_kernel``."""
    return attention_kernel == "segments" or (attention_kernel == "auto" and seq_len > DENSE_MASK_UP_TO)


SMALLEST_SEGMENT_BOUND = 128
"""The least :func:`segment_bound`: the flash kernels' block of rows (128 for the head sizes of mtune's models),
below which a smaller bound would start no fewer blocks, only more compiled values."""


class Segments(NamedTuple):
    """The segments of a batch ``[b, s]`` that attention runs within: ``starts`` (int32 ``[n + 1]``, each segment's
    first token in the flattened ``b * s`` tokens, then ``b * s``) and ``longest`` (an int at least every segment's
    length: the varlen kernel's maximum lengths; the row length when nothing tighter is known)."""

    starts: torch.Tensor
    longest: int


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


def segment_kernel(q: torch.Tensor, window: int | None = None, sinks: bool = False) -> str:
    """The kernel :func:`segment_attention` runs for queries like ``q`` (see the module docstring)."""
    return kernel_for(q.device, q.dtype, window, sinks)


def kernel_for(device: torch.device | str, dtype: torch.dtype, window: int | None = None, sinks: bool = False) -> str:
    """The kernel :func:`segment_attention` runs for queries of ``dtype`` on ``device``: ``varlen_flash`` or
    ``sdpa_per_segment`` (always, for layers with attention ``sinks``)."""
    if sinks or torch.device(device).type != "cuda" or dtype not in _HALF:
        return "sdpa_per_segment"
    api = _varlen_api()
    if api is not None and (window is None or "window_size" in api[1]):
        return "varlen_flash"
    return "sdpa_per_segment"


def document_boundaries(document_ids: torch.Tensor | None, batch: int, seq_len: int,
                        device: torch.device | None = None) -> torch.Tensor:
    """Segment starts (int32 ``[n + 1]``): where each document starts in the flattened ``batch * seq_len`` tokens,
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


def batch_segments(document_ids: torch.Tensor | None, batch: int, seq_len: int, device: torch.device | None = None,
                   longest: int | None = None) -> Segments:
    """The :class:`Segments` of a batch: :func:`document_boundaries`, bounded by the batch's ``longest`` document
    (:func:`segment_bound`; the row length without ``document_ids``, for fake ones, or without ``longest``)."""
    whole_rows = document_ids is None or is_fake(document_ids)
    return Segments(document_boundaries(document_ids, batch, seq_len, device),
                    seq_len if whole_rows else segment_bound(longest, seq_len))


def longest_document(document_ids: torch.Tensor) -> int:
    """The longest run of equal ids in any row of ``document_ids`` ``[b, s]`` (the longest segment
    :func:`document_boundaries` makes of them). Reads the values: for host tensors (the collator's)."""
    b, s = document_ids.shape
    return int(document_boundaries(document_ids, b, s).diff().max())


def segment_bound(longest: int | None, seq_len: int) -> int:
    """The ``longest`` a batch's :class:`Segments` carry: ``longest`` rounded up to a power of two (so compiled
    blocks see few values), at least :data:`SMALLEST_SEGMENT_BOUND`, at most ``seq_len`` (also the answer for None)."""
    if longest is None:
        return seq_len
    return min(seq_len, max(SMALLEST_SEGMENT_BOUND, 1 << (max(longest, 1) - 1).bit_length()))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments,
                      window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each of the ``segments``: ``q`` ``[b, hq, s, d]``, ``k, v`` ``[b, hkv, s, d]``
    (grouped-query when ``hkv < hq``) -> ``[b, s, hq * d]``, ready for the output projection. ``window``: each
    token attends to at most this many tokens of its segment, itself included. ``sinks`` ``[hq]``: each head's
    sink logit, in every segment's softmax."""
    kernel = segment_kernel(q, window, sinks is not None)
    b, h, s, d = q.shape
    if kernel == "varlen_flash":
        # reshape: the kernel's output keeps its flat queries' strides, a strided view of q when b is 1
        return _varlen(q, k, v, segments, window).reshape(b, s, h * d)
    if sinks is None:
        return _per_segment(q, k, v, segments, window)
    return _per_segment(*sink_inputs(q, k, v, sinks), segments, window, sink_at=d)


def sink_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``[b, hq, s, d]``, keys and values ``[b, hkv, s, d]`` widened to ``d + p`` features (``p`` in 1..8,
    keeping the width a multiple of 8 and the three alike, as the flash kernels want; else SDPA falls back to the
    math kernel and its ``s x s`` scores): a query's feature ``d`` holds its head's sink times ``sqrt(d)``, keys' and
    values' extra features are zeros. The sink key (:func:`_sink_key`: feature ``d`` one, the rest zero) then scores
    ``sinks[h]`` under the scale ``d ** -0.5`` and every real key what it scored before; outputs' first ``d``
    features are the attention's."""
    b, h, s, d = q.shape
    pad = 8 - d % 8
    sink = (sinks.to(q.dtype) * d**0.5).view(1, h, 1, 1).expand(b, h, s, 1)
    q = torch.cat([q, sink, q.new_zeros(b, h, s, pad - 1)], dim=-1)
    return q, F.pad(k, (0, pad)), F.pad(v, (0, pad))


def _sink_key(k: torch.Tensor, v: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink's key ``[b, hkv, 1, d + p]`` (feature ``d`` one) and value (zeros) for widened keys ``k`` and values
    ``v``."""
    key = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[-1])
    key[..., d] = 1
    return key, v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[-1])


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with a sink logit per head through SDPA: ``q`` ``[b, hq, s, d]``, ``k, v`` ``[b, hkv, kv_len, d]``,
    ``sinks`` ``[hq]``, ``mask`` boolean ``[b, 1, s, kv_len]`` (None: causal, ``kv_len == s``) -> ``[b, hq, s, d]``.
    Equal to ``softmax([q k^T / sqrt(d), sink])`` without the sink's column, times ``v``."""
    d = q.shape[-1]
    gqa = k.shape[1] != q.shape[1]
    q, k, v = sink_inputs(q, k, v, sinks)
    key, value = _sink_key(k, v, d)
    k, v = torch.cat([key, k], dim=2), torch.cat([value, v], dim=2)
    if mask is None:  # a query of zeros first: the sink key first in a square causal call
        q = torch.cat([q.new_zeros(q.shape[0], q.shape[1], 1, q.shape[-1]), q], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=gqa)
        return out[:, :, 1:, :d]
    mask = torch.cat([mask.new_ones(*mask.shape[:-1], 1), mask], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=gqa)[..., :d]


def _varlen(q, k, v, segments, window):
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
    starts, longest = segments
    return varlen_attn(*flat, starts, starts, longest, longest, **kwargs)


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
def _per_segment(q, k, v, segments, window, sink_at=None):
    """``sink_at``: ``q``, ``k`` come widened by :func:`sink_inputs` from heads of ``sink_at`` features (the
    scores' scale), and each document's keys start with the sink key."""
    b, h, s, d = q.shape
    sink = sink_at is not None
    scale = sink_at**-0.5 if sink else None
    gqa = k.shape[1] != h
    starts, longest = segments
    bounds = list(range(0, b * s + 1, s)) if is_fake(starts) else starts.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if max(lengths) > longest:  # the varlen kernel would drop the rest of such a segment: refused here as well
        raise ValueError(f"a segment of {max(lengths)} tokens, above its Segments' longest={longest}")
    # One split per tensor into documents [L, heads, d] (a view when the rows are laid out [b, s, heads, d], as the
    # projections leave them): its backward writes every document's gradient into one tensor, where slicing the
    # batch per document would build a batch-sized gradient per document.
    # Rows that are whole segments (no packing: a sliding window alone) run as one batch of rows, each chunk one
    # call for all of them, instead of row by row.
    rows = all(n == s for n in lengths)
    if rows:
        docs = [[t] for t in (q, k, v)]  # [b, heads, s, d]
    else:
        docs = [t.transpose(1, 2).reshape(b * s, t.shape[1], t.shape[-1]).split(lengths) for t in (q, k, v)]
    band = None
    pieces = []
    if sink:
        n = b if rows else 1
        sink_k, sink_v = (t.expand(n, -1, -1, -1) for t in _sink_key(k[:1], v[:1], sink_at))  # [n, hkv, 1, *]
        no_query = q.new_zeros(n, h, 1, d)
    for q_doc, k_doc, v_doc in zip(*docs):
        if not rows:
            q_doc, k_doc, v_doc = (t.transpose(0, 1)[None] for t in (q_doc, k_doc, v_doc))  # [1, heads, L, d]
        n = q_doc.shape[2]
        head = n if window is None else min(n, window)  # the first `window` queries: plain causal
        if sink:  # the sink key first, and a query of zeros before the queries (its output dropped)
            out = F.scaled_dot_product_attention(
                torch.cat([no_query, q_doc[:, :, :head]], 2), torch.cat([sink_k, k_doc[:, :, :head]], 2),
                torch.cat([sink_v, v_doc[:, :, :head]], 2), is_causal=True, scale=scale, enable_gqa=gqa)[:, :, 1:]
        else:
            out = F.scaled_dot_product_attention(q_doc[:, :, :head], k_doc[:, :, :head], v_doc[:, :, :head],
                                                 is_causal=True, scale=scale, enable_gqa=gqa)
        pieces.append(out)
        for c in range(head, n, window or 1):  # later queries of a long document: chunks of `window`
            if band is None:
                band = _band_mask(window, q)
                if sink:  # the sink key, seen by every query, before each chunk's keys
                    band = torch.cat([band.new_zeros(window, 1), band], dim=1)
            ce, k0 = min(c + window, n), c - window + 1
            keys, values, cols = k_doc[:, :, k0:ce], v_doc[:, :, k0:ce], ce - k0
            if sink:
                keys, values, cols = torch.cat([sink_k, keys], 2), torch.cat([sink_v, values], 2), cols + 1
            pieces.append(F.scaled_dot_product_attention(q_doc[:, :, c:ce], keys, values,
                                                         attn_mask=band[:ce - c, :cols], scale=scale, enable_gqa=gqa))
    out = torch.cat([p.transpose(1, 2) for p in pieces], dim=1)  # [1, b * s, h, d] (rows: [b, s, h, d])
    return out.view(b, s, h * d) if not sink else out[..., :sink_at].reshape(b, s, h * sink_at)
