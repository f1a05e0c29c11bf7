"""Gated DeltaNet: linear attention with a decaying, delta-rule-updated state (Qwen3.5's three of every four layers).

Each value head keeps a state ``S`` ``[k_head_dim, v_head_dim]``. At token ``t``, with ``q_t, k_t`` L2-normalised
(``q_t`` also scaled by ``k_head_dim ** -0.5``), a decay ``g_t <= 0`` (log space) and a write strength
``beta_t`` in (0, 1)::

    S <- exp(g_t) * S                          # forget
    delta_t = beta_t * (v_t - S^T k_t)         # what the state mispredicts for k_t
    S <- S + k_t delta_t^T                     # write the correction
    o_t = S^T q_t

:func:`chunked_gated_delta_rule` computes the same outputs chunk by chunk: inside a chunk the writes are solved
together (a unit lower-triangular system) and read with masked matmuls, and only the state crosses chunk borders, so
time is O(s) matmuls of the chunk size and memory is O(s) (one state per chunk kept for backward).

Packed rows: each document starts from a zero state and its short convolution sees none of the previous document's
tokens; documents enter as masks over the whole row (no loop over documents, and the same tensors whatever the
boundaries, so ``mtune plan``'s fake tensors plan them exactly).

On CUDA, when flash-linear-attention is installed (``pip install flash-linear-attention``: Triton kernels, pure
Python), the recurrence runs its ``chunk_gated_delta_rule`` instead (packed documents as ``cu_seqlens``, value
heads grouped over query/key heads in the kernel); the convolution stays PyTorch's. ``mtune plan`` (fake tensors,
where the kernel cannot run) plans what the kernel allocates through a stand-in where the run will use it
(:func:`planning_recurrence`), else the PyTorch form, which keeps more for backward; generation
(:mod:`~mtune.modules.deltanet_state`) runs the PyTorch forms on every device. The kernel is probed once before it
is used (:mod:`~mtune.modules.gated_deltanet_fla`).
"""

import contextlib

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch import nn

from mtune.modules.deltanet_state import STEPPED_UP_TO, DeltaNetState, gated_delta_steps
from mtune.modules.gated_delta_scan import gated_delta_scan
from mtune.modules.gated_deltanet_fla import PLAN_ENV, fla_gated_delta_rule, fla_kernel, planned_recurrence
from mtune.modules.gated_deltanet_fla_plan import fla_stand_in
from mtune.modules.packed_attention import Segments
from mtune.modules.rms_norm import RMSNorm

_planned_rule = None  # the recurrence of fake tensors while planning_recurrence plans fla's kernel

