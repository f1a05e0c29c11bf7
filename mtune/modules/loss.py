"""Token-level cross-entropy losses for causal LM fine-tuning.

Both losses take labels that are already shifted (`labels[b, i]` is the token to predict at position i; -100 is
ignored) and return `(loss_sum, num_tokens)`: the fp32 sum of per-token losses and the number of labelled tokens.
Recipes add these up over gradient-accumulation micro-batches (and ranks) and divide once, so the loss is the
token-weighted mean whatever the padding, e.g.

    out = model(tokens, return_hidden=loss_fn.needs_hidden)
    loss_sum, n = loss_fn(out, labels, model.lm_head)
    (loss_sum / total_tokens_in_step).backward()

`ChunkedCrossEntropyLoss` takes the final hidden states instead of logits and applies the output projection itself,
one chunk of tokens at a time, so the [batch, seq, vocab] fp32 logits never exist at once, in forward or backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.checkpoint import checkpoint

from mtune.modules.softcap import SoftcappedLinear

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "FETCHES_WEIGHT", "CrossEntropyLoss", "ChunkedCrossEntropyLoss"]


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class CrossEntropyLoss(nn.Module):
    """Cross-entropy over full logits [b, s, vocab] (any dtype, upcast to fp32) and labels [b, s].

    Call as `loss_fn(logits, labels)` (an `lm_head` argument is accepted and ignored, so recipes call both losses
    the same way). Returns `(loss_sum, num_tokens)`.
    """

    needs_hidden = False

    def forward(
        self, logits: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _ce_sum(logits, labels), (labels != IGNORE_INDEX).sum()


class _ProjectedCrossEntropy(torch.autograd.Function):
    """``sum over labelled tokens of cross_entropy(hidden @ weight.T)``, chunk by chunk, with the gradients computed
    in forward: each chunk's logits are made, reduced to the loss, turned into their gradient (softmax - one-hot)
    and multiplied into ``d hidden`` and ``d weight`` at once, then freed. Backward only scales the two stored
    gradients by the incoming one. No logits outlive their chunk and none are recomputed.

    hidden [tokens, dim], weight [vocab, dim] (same dtype), labels [tokens] (-100 ignored); returns an fp32 scalar.
    ``grad_enabled``: the caller's grad mode (forward itself runs with grad off); off, only the loss is computed.
    ``cap``: soft-cap the logits, ``cap * tanh(logits / cap)`` in fp32 (Gemma 4), their gradient times
    ``1 - tanh**2``; None: none.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, num_chunks: int,
                grad_enabled: bool, cap: float | None = None):
        need_hidden = grad_enabled and ctx.needs_input_grad[0]
        need_weight = grad_enabled and ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = None
        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y, gh in zip(hidden.chunk(num_chunks), labels.chunk(num_chunks),
                            grad_hidden.chunk(num_chunks) if need_hidden else [None] * num_chunks):
            # one [chunk, vocab] fp32 buffer at a time beside at most one other: the logits are upcast and dropped
            # before log_softmax, the upcast copy dropped after it, and every chunk buffer before the next chunk
            logits = torch.mm(h, weight.t()).float()
            if cap is not None:
                tanh = logits.div_(cap).tanh_()
                logits = tanh * cap
            log_probs = torch.log_softmax(logits, dim=-1)
            del logits
            unlabelled = (y == IGNORE_INDEX).unsqueeze(1)
            target = y.masked_fill(unlabelled.squeeze(1), 0).unsqueeze(1)
            total -= log_probs.gather(1, target).masked_fill(unlabelled, 0.0).sum()
            if not (need_hidden or need_weight):
                del log_probs
                continue
            # d(sum of losses)/d logits = softmax - one_hot(target), zero on unlabelled rows
            grad_logits = log_probs.exp_().scatter_add_(1, target, unlabelled.float().sub(1.0))
            grad_logits = grad_logits.masked_fill_(unlabelled, 0.0)
            if cap is not None:
                grad_logits = grad_logits.mul_(1.0 - tanh.square_())
                del tanh
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                torch.mm(grad_logits, weight, out=gh)
            if need_weight:
                if grad_weight is None:
                    grad_weight = torch.mm(grad_logits.t(), h)
                else:
                    torch.addmm(grad_weight, grad_logits.t(), h, out=grad_weight)  # addmm_ eludes FlopCounterMode
            del log_probs, grad_logits
        if need_weight and grad_weight is None:  # no tokens at all
            grad_weight = torch.zeros_like(weight)
        ctx.grad_hidden, ctx.grad_weight, ctx.consumed = grad_hidden, grad_weight, False
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        if ctx.consumed:
            raise RuntimeError("ChunkedCrossEntropyLoss: backward ran twice through one loss (retain_graph=True is not "
                               "supported): compute the loss again")
        grad_hidden, grad_weight = ctx.grad_hidden, ctx.grad_weight
        ctx.grad_hidden = ctx.grad_weight = None
        ctx.consumed = True
        # in place: the stored gradients are this Function's own, and freed once returned
        if grad_hidden is not None:
            grad_hidden.mul_(grad_total)
        if grad_weight is not None:
            grad_weight.mul_(grad_total)
        return grad_hidden, grad_weight, None, None, None, None


