"""One optimizer step over accumulated micro-batches, and the loss over a held-out set (``val_loss``).

The loss of a step is the token-weighted mean over all of its micro-batches (and ranks): each micro-batch's summed
token loss is divided by the number of trained tokens of the whole step before backward, so 2 micro-batches of 1
sample give the same gradient as 1 batch of 2, whatever the padding.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from mtune.config import instantiate
from mtune.data.common import IGNORE_INDEX
from mtune.errors import MtuneError
from mtune.modules.loss import CrossEntropyLoss
from mtune.modules.moe import router_aux_loss
from mtune.training.distributed import all_reduce

__all__ = ["StepResult", "NonFiniteLossError", "build_loss", "micro_batch_groups", "train_step", "step_on_tensors",
           "evaluate", "forward_loss", "loss_metrics"]


class NonFiniteLossError(MtuneError, RuntimeError):
    """The loss became inf or NaN in a bf16/fp32 run."""


@dataclass
class StepResult:
    loss: float  # token-weighted mean loss of the step (over all ranks)
    trained_tokens: int  # tokens with a label in this step (all ranks)
    num_tokens: int  # tokens before padding, prompts included (this rank)
    grad_norm: float | None  # before clipping; None without clip_grad_norm
    stepped: bool  # False when fp16 loss scaling skipped the step
    metrics: dict = field(default_factory=dict)  # the loss's own (preference losses: rewards/*, logps/*)


def build_loss(node) -> nn.Module:
    """The loss a config's ``loss`` node names (``_component_``, e.g. ``mtune.modules.loss.ChunkedCrossEntropyLoss``),
    or the library's token-summed :class:`~mtune.modules.loss.CrossEntropyLoss` when the node is null."""
    return instantiate(node) or CrossEntropyLoss()


def micro_batch_groups(batches: Iterable[dict], accumulation_steps: int) -> Iterator[list[dict]]:
    """Group consecutive batches into lists of ``accumulation_steps`` (one optimizer step each); an incomplete
    last group is dropped, so every step sees the same number of micro-batches."""
    group: list[dict] = []
    for batch in batches:
        group.append(batch)
        if len(group) == accumulation_steps:
            yield group
            group = []