CHUNK_SIZE = 64
"""Tokens solved together; 64 as the reference kernels use (any size gives the same outputs up to round-off)."""


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dimension (the reference's epsilon placement)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                             documents: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
                             state: torch.Tensor | None = None) -> torch.Tensor:
    """Outputs of the gated delta rule from a zero state (or ``state``), in fp32.

    Args:
        q, k: ``[b, heads, s, k_head_dim]``, already normalised and (``q``) scaled.
        v: ``[b, heads, s, v_head_dim]``.
        g: ``[b, heads, s]``, log decays (<= 0).
        beta: ``[b, heads, s]``, write strengths.
        documents: int ``[b, s]``, each token's document (packed rows: one run of equal ids per document); each
            document starts from a zero state. None: each row is one document.
        state: ``[b, heads, k_head_dim, v_head_dim]`` fp32, the state the row's first document continues (generation:
            what earlier calls left), overwritten with the state leaving the row (its last document's); None: zeros.

    Returns:
        ``[b, heads, s, v_head_dim]`` fp32.

    Within a chunk, with ``G_i`` the cumulative log decay up to token ``i`` and ``S0`` the state entering it, the
    state just before token ``i`` writes is ``exp(G_i) S0 + sum_{j<i} exp(G_i - G_j) k_j delta_j^T``, so the writes
    solve ``(I + A) delta = beta * (v - exp(G) k S0)`` with ``A_ij = beta_i exp(G_i - G_j) k_i.k_j`` for ``j < i``;
    the solution splits into a part independent of ``S0`` (``U``) and one linear in it (``W S0``), both computed for
    every chunk at once before the scan over chunks. Documents enter as masks: pairs of tokens from different
    documents do not interact, only tokens of a document begun before the chunk read ``S0``, and the state leaving
    the chunk holds only its last document's writes. So packed rows cost what plain rows of the same length cost.
    """
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    chunk_size = min(chunk_size, s)
    pad = -s % chunk_size
    if documents is None:
        documents = torch.zeros(b, s, dtype=torch.long, device=q.device)
    if pad:  # padded tokens continue the last document with no decay (g=0) and no write (beta=0): state unchanged
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        documents = torch.cat([documents, documents[:, -1:].expand(b, pad)], dim=1)
    n = (s + pad) // chunk_size
    q, k, v = (t.reshape(b, h, n, chunk_size, -1) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk_size), beta.reshape(b, h, n, chunk_size)
    doc = documents.reshape(b, 1, n, chunk_size)
    # whether each token's document began before its chunk (so it reads the entering state)
    previous = F.pad(documents, (1, 0), value=-2)[:, :-1]
    if state is not None:
        previous[:, 0] = documents[:, 0]  # the row's first document continues the entering state
    previous = previous.reshape(b, 1, n, chunk_size)[..., :1]
    carries = (doc == previous).float()
    last = doc[..., -1:]

    decay = g.cumsum(-1)  # G_i within each chunk
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    linked = causal & (doc[..., :, None] == doc[..., None, :])  # j <= i, same document
    # exp(G_i - G_j) for linked pairs, zero elsewhere (masked before exp so it never overflows)
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~linked, float("-inf")).exp()
    k_beta = k * beta[..., None]
    strictly_lower = (k_beta @ k.transpose(-1, -2)) * pair_decay.tril(-1)
    system = strictly_lower + torch.eye(chunk_size, device=q.device)
    entering = decay.exp() * carries  # exp(G_i) for tokens that read the entering state, else 0
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * entering[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair_decay  # intra-chunk reads, j <= i
    q_decayed = q * entering[..., None]  # reads of the entering state
    # each write decayed to the chunk's end, if it is in the chunk's last document
    k_to_end = k * ((decay[..., -1:] - decay).exp() * (doc == last))[..., None]
    chunk_decay = (decay[..., -1:].exp() * carries[..., -1:])[..., None]

    # the scan over chunks, on [b * h, ...] views: the one sequential part (its own backward: gated_delta_scan.py)
    rows = [t.flatten(0, 1) for t in (u, w, q_decayed, scores, k_to_end.transpose(-1, -2),
                                      chunk_decay.expand(b, h, n, 1, 1))]
    out, leaving = gated_delta_scan(*rows, None if state is None else state.reshape(b * h, dk, dv))
    if state is not None:
        state.copy_(leaving.view(b, h, dk, dv))
    return out.view(b, h, n * chunk_size, dv)[:, :, :s]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` ``[b, channels, s]`` by ``weight`` ``[channels, 1, taps]``; with
    ``documents`` (``[b, s]``) a token sees only earlier tokens of its own document."""
    taps, s = weight.shape[-1], x.shape[-1]
    if documents is None:
        return F.conv1d(x, weight, padding=taps - 1, groups=x.shape[1])[..., :s]
    padded = F.pad(x, (taps - 1, 0))
    padded_docs = F.pad(documents, (taps - 1, 0), value=-1)
    out = 0
    for j in range(taps):  # tap j reads the token taps - 1 - j places back
        same = (padded_docs[:, j:j + s] == documents)[:, None]
        out = out + padded[..., j:j + s] * same * weight[:, :, j]
    return out


class GatedRMSNorm(RMSNorm):
    """``rmsnorm(x) * weight * silu(gate)`` per value head, in fp32, cast back to ``x``'s dtype (the weight is
    applied in the input's dtype, as the reference does). ``weight`` starts at one."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of Qwen3.5's linear-attention layers, with Hugging Face's module names.

    ``in_proj_qkv`` makes queries, keys (``n_k_heads`` each) and values (``n_v_heads``), which a depthwise causal
    convolution of ``conv_kernel`` taps (``conv1d``, SiLU) mixes over the last few tokens; ``in_proj_a`` and
    ``dt_bias``/``A_log`` give each value head its decay ``g = -exp(A_log) * softplus(a + dt_bias)``, ``in_proj_b``
    its write strength ``beta = sigmoid(b)``; value heads share query/key heads in groups (like grouped-query
    attention); the output is normed per head, gated by ``silu(in_proj_z(x))`` and projected by ``out_proj``.

    Under QLoRA the decay and write-strength projections (``in_proj_a``, ``in_proj_b``: ``n_v_heads`` rows, ~0.1% of
    the layer's weights) stay in the model's dtype (:attr:`kept_in_model_dtype`): their outputs go through ``exp``
    and ``softplus`` into every later token's state, where a quantization error compounds.

    Called like an attention module (``(x, cos, sin, mask, cache_pos, segments)``): it uses no rotary tables or
    mask, only ``segments`` (packed documents). Generating, it keeps a :class:`~mtune.modules.deltanet_state
    .DeltaNetState` instead of a KV cache (:meth:`setup_state`), and each call continues the sequence it holds.
    """

    kept_in_model_dtype = ("in_proj_a", "in_proj_b")

    def __init__(self, dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int = 4, norm_eps: float = 1e-6) -> None:
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"linear_num_value_heads ({n_v_heads}) must be a multiple of linear_num_key_heads "
                             f"({n_k_heads})")
        self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim = n_k_heads, n_v_heads, k_head_dim, v_head_dim
        key_width, value_width = n_k_heads * k_head_dim, n_v_heads * v_head_dim
        self.conv_width = 2 * key_width + value_width
        self.in_proj_qkv = nn.Linear(dim, self.conv_width, bias=False)
        self.in_proj_z = nn.Linear(dim, value_width, bias=False)
        self.in_proj_b = nn.Linear(dim, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_width, self.conv_width, conv_kernel, groups=self.conv_width, bias=False,
                                padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.zeros(n_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, norm_eps)
        self.out_proj = nn.Linear(value_width, dim, bias=False)
        self.decoding_state: DeltaNetState | None = None  # generation's carried state (setup_state); None: training

    def setup_state(self, batch_size: int, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        """Start a zero decoding state of ``batch_size`` rows (convolution inputs in ``dtype``)."""
        self.decoding_state = DeltaNetState(batch_size, self.conv_width, self.conv1d.kernel_size[0], self.n_v_heads,
                                            self.k_head_dim, self.v_head_dim, dtype, device)

    def initializers(self, std: float) -> list[tuple[str, object]]:
        """How :meth:`TransformerDecoder.init_weights` fills the parameters that are not linears or norms: the
        convolution like a linear, ``dt_bias`` ones and ``A_log`` the log of decay rates uniform in [1, 16] (the
        reference's range, lower bound raised away from zero)."""
        return [("conv1d.weight", lambda t: nn.init.normal_(t, std=std)), ("dt_bias", nn.init.ones_),
                ("A_log", lambda t: t.copy_(torch.empty_like(t).uniform_(1, 16).log()))]

    def forward(self, x: torch.Tensor, cos=None, sin=None, mask=None, cache_pos=None,
                segments: Segments | None = None) -> torch.Tensor:
        """``x`` ``[b, s, dim]`` -> ``[b, s, dim]``; ``segments``: document starts (``starts``) in the flattened
        ``b * s`` tokens (each document then starts from a zero state). With a decoding state, ``x`` continues the
        rows it holds (``cache_pos`` is not read)."""
        if segments is not None and self.decoding_state is not None:
            raise ValueError("packed documents (segments) cannot be combined with a Gated DeltaNet decoding state")
        b, s, _ = x.shape
        documents = None
        if segments is not None:  # each flattened token's segment, by the segments' ends
            flat = torch.arange(b * s, device=x.device)
            documents = torch.bucketize(flat, segments.starts[1:].to(flat.dtype), right=True).view(b, s)
        mixed = self._mix(x, documents, None if segments is None else segments.starts)
        z = self.in_proj_z(x).view(b, s, self.n_v_heads, self.v_head_dim)
        out = self.norm(mixed.reshape(b, s, self.n_v_heads, self.v_head_dim), z)
        return self.out_proj(out.reshape(b, s, -1))

    def _mix(self, x: torch.Tensor, documents: torch.Tensor | None,
             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution and the recurrence, each document from a zero state (or the decoding state, updated):
        ``[b, s, dim]`` -> ``[b, s, n_v_heads, v_head_dim]`` in ``x``'s dtype."""
        b, s, _ = x.shape
        state = self.decoding_state
        qkv = (causal_conv(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight, documents) if state is None else
               state.convolve(self.in_proj_qkv(x).transpose(1, 2), self.conv1d.weight))
        qkv = F.silu(qkv).transpose(1, 2)
        key_width = self.n_k_heads * self.k_head_dim
        q, k, v = qkv.split([key_width, key_width, self.n_v_heads * self.v_head_dim], dim=-1)
        q, k = (t.reshape(b, s, self.n_k_heads, self.k_head_dim) for t in (q, k))
        v = v.reshape(b, s, self.n_v_heads, self.v_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        kernel = recurrence_kernel(x) if state is None else None  # decoding runs the PyTorch forms (deltanet_state.py)
        if kernel is not None:
            return fla_gated_delta_rule(kernel, q, k, v, g, beta, cu_seqlens).to(x.dtype)
        group = self.n_v_heads // self.n_k_heads
        q, k = (t.repeat_interleave(group, dim=2) for t in (q, k))
        q = l2_normalize(q.float()) * self.k_head_dim**-0.5
        k = l2_normalize(k.float())
        q, k, v, g, beta = (t.transpose(1, 2) for t in (q, k, v, g, beta))
        if state is None:
            out = chunked_gated_delta_rule(q, k, v, g, beta, documents)
        else:  # a few tokens step the rule; a prompt runs the chunks, both from the carried state and updating it
            rule = gated_delta_steps if s <= STEPPED_UP_TO else chunked_gated_delta_rule
            out = rule(q, k, v, g, beta, state=state.recurrent)
        return out.transpose(1, 2).to(x.dtype)


def recurrence_notes(model: torch.nn.Module, target: torch.device | str) -> list[str]:
    """The plan's note on which recurrence it counted, for a CUDA target's model with Gated DeltaNet layers (else
    none: on other devices only the PyTorch form runs)."""
    if torch.device(target).type != "cuda" or not any(isinstance(m, GatedDeltaNet) for m in model.modules()):
        return []
    if planned_recurrence(target) == "fla":
        return ["Gated DeltaNet: planned flash-linear-attention's chunk_gated_delta_rule (fla-core 0.6's Triton path)"]
    return [f"Gated DeltaNet: planned the PyTorch chunked form ({PLAN_ENV}=fla plans fla's kernel)"]


def recurrence_kernel(x: torch.Tensor):
    """What runs the recurrence of a training forward on ``x``: flash-linear-attention's kernel for a real CUDA
    tensor where it imports and trains (:func:`~mtune.modules.gated_deltanet_fla.fla_kernel`); for a fake tensor the
    stand-in inside :func:`planning_recurrence` when the run will use the kernel; None: the PyTorch form."""
    return _planned_rule if is_fake(x) else fla_kernel(x)


@contextlib.contextmanager
def planning_recurrence(target: torch.device | str):
    """While the block runs, fake tensors' Gated DeltaNet recurrence allocates as it will on ``target``
    (:func:`planned_recurrence`)."""
    global _planned_rule
    outer, _planned_rule = _planned_rule, fla_stand_in() if planned_recurrence(target) == "fla" else None
    try:
        yield
    finally:
        _planned_rule = outer