FETCHES_WEIGHT = "_mtune_fetches_weight"
"""An attribute set (True) on a module hook whose only work is to bring the module's frozen weight to the compute
device before it is used, in forward and again for backward (weight offloading's hooks). Such hooks leave a head
plain: the chunked loss runs its forward pre-hooks itself, then projects and computes the gradients in forward,
where the weight is needed; backward does not read a frozen weight, so the head is not fetched again for it."""


def _fetching_hooks_only(lm_head: nn.Module) -> bool:
    hooks = [*lm_head._forward_pre_hooks.values(), *lm_head._forward_hooks.values()]
    return all(getattr(hook, FETCHES_WEIGHT, False) for hook in hooks) and not (
        hooks and lm_head.weight.requires_grad)


def _is_plain_head(lm_head: nn.Module) -> bool:
    """A bias-free ``nn.Linear`` (tied or not, soft-capped or not) with no hooks but those that fetch its frozen
    weight (`FETCHES_WEIGHT`); LoRA and NF4 heads, and heads with other hooks, go through their own forward."""
    return (type(lm_head) in (nn.Linear, SoftcappedLinear) and lm_head.bias is None
            and _fetching_hooks_only(lm_head))


def _plain_projection_weight(lm_head: nn.Module) -> torch.Tensor | None:
    """``lm_head``'s weight when its gradients can be computed in forward (a plain head holding an ordinary tensor,
    fake ones included: under FSDP2 the unsharded one, as the model's forward leaves it), fetched to the device by
    its hooks where it has them, else None: wrapper tensor subclasses (a still-sharded DTensor, NF4) go through the
    head's own forward."""
    if not _is_plain_head(lm_head) or is_traceable_wrapper_subclass(lm_head.weight):
        return None
    for fetch in lm_head._forward_pre_hooks.values():
        fetch(lm_head, ())
    return lm_head.weight


class ChunkedCrossEntropyLoss(nn.Module):
    """Cross-entropy from hidden states [b, s, dim], computed `num_chunks` chunks of tokens at a time.

    Call as `loss_fn(hidden, labels, model.lm_head)`; the projection may be an nn.Linear, a LoRALinear or a weight
    tied to the embedding. The batch's tokens are flattened and split into `num_chunks` contiguous chunks, so the
    fp32 logits of only one chunk exist at a time (peak extra memory: one chunk's logits and their gradient).

    With a plain bias-free `nn.Linear` head (trainable, frozen or tied) and no autocast, each chunk's gradients for
    the hidden states and the head's weight are computed as soon as its loss is (`_ProjectedCrossEntropy`), so
    backward does no loss work and the output projection runs once: the step's work is that of the unchunked loss.
    A head whose weight offloading fetches counts as plain (`FETCHES_WEIGHT`).
    Otherwise (LoRA or NF4 on `lm_head`, other hooks on it, fp16 autocast) each chunk is checkpointed and backward
    recomputes its logits: one more output projection per step (`recomputes_projection`). Returns
    `(loss_sum, num_tokens)`.
    """

    needs_hidden = True

    @staticmethod
    def recomputes_projection(lm_head: nn.Module, *, autocast: bool = False) -> bool:
        """Whether a training step with this head (under fp16 autocast when ``autocast``) runs the output projection's
        forward twice (the checkpointed path), which FLOPs counting adds to hfu."""
        return autocast or not _is_plain_head(lm_head)

    def __init__(self, num_chunks: int = 8):
        super().__init__()
        if num_chunks < 1:
            raise ValueError(f"loss.num_chunks must be >= 1, got {num_chunks}")
        self.num_chunks = num_chunks

    def forward(
        self, hidden: torch.Tensor, labels: torch.Tensor, lm_head: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if lm_head is None:
            raise ValueError("ChunkedCrossEntropyLoss needs the output projection: call loss_fn(hidden, labels, model.lm_head)")

        # Chunks of the flattened tokens, each one contiguous [tokens, dim] block: one plain matmul per chunk. Slices
        # of the sequence dimension are strided and go through a batched matmul, 1.34x slower per LoRA step in bf16
        # on CPU (benchmarks/step_speedups.py).
        flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        weight = None if torch.is_autocast_enabled(hidden.device.type) else _plain_projection_weight(lm_head)
        if weight is not None and weight.dtype == flat_hidden.dtype:
            total = _ProjectedCrossEntropy.apply(flat_hidden.contiguous(), weight, flat_labels, self.num_chunks,
                                                 torch.is_grad_enabled(), getattr(lm_head, "softcap", None))
            return total, (labels != IGNORE_INDEX).sum()

        def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _ce_sum(lm_head(h), y)

        total = hidden.new_zeros((), dtype=torch.float32)
        for h, y in zip(flat_hidden.chunk(self.num_chunks), flat_labels.chunk(self.num_chunks)):
            if torch.is_grad_enabled():
                total = total + checkpoint(chunk_loss, h, y, use_reentrant=False)
            else:
                total = total + chunk_loss(h, y)
        return total, (labels != IGNORE_INDEX).sum()
