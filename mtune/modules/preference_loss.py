"""Preference losses (DPO, IPO, SimPO) over pairs of responses, and the objective that runs a pair batch through
the policy.

A pair batch holds the chosen responses in its first half of rows and the rejected ones in its second half
(`mtune.data.preference.collate_preference`), or whole pairs packed into rows, each response a document of its own
(`collate_packed_pairs`), so one forward of the policy sees both. From the logits,
:func:`sequence_logps` sums the log-probability of every labelled token of each row: the response tokens only
(prompt and padding carry label -100). Writing ``pi_c, pi_r`` for the policy's summed log-probs of the chosen and
rejected response, ``ref_c, ref_r`` for the reference model's and ``h = (pi_c - pi_r) - (ref_c - ref_r)``:

- DPO (Rafailov et al. 2023), with conservative label smoothing eps (cDPO):
  ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
- IPO (Azar et al. 2023): ``loss = (h - 1 / (2 beta))^2``;
- SimPO (Meng et al. 2024), reference-free, on length-normalised log-probs (``|y|`` labelled tokens):
  ``loss = -log sigmoid(beta pi_c / |y_c| - beta pi_r / |y_r| - gamma)``.

Each loss returns per-pair losses and the implicit rewards ``beta (pi - ref)`` of the chosen and rejected responses
(SimPO's: ``beta pi / |y|``). Every loss is computed in fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100

__all__ = ["sequence_logps", "pair_logps", "PairLosses", "DPOLoss", "IPOLoss", "SimPOLoss", "PreferenceObjective",
           "PAIR_METRICS"]


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_ids: torch.Tensor | None = None,
                   num_sequences: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed log-probs [n], labelled tokens [n])`` of each sequence: ``sum_i log softmax(logits[r, i])[labels[r,
    i]]`` over its positions whose label is not -100 (labels already shifted, as everywhere in mtune). A sequence is
    a row (``n`` rows), or with ``sequence_ids`` [rows, s] (packed rows: each token's sequence, -1 for none) one of
    ``num_sequences``. fp32, whatever the logits' dtype; one row's fp32 log-normaliser at a time beside the logits."""
    mask = labels != IGNORE_INDEX
    target = labels.masked_fill(~mask, 0).unsqueeze(-1)
    rows = []
    for row_logits, row_target in zip(logits, target):  # [s, vocab]: the fp32 copy of one row at a time
        row_logits = row_logits.float()
        rows.append(row_logits.gather(-1, row_target).squeeze(-1) - torch.logsumexp(row_logits, dim=-1))
    token_logps = torch.stack(rows) if rows else logits.new_zeros(labels.shape, dtype=torch.float32)
    if sequence_ids is None:
        return (token_logps * mask).sum(-1), mask.sum(-1)
    # every token into its sequence's bucket; unlabelled tokens and padding into one more, dropped
    bucket = sequence_ids.masked_fill(~mask | (sequence_ids < 0), num_sequences).flatten()
    sums = token_logps.new_zeros(num_sequences + 1).index_add(0, bucket, (token_logps * mask).flatten())
    counts = mask.new_zeros(num_sequences + 1, dtype=torch.long).index_add(0, bucket, mask.flatten().long())
    return sums[:-1], counts[:-1]