def forward_loss(model: nn.Module, batch: dict, loss_fn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed loss, what it sums over)`` of one batch already on the model's device: trained tokens, or the pairs
    of a loss that runs the model itself (``loss_fn.forward_batch``, preference pairs)."""
    if hasattr(loss_fn, "forward_batch"):
        return loss_fn.forward_batch(model, batch)
    output = model(
        batch["tokens"],
        input_pos=batch.get("input_pos"),
        document_ids=batch.get("document_ids"),
        longest_document=batch.get("longest_document"),
        return_hidden=getattr(loss_fn, "needs_hidden", False),
    )
    summed, count = loss_fn(output, batch["labels"], model.lm_head)
    aux = router_aux_loss(model)  # MoE models with the load-balancing loss on; None otherwise
    if aux is not None:  # a mean over the batch's tokens, as transformers adds it to its mean loss
        summed = summed + aux.to(summed.dtype) * count
    return summed, count


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def train_step(
    model: nn.Module,
    micro_batches: list[dict],
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    autocast=contextlib.nullcontext,
    loss_scaler=None,
    clip_grad_norm: float | None = None,
    world_size: int = 1,
    step: int = 0,
    fp16: bool = False,
    before_zero_grad=None,
) -> StepResult:
    """Forward and backward every micro-batch, then unscale, clip and step the optimizer.

    ``autocast`` is a context factory (fp16 autocast or a no-op). An `OptimizerInBackward` has already stepped each
    parameter during backward: its ``step()`` and ``zero_grad()`` do nothing (the validator refuses clipping and
    fp16 loss scaling with it). With ``world_size`` > 1 the gradient of each rank is scaled by the world
    size, because FSDP averages gradients over ranks while the loss is normalised by the tokens of all ranks.
    ``before_zero_grad()`` runs after the optimizer step while gradients still exist (memory accounting).
    """
    local_tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro_batches)
    count = getattr(loss_fn, "count", None)  # what the loss is a mean over: tokens, or a pair loss's pairs
    local_count = sum(count(b) for b in micro_batches) if count else local_tokens
    total = all_reduce(torch.tensor(float(local_count), device=device))
    num_tokens = sum(int(batch.get("num_tokens", batch["tokens"].numel())) for batch in micro_batches)
    loss_sum, grad_norm, stepped = step_on_tensors(
        model, micro_batches, loss_fn, optimizer, denominator=total.clamp(min=1.0) / world_size, device=device,
        autocast=autocast, loss_scaler=loss_scaler, clip_grad_norm=clip_grad_norm, before_zero_grad=before_zero_grad,
        check_loss=lambda loss_sum: _check_finite(all_reduce(loss_sum), total, step, fp16, model),
    )
    mean_loss = (loss_sum / total.clamp(min=1.0)).item()
    trained = total if count is None else all_reduce(torch.tensor(float(local_tokens), device=device))
    return StepResult(mean_loss, int(trained.item()), num_tokens, None if grad_norm is None else float(grad_norm),
                      stepped, loss_metrics(loss_fn))


def loss_metrics(loss_fn: nn.Module) -> dict[str, float]:
    """The loss's own metrics since they were last taken (a preference loss's rewards), means over all ranks."""
    take = getattr(loss_fn, "take_metrics", None)
    return take(reduce=all_reduce) if take is not None else {}


def _check_finite(loss_sum: torch.Tensor, total: torch.Tensor, step: int, fp16: bool, model: nn.Module) -> None:
    mean_loss = (loss_sum / total.clamp(min=1.0)).item()
    if not math.isfinite(mean_loss) and not fp16:
        # dtype=fp32 is advice only to a run that is not fp32 already (some weights stored in 16 bits)
        low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in model.parameters())
        raise NonFiniteLossError(f"step {step}: the loss is {mean_loss}; lower the learning rate, "
                                 + ("set clip_grad_norm, or use dtype=fp32" if low_precision else
                                    "or set clip_grad_norm"))


def step_on_tensors(
    model: nn.Module,
    micro_batches: list[dict],
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    denominator: torch.Tensor,
    device: torch.device,
    autocast=contextlib.nullcontext,
    loss_scaler=None,
    clip_grad_norm: float | None = None,
    before_zero_grad=None,
    check_loss=None,
):
    """The tensor work of :func:`train_step`, with no data-dependent Python value (no ``.item()``), so ``mtune
    plan`` runs it on fake tensors: forward and backward of every micro-batch (each loss divided by
    ``denominator``), unscale and clip, the optimizer step, ``zero_grad``. ``check_loss(loss_sum)`` runs before the
    optimizer step (the training loop refuses a non-finite loss there). Returns ``(summed loss, grad norm tensor or
    None, stepped)``."""
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    for batch in micro_batches:
        batch = _to_device(batch, device)
        with autocast():
            summed = forward_loss(model, batch, loss_fn)[0]  # the count is not kept through the next forward
        loss = summed / denominator
        if loss_scaler is not None:
            loss = loss_scaler.scale(loss)
        loss.backward()
        loss_sum += summed.detach().float()
        del batch, summed, loss  # one micro-batch's activations at a time
    if check_loss is not None:
        check_loss(loss_sum)
    grad_norm = None
    if loss_scaler is not None:
        loss_scaler.unscale_(optimizer)
    if clip_grad_norm is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    stepped = loss_scaler.step(optimizer) if loss_scaler is not None else (optimizer.step() or True)
    if before_zero_grad is not None:
        before_zero_grad()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, stepped


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Iterable[dict], loss_fn: nn.Module, *, device: torch.device, autocast=contextlib.nullcontext,
    metrics: dict | None = None,
) -> float:
    """Token-weighted (or pair-weighted: see :func:`forward_loss`) mean loss over ``batches`` (all ranks), with the
    model in eval mode; the loss's own metrics over them (:func:`loss_metrics`) go into ``metrics`` when given."""
    loss_metrics(loss_fn)  # a step's metrics stay the step's
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    tokens = torch.zeros((), device=device, dtype=torch.float32)
    try:
        for batch in batches:
            batch = _to_device(batch, device)
            with autocast():
                summed, n = forward_loss(model, batch, loss_fn)
            loss_sum += summed.float()
            tokens += n
    finally:
        model.train(was_training)
    taken = loss_metrics(loss_fn)
    if metrics is not None:
        metrics.update(taken)
    loss_sum, tokens = all_reduce(loss_sum), all_reduce(tokens)
    return (loss_sum / tokens.clamp(min=1.0)).item()
