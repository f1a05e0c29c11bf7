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


@pytest.mark.parametrize("family,lora", [
    ("llama3_1", ["q_proj", "lm_head"]),  # LoRA on the head: the checkpointed path
    ("llama3_2", None),                   # tied head: gradients computed in forward, into the embedding too
    ("llama3_1", None),                   # untied trainable head
    ("llama3_1", ["q_proj"]),             # frozen head: only the hidden states' gradient
])
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


def _step(model, loss_fn, tokens, labels):
    model.zero_grad(set_to_none=True)
    total, n = loss_fn(model(tokens, return_hidden=True), labels, model.lm_head)
    (total / n).backward()
    return total.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gradients_in_forward_equal_the_checkpointed_path(dtype, tol):
    # A forward hook on lm_head sends the loss down the checkpointed (recomputing) path; both must agree. bf16:
    # the two paths round the logits' gradient at different points, so they agree to bf16 precision only.
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu").to(dtype)
    tokens, labels = _batch()
    loss_fn = ChunkedCrossEntropyLoss(num_chunks=3)
    assert not loss_fn.recomputes_projection(model.lm_head)
    fused_loss, fused = _step(model, loss_fn, tokens, labels)
    hook = model.lm_head.register_forward_hook(lambda *_: None)
    assert loss_fn.recomputes_projection(model.lm_head)
    ref_loss, ref = _step(model, loss_fn, tokens, labels)
    hook.remove()
    assert fused.keys() == ref.keys() and "lm_head.weight" in fused
    assert abs(fused_loss.item() - ref_loss.item()) <= 1e-6 * abs(ref_loss.item())
    for name in ref:
        scale = ref[name].float().abs().max().item()
        assert (fused[name].float() - ref[name].float()).abs().max().item() <= tol * scale, name


def test_without_grad_and_under_autocast():
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu")
    tokens, labels = _batch()
    loss_fn = ChunkedCrossEntropyLoss(num_chunks=4)
    with torch.no_grad():
        hidden = model(tokens, return_hidden=True)
        total, n = loss_fn(hidden, labels, model.lm_head)
        plain, _ = CrossEntropyLoss()(model.lm_head(hidden), labels)
    assert not total.requires_grad and abs(total.item() - plain.item()) <= 1e-6 * plain.item()
    # fp16 autocast runs the head in fp16 through its own forward: the checkpointed path
    assert loss_fn.recomputes_projection(model.lm_head, autocast=True)
    with torch.autocast("cpu", dtype=torch.float16):
        total, _ = loss_fn(model(tokens, return_hidden=True), labels, model.lm_head)
    assert abs(total.item() - plain.item()) <= 2e-3 * plain.item()


def test_backward_twice_through_one_loss_is_refused():
    model = build_model("llama3_1", "tiny", device="cpu")
    tokens, labels = _batch()
    total, _ = ChunkedCrossEntropyLoss()(model(tokens, return_hidden=True), labels, model.lm_head)
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        total.backward()


def test_a_biased_head_and_a_trainable_fetched_head_go_through_their_own_forward():
    """Only bias-free heads whose hooks fetch a frozen weight compute gradients in forward: a biased head's loss
    includes its bias (oracle: torch's cross-entropy of head(hidden)), and a trainable head counts as recomputed."""
    from mtune.modules.loss import FETCHES_WEIGHT

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 32, bias=True)
    with torch.no_grad():
        head.bias.normal_(0, 2.0)  # large enough that dropping it moves the loss
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    labels = torch.randint(0, 32, (2, 5))
    labels[0, 0] = -100
    total, n = ChunkedCrossEntropyLoss(num_chunks=3)(hidden, labels, head)
    expected = F.cross_entropy(head(hidden).reshape(-1, 32), labels.reshape(-1), reduction="sum")
    assert n.item() == 9 and abs(total.item() - expected.item()) <= 1e-5 * expected.item()
    total.backward()
    assert head.bias.grad is not None and head.bias.grad.abs().sum() > 0

    plain = torch.nn.Linear(16, 32, bias=False)
    fetch = plain.register_forward_pre_hook(lambda *_: None)
    setattr(plain._forward_pre_hooks[fetch.id], FETCHES_WEIGHT, True)
    assert ChunkedCrossEntropyLoss.recomputes_projection(plain)  # trainable: backward needs the weight
    plain.weight.requires_grad_(False)
    assert not ChunkedCrossEntropyLoss.recomputes_projection(plain)  # frozen: only fetched


def test_chunk_count_must_be_positive():
    with pytest.raises(ValueError, match="num_chunks must be >= 1, got 0"):
        ChunkedCrossEntropyLoss(num_chunks=0)