def pair_logps(logits: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logps` of a pair batch, ``[2n]`` each: the n chosen responses, then the n rejected ones,
    whether the batch is a row per response or packed rows (``sequence_ids``, ``pair_index`` [n])."""
    if batch.get("sequence_ids") is None:
        return sequence_logps(logits, batch["labels"])
    return sequence_logps(logits, batch["labels"], batch["sequence_ids"], 2 * batch["pair_index"].numel())


@dataclass
class PairLosses:
    """Per-pair results of a preference loss: ``losses`` [b] and the implicit rewards [b] of each response."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


class DPOLoss(nn.Module):
    """DPO's sigmoid loss: see the module docstring. ``beta`` scales the log-ratio (the KL penalty's inverse
    strength); ``label_smoothing`` is the assumed probability that a pair's preference is flipped (0: plain DPO)."""

    reference_free = False

    def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0):
        super().__init__()
        if beta <= 0 or not 0 <= label_smoothing < 0.5:
            raise ValueError(f"DPOLoss needs beta > 0 and 0 <= label_smoothing < 0.5, got beta={beta}, "
                             f"label_smoothing={label_smoothing}")
        self.beta, self.label_smoothing = beta, label_smoothing

    def forward(self, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens=None, rejected_tokens=None):
        h = (chosen - rejected) - (ref_chosen - ref_rejected)
        eps = self.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(self.beta * h) - eps * F.logsigmoid(-self.beta * h)
        return PairLosses(losses, self.beta * (chosen - ref_chosen).detach(),
                          self.beta * (rejected - ref_rejected).detach())


class IPOLoss(nn.Module):
    """IPO's squared loss: the log-ratio difference ``h`` regressed onto ``1 / (2 beta)``, on summed log-probs."""

    reference_free = False

    def __init__(self, beta: float = 0.1):
        super().__init__()
        if beta <= 0:
            raise ValueError(f"IPOLoss needs beta > 0, got {beta}")
        self.beta = beta

    def forward(self, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens=None, rejected_tokens=None):
        h = (chosen - rejected) - (ref_chosen - ref_rejected)
        return PairLosses((h - 1 / (2 * self.beta)) ** 2, self.beta * (chosen - ref_chosen).detach(),
                          self.beta * (rejected - ref_rejected).detach())


class SimPOLoss(nn.Module):
    """SimPO: no reference model; the margin between length-normalised log-probs scaled by ``beta`` must exceed
    ``gamma`` (the target reward margin); ``label_smoothing`` as in DPO."""

    reference_free = True

    def __init__(self, beta: float = 2.0, gamma: float = 1.0, label_smoothing: float = 0.0):
        super().__init__()
        if beta <= 0 or not 0 <= label_smoothing < 0.5:
            raise ValueError(f"SimPOLoss needs beta > 0 and 0 <= label_smoothing < 0.5, got beta={beta}, "
                             f"label_smoothing={label_smoothing}")
        self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing

    def forward(self, chosen, rejected, ref_chosen=None, ref_rejected=None, chosen_tokens=None,
                rejected_tokens=None):
        chosen_reward = self.beta * chosen / chosen_tokens.clamp(min=1)
        rejected_reward = self.beta * rejected / rejected_tokens.clamp(min=1)
        z = chosen_reward - rejected_reward - self.gamma
        eps = self.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return PairLosses(losses, chosen_reward.detach(), rejected_reward.detach())


PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
"""What a preference step reports, each a mean over the step's pairs (all ranks)."""


class PreferenceObjective(nn.Module):
    """What the training loop calls as its loss for pair batches: :meth:`forward_batch` runs the reference
    (``reference(batch) -> (ref_chosen [b], ref_rejected [b])``, fp32, no gradient; unused by a reference-free loss)
    before the policy's forward, so their activations never coexist, then the policy over chosen and rejected rows
    at once, and returns ``(summed pair losses, pairs)``; :meth:`count` says what the loop averages over (pairs).
    The step's metrics (:data:`PAIR_METRICS`) accumulate until :meth:`take_metrics`."""

    frozen_tensors: tuple = ()
    """Weights the reference holds outside the policy (a frozen copy's), for the run's byte tracker."""

    def __init__(self, loss: nn.Module, reference: Callable[[dict], tuple[torch.Tensor, torch.Tensor]] | None):
        super().__init__()
        if reference is None and not loss.reference_free:
            raise ValueError(f"{type(loss).__name__} needs a reference model")
        self.loss, self.reference = loss, reference
        self._sums: torch.Tensor | None = None

    @staticmethod
    def count(batch: dict) -> int:
        """The pairs of a batch: half its rows, or its ``pair_index`` when packed."""
        if batch.get("sequence_ids") is not None:
            return int(batch["pair_index"].numel())
        return int(batch["tokens"].shape[0]) // 2

    def forward_batch(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ref = (None, None) if self.loss.reference_free else self.reference(batch)
        logits = model(batch["tokens"], input_pos=batch.get("input_pos"), document_ids=batch.get("document_ids"),
                       longest_document=batch.get("longest_document"))
        logps, tokens = pair_logps(logits, batch)
        del logits
        n = logps.shape[0] // 2
        out = self.loss(logps[:n], logps[n:], *ref, tokens[:n], tokens[n:])
        sums = torch.stack([out.chosen_rewards.sum(), out.rejected_rewards.sum(),
                            (out.chosen_rewards > out.rejected_rewards).float().sum(),
                            (out.chosen_rewards - out.rejected_rewards).sum(), logps[:n].detach().sum(),
                            logps[n:].detach().sum(), logps.new_tensor(float(n))])
        self._sums = sums if self._sums is None else self._sums + sums
        return out.losses.sum(), logps.new_tensor(float(n))

    def take_metrics(self, reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> dict[str, float]:
        """The means of :data:`PAIR_METRICS` since the last call (``reduce``: a sum over ranks), then reset."""
        if self._sums is None:
            return {}
        sums, self._sums = reduce(self._sums), None
        return {name: float(v) for name, v in zip(PAIR_METRICS, (sums[:-1] / sums[-1].clamp(min=1)).tolist())}
