"""Token-level cross-entropy losses for causal LM fine-tuning.

Both losses take labels that are already shifted (`labels[b, i]` is the token to predict at position i; -100 is
ignored) and return `(loss_sum, num_tokens)`: the fp32 sum of per-token losses and the number of labelled tokens.
Recipes add these up over gradient-accumulation micro-batches (and ranks) and divide once, so the loss is the
token-weighted mean whatever the padding, e.g.

    out = model(tokens, return_hidden=loss_fn.needs_hidden)
    loss_sum, n = loss_fn(out, labels, model.lm_head)
    (loss_sum / total_tokens_in_step).backward()

`ChunkedCrossEntropyLoss` takes the final hidden states instead of logits and applies the output projection itself,
one sequence chunk at a time, so the [batch, seq, vocab] fp32 logits never exist at once, in forward or backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX", "CrossEntropyLoss", "ChunkedCrossEntropyLoss"]


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


class ChunkedCrossEntropyLoss(nn.Module):
    """Cross-entropy from hidden states [b, s, dim], computed `num_chunks` chunks of tokens at a time.

    Call as `loss_fn(hidden, labels, model.lm_head)`; the projection may be an nn.Linear, a LoRALinear or a weight
    tied to the embedding. The batch's tokens are flattened and split into `num_chunks` contiguous chunks; each
    chunk projects to logits, upcasts to fp32 and reduces to a scalar; the chunk is
    checkpointed, so backward recomputes its logits instead of keeping them: peak extra memory is one chunk's fp32
    logits, at the cost of one more output projection per step. Returns `(loss_sum, num_tokens)`.
    """

    needs_hidden = True

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

        def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return _ce_sum(lm_head(h), y)

        total = hidden.new_zeros((), dtype=torch.float32)
        # Chunks of the flattened tokens, each one contiguous [tokens, dim] block: one plain matmul per chunk. Slices
        # of the sequence dimension are strided and go through a batched matmul, 1.34x slower per LoRA step in bf16
        # on CPU (benchmarks/step_speedups.py).
        flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        for h, y in zip(flat_hidden.chunk(self.num_chunks), flat_labels.chunk(self.num_chunks)):
            if torch.is_grad_enabled():
                total = total + checkpoint(chunk_loss, h, y, use_reentrant=False)
            else:
                total = total + chunk_loss(h, y)
        return total, (labels != IGNORE_INDEX).sum()
