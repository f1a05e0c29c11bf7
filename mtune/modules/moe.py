"""Mixture of experts: a router picks ``top_k`` of ``n_experts`` gated MLPs per token, and the token's output is the
routing-weighted sum of theirs (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``; the shared expert of Qwen2/3.5-MoE and the
biased experts of gpt-oss are arguments).

The interface other families build on:

* :class:`MoE` ``(x [b, s, dim]) -> [b, s, dim]`` is the block's ``mlp``; its ``gate`` (:class:`Router`; gpt-oss
  names it ``router``: :attr:`MoE.router_layer` either way) returns
  ``(logits, weights, experts)``, its ``experts`` (:class:`Experts`) take the routed rows sorted by expert with the
  row count of each; with ``aux_loss_coef > 0`` it keeps ``router_logits`` for :func:`router_aux_loss`.
* :class:`Experts` holds three :class:`~mtune.modules.expert_linear.ExpertLinear` projections, ``gate_proj``,
  ``up_proj`` and ``down_proj``, each one ``[n_experts, out, in]`` parameter (``weight``; ``bias [n_experts, out]``
  when biased). Module names are the checkpoints' with the expert index moved out: the hub's
  ``mlp.experts.{e}.gate_proj.weight`` is row ``e`` of ``mlp.experts.gate_proj.weight`` (loading stacks, saving
  splits: :func:`~mtune.modules.expert_layout.stacked_key`). LoRA targets them by the same names as a dense MLP's
  (per-expert adapters, ``LoRAExpertLinear``); QLoRA stores them as NF4; FSDP2 shards them by expert with the block.

Separate gate and up projections rather than transformers 5's fused ``gate_up_proj [n_experts, 2 * hidden, dim]``:
the checkpoints on the hub (and those transformers 5 saves) hold them separately, ``lora.modules`` names them
separately, and each stays the tensor NF4 quantizes on its own; a fused layout would save one grouped matmul call.

A forward sorts the ``tokens * top_k`` (token, expert) pairs by expert, runs each expert on its contiguous rows and
scatters the weighted rows back. The experts run one of two ways (:attr:`MoE.expert_compute`), equal to round-off:

* ``grouped`` (:mod:`mtune.modules.grouped_experts`): one ``torch._grouped_mm`` call per projection over the 3-D
  weights, read in place; biases (gpt-oss) added by each row's expert; per-expert LoRA factors by two more calls.
  Used by ``auto`` where it pays and is supported: frozen base weights (a full fine-tune's trainable experts go
  through the loop, as do adapters with dropout), bf16 (the only dtype ``_grouped_mm``'s fake kernel accepts, so
  ``mtune plan`` and ``compile`` trace it) and 16-byte aligned rows, widths and ranks. NF4
  bases (QLoRA) are dequantized a projection at a time: whole where the compiled kernel does it (CUDA), else an
  eighth of the experts per call (:data:`~mtune.modules.expert_linear.DEQUANTIZE_PARTS`; planned as such): per
  expert, it cost ``n_experts`` small calls per projection, which on an H100 left Qwen3-30B-A3B QLoRA without a
  finished step within minutes.
* ``loop``: each expert's slice of the weights on its rows (those that got none too, for their zero gradients).

On fake tensors (``mtune plan``) the loop cannot read how many rows each expert got; it assumes **balanced
routing**: each expert gets ``tokens * top_k / n_experts`` rows (the remainder spread one each); frozen experts, alike
and keeping no per-expert state, are planned as one expert on all the rows (the same bytes, one call instead of
``n_experts``). The routed activations (``tokens * top_k`` rows) are the same whatever the split, so the planned
activation bytes hold; the worst case is one expert's temporaries for all ``tokens * top_k`` rows at once (an expert
every token picks), which the plan does not show.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from mtune.modules.expert_linear import ExpertLinear, LoRAExpertLinear
from mtune.modules.grouped_experts import adapted, grouped_experts

__all__ = ["EXPERT_COMPUTE", "Experts", "MoE", "Router", "balanced_counts", "dispatch", "load_balancing_loss",
           "router_aux_loss", "use_grouped"]

EXPERT_COMPUTE = ("auto", "grouped", "loop")


class Router(nn.Linear):
    """The router (``mlp.gate``): ``softmax(x W^T)`` in fp32, the ``top_k`` largest probabilities per token,
    renormalised to sum to 1 when ``norm_topk_prob`` (which is also gpt-oss's softmax over the top-k logits).

    An ``nn.Linear`` subclass, so it is initialised and counted like one, but never a LoRA target or an NF4 base
    (those transforms take plain ``nn.Linear`` only): routing stays in the model's dtype.
    """

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool = False, bias: bool = False):
        super().__init__(dim, n_experts, bias=bias)
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [n, dim]`` -> ``(logits [n, n_experts], weights [n, top_k], experts [n, top_k])``: logits and
        weights in ``x``'s dtype, experts as int64 indices, the most probable first."""
        logits = super().forward(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), experts


def balanced_counts(rows: int, n_experts: int) -> list[int]:
    """Rows per expert under balanced routing: ``rows // n_experts`` each, the first ``rows % n_experts`` one more."""
    base, extra = divmod(rows, n_experts)
    return [base + (e < extra) for e in range(n_experts)]


class Experts(nn.Module):
    """``n_experts`` gated MLPs as three :class:`~mtune.modules.expert_linear.ExpertLinear` projections
    (``gate_proj``, ``up_proj`` ``[n_experts, hidden_dim, dim]``, ``down_proj`` ``[n_experts, dim, hidden_dim]``),
    run on rows sorted by expert.

    Args:
        dim, hidden_dim: each expert's width and intermediate width (``moe_intermediate_size``).
        activation: the gate's activation (SiLU: SwiGLU).
        bias: the projections carry biases (gpt-oss).

    How a family's checkpoints lay these out (one key per expert, or gate and up side by side as transformers 5's
    modules hold them) is the family's ``DecoderArgs.expert_checkpoint_layout`` (:mod:`mtune.modules.expert_layout`).
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, activation: Callable = F.silu, bias: bool = False):
        super().__init__()
        self.n_experts, self.activation = n_experts, activation
        self.gate_proj = ExpertLinear(n_experts, dim, hidden_dim, bias)
        self.up_proj = ExpertLinear(n_experts, dim, hidden_dim, bias)
        self.down_proj = ExpertLinear(n_experts, hidden_dim, dim, bias)

    def projections(self) -> list[ExpertLinear]:
        return [self.gate_proj, self.up_proj, self.down_proj]

    def can_group(self, x: torch.Tensor) -> bool:
        """Whether ``grouped`` computes these experts: frozen (or no gradient wanted) base weights and biases, plain
        or NF4, LoRA factors without dropout, and rows, weights and ranks 16-byte aligned."""
        projections = self.projections()
        with_dropout = any(adapted(p) and not isinstance(p.dropout, nn.Identity) for p in projections)
        if not hasattr(torch, "_grouped_mm") or with_dropout or any(
                type(p) not in (ExpertLinear, LoRAExpertLinear) for p in projections):
            return False
        tensors = [t for p in projections for t in (p.weight, p.bias) if t is not None]
        trainable = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        widths = {w for p in projections for w in (p.in_features, p.out_features, *([p.rank] if adapted(p) else []))}
        return not trainable and all(w * x.element_size() % 16 == 0 for w in widths)

    def hidden(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The intermediate rows from the first projections' outputs (all but ``down_proj``, in
        :meth:`projections`' order): ``act(gate) * up``."""
        return self.activation(gate) * up

    def forward(self, x: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
        """``x [rows, dim]`` sorted by expert, ``counts [n_experts]`` int64 rows each -> ``[rows, dim]``."""
        if grouped:
            offsets = torch.cumsum(counts, 0, dtype=torch.int32)
            return grouped_experts(x, offsets, self)
        projections = self.projections()
        frozen = not any(p.requires_grad for p in self.parameters())
        if is_fake(counts) and frozen:
            # planning frozen experts: one expert on every row makes the same tensors, by bytes, as each on its share
            # (all alike, none keeping per-expert state), in one call instead of n_experts
            pieces = [p.piece(0) for p in projections]
            return self._expert(x, projections, pieces)
        sizes = balanced_counts(x.shape[0], self.n_experts) if is_fake(counts) else counts.tolist()
        per_expert = zip(*(p.pieces() for p in projections))
        # every expert runs, with no rows too: its parameters then get zero gradients, so FSDP2's ranks, which route
        # differently, reduce the same set of gradients
        return torch.cat([self._expert(rows, projections, pieces)
                          for rows, pieces in zip(torch.split(x, sizes), per_expert)])

    def _expert(self, x: torch.Tensor, projections: list[ExpertLinear], pieces) -> torch.Tensor:
        *firsts, down = projections
        return down.run(self.hidden(*(p.run(x, piece) for p, piece in zip(firsts, pieces))), pieces[-1])


class MoE(nn.Module):
    """The sparse MLP of a block: ``sum_k weight_k * expert_k(x)`` over each token's ``top_k`` experts, plus an
    optional shared expert every token goes through.

    Args:
        dim: model width.
        hidden_dim: each expert's intermediate width (``moe_intermediate_size``).
        n_experts, top_k: experts in the layer and experts per token (``num_experts``, ``num_experts_per_tok``).
        norm_topk_prob: renormalise the top-k weights to sum to 1.
        activation: the experts' gate activation; bias: biased expert projections.
        shared_expert: an MLP every token also goes through (Qwen2/3.5-MoE's ``shared_expert``), scaled by
            ``sigmoid(shared_expert_gate(x))`` when a gate (an ``nn.Linear(dim, 1)``) is given.
        aux_loss_coef: the load-balancing loss's weight (``router_aux_loss_coef``); 0 (default, transformers'
            ``output_router_logits=false``) keeps no router logits.
        experts: the experts module, when not :class:`Experts` of the arguments above (gpt-oss's
            :class:`~mtune.modules.clamped_experts.ClampedSwiGLUExperts`): rows sorted by expert in, as ``Experts``.
        router_name, router_bias: the router's attribute (and checkpoint) name, ``gate`` (default) or ``router``
            (gpt-oss), and whether it has a bias.

    Attributes:
        expert_compute: ``auto`` (default), ``grouped`` or ``loop`` (see the module docstring).
        router_logits: the last forward's router logits ``[tokens, n_experts]`` while ``aux_loss_coef > 0``.
    """

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, norm_topk_prob: bool = False,
                 activation: Callable = F.silu, bias: bool = False, shared_expert: nn.Module | None = None,
                 shared_expert_gate: nn.Module | None = None, aux_loss_coef: float = 0.0,
                 experts: nn.Module | None = None, router_name: str = "gate", router_bias: bool = False) -> None:
        super().__init__()
        self.router_name = router_name
        setattr(self, router_name, Router(dim, n_experts, top_k, norm_topk_prob, bias=router_bias))
        self.experts = experts if experts is not None else Experts(n_experts, dim, hidden_dim, activation, bias)
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.n_experts, self.top_k, self.aux_loss_coef = n_experts, top_k, aux_loss_coef
        self.expert_compute = "auto"
        self.router_logits: torch.Tensor | None = None

    @property
    def router_layer(self) -> Router:
        """The router, whatever its name (``gate`` or ``router``)."""
        return getattr(self, self.router_name)

    def _grouped(self, x: torch.Tensor) -> bool:
        return use_grouped(self.experts, x, self.expert_compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [b, s, dim]`` -> ``[b, s, dim]`` in ``x``'s dtype."""
        flat = x.reshape(-1, x.shape[-1])
        logits, weights, experts = self.router_layer(flat)
        if self.aux_loss_coef > 0:
            self.router_logits = logits
        out = dispatch(self.experts, flat, weights, experts, self._grouped(flat))
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(x.shape)


def use_grouped(experts: Experts, x: torch.Tensor, expert_compute: str) -> bool:
    """Whether ``expert_compute`` (``auto``, ``grouped`` or ``loop``) runs ``experts`` on rows like ``x`` grouped;
    ValueError for an unknown choice, or ``grouped`` where it cannot run."""
    if expert_compute not in EXPERT_COMPUTE:
        raise ValueError(f"expert_compute={expert_compute!r}: use one of {EXPERT_COMPUTE}")
    if expert_compute == "loop":
        return False
    can = experts.can_group(x)
    if expert_compute == "grouped" and not can:
        raise ValueError("expert_compute='grouped' needs frozen expert weights (adapters without dropout) with "
                         "16-byte aligned widths and ranks: use 'auto' or 'loop'")
    return can and (expert_compute == "grouped" or x.dtype == torch.bfloat16)


def dispatch(experts: Experts, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
             grouped: bool) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{chosen[t, k]}(flat[t])`` for every token ``t``: ``flat [tokens, dim]``,
    ``weights`` and ``chosen`` ``[tokens, top_k]`` (a router's output) -> ``[tokens, dim]`` in ``flat``'s dtype.
    The ``tokens * top_k`` (token, expert) pairs are sorted by expert, run, weighted and scattered back."""
    top_k = chosen.shape[-1]
    chosen = chosen.flatten()  # [tokens * top_k]: token t's k-th expert at t * top_k + k
    order = torch.argsort(chosen, stable=True)
    token = order // top_k
    counts = torch.zeros(experts.n_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, chosen, torch.ones_like(chosen))
    routed = experts(flat[token], counts, grouped)  # tokens * top_k rows, by expert
    routed = routed * weights.flatten()[order, None]
    return torch.zeros_like(flat).index_add_(0, token, routed)


def load_balancing_loss(router_logits: list[torch.Tensor], n_experts: int, top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over all MoE layers' rows together, as transformers computes it:
    ``n_experts * sum_e f_e * P_e``, ``f_e`` the share of (row, top-k slot) picks that went to expert ``e`` divided
    by the rows (no gradient), ``P_e`` the mean router probability of ``e``; 1 x top_k when perfectly balanced.

    ``router_logits``: one ``[tokens, n_experts]`` tensor per MoE layer. Returns an fp32 scalar.
    """
    logits = torch.cat([t.float() for t in router_logits])
    probs = torch.softmax(logits, dim=-1)
    picks = torch.topk(probs, top_k, dim=-1).indices.flatten()
    f = torch.zeros(n_experts, device=logits.device).scatter_add_(0, picks, torch.ones_like(picks, dtype=torch.float))
    rows = logits.shape[0]
    return n_experts * torch.sum((f / rows) * probs.mean(dim=0))


def router_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """``aux_loss_coef * load_balancing_loss`` over the MoE MLPs of ``model.layers`` (each block's ``mlp``) that
    kept their router logits in the last forward (None when none did: a dense model, or the loss off)."""
    mlps = (getattr(block, "mlp", None) for block in getattr(model, "layers", ()))
    layers = [m for m in mlps if isinstance(m, MoE) and m.aux_loss_coef > 0 and m.router_logits is not None]
    if not layers:
        return None
    first = layers[0]
    loss = load_balancing_loss([m.router_logits for m in layers], first.n_experts, first.top_k)
    for m in layers:
        m.router_logits = None  # the next forward records afresh
    return first.aux_loss_coef * loss
