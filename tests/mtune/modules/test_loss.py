"""Losses: chunked cross-entropy equals full cross-entropy (and torch's own mean) in loss and gradients."""

import copy

import pytest
import torch
import torch.nn.functional as F

from mtune.models import build_model
from mtune.modules.lora import apply_lora
from mtune.modules.loss import ChunkedCrossEntropyLoss, CrossEntropyLoss


def _batch(seed=6):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (2, 40), generator=gen)
    labels = torch.randint(0, 512, (2, 40), generator=gen)
    labels[0, :7] = -100  # a prompt
    labels[1, 30:] = -100  # padding
    return tokens, labels


@pytest.mark.parametrize("family,lora", [("llama3_1", ["q_proj", "lm_head"]), ("llama3_2", None)])  # LoRA / tied head
def test_chunked_equals_plain_in_loss_and_grads(family, lora):
    torch.manual_seed(0)
    model = build_model(family, "tiny", device="cpu")
    if lora:
        apply_lora(model, lora, rank=4, alpha=8)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_b" in name:
                    p.normal_(0, 0.02)
    twin = copy.deepcopy(model)
    tokens, labels = _batch()

    plain_sum, n = CrossEntropyLoss()(model(tokens), labels)
    chunked_loss = ChunkedCrossEntropyLoss(num_chunks=8)
    chunked_sum, n_chunked = chunked_loss(twin(tokens, return_hidden=chunked_loss.needs_hidden), labels, twin.lm_head)
    assert n.item() == n_chunked.item() == 80 - 7 - 10
    ref = F.cross_entropy(model(tokens).reshape(-1, 512), labels.reshape(-1))  # torch's mean over labelled tokens
    assert abs((plain_sum / n).item() - ref.item()) <= 1e-6
    assert abs(plain_sum.item() - chunked_sum.item()) / plain_sum.item() <= 1e-6
    (plain_sum / n).backward()
    (chunked_sum / n_chunked).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        if p.requires_grad:
            assert (p.grad - q.grad).abs().max().item() <= 1e-6, name


def test_token_weighted_accumulation_over_micro_batches():
    # Two micro-batches with different token counts: summing (loss_sum, n) gives the mean over all tokens.
    logits = torch.randn(2, 40, 512)
    _, labels = _batch()
    loss_fn = CrossEntropyLoss()
    s0, n0 = loss_fn(logits[:1], labels[:1])
    s1, n1 = loss_fn(logits[1:], labels[1:])
    ref = F.cross_entropy(logits.reshape(-1, 512), labels.reshape(-1))
    assert n0.item() != n1.item()
    assert abs(((s0 + s1) / (n0 + n1)).item() - ref.item()) <= 1e-6


def test_chunked_needs_the_projection():
    with pytest.raises(ValueError, match="model.lm_head"):
        ChunkedCrossEntropyLoss()(torch.randn(1, 4, 8), torch.zeros(1, 4, dtype=torch.long), None)
