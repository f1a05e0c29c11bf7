"""The mixture-of-experts block against a per-token loop written here (the definition), its two expert paths
against each other forward and backward, and its planning path on fake tensors."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from mtune.modules.moe import MoE, balanced_counts

DIM, HIDDEN, EXPERTS, TOP_K = 64, 32, 8, 2


def moe_block(dtype=torch.float32, seed=0, norm_topk_prob=True):
    torch.manual_seed(seed)
    block = MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.to(dtype)


def per_token(block, x):
    """Each token alone: softmax over all experts in fp32, its top-k, weights renormalised or not, the weighted
    sum of those experts' SwiGLU outputs."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax((x[t] @ block.gate.weight.T).float(), -1)
        weights, chosen = probs.topk(TOP_K)
        if block.gate.norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights.to(x.dtype), chosen.tolist()):
            experts = block.experts
            h = F.silu(x[t] @ experts.gate_proj.weight[e].T) * (x[t] @ experts.up_proj.weight[e].T)
            out[t] += w * (h @ experts.down_proj.weight[e].T)
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_both_expert_paths_equal_the_per_token_definition(norm_topk_prob):
    """Mutations seen failing: ``order // top_k`` -> ``order % top_k`` (rows scattered to the wrong tokens); the
    top-k weights not renormalised; ``_GroupedGLU`` with ``up`` and ``gate`` swapped."""
    block = moe_block(norm_topk_prob=norm_topk_prob).requires_grad_(False)
    x = torch.randn(3, 7, DIM, generator=torch.Generator().manual_seed(1))
    expected = per_token(block, x.view(-1, DIM)).view(x.shape)
    for path in ("loop", "grouped"):
        block.expert_compute = path
        torch.testing.assert_close(block(x), expected, rtol=1e-6, atol=1e-5)  # outputs ~40: fp32 round-off


def test_grouped_backward_equals_the_loop_and_keeps_no_stacked_weights():
    """Input gradients of the grouped path (its own backward) equal autograd's through the loop, in fp32 and bf16;
    and what backward keeps is the routed rows, not the experts' stacked weights. Mutation seen failing: backward
    without the up projection's term."""
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        block = moe_block(dtype)
        block.experts.requires_grad_(False)  # frozen experts, as under LoRA on attention
        x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
        grads = {}
        for path in ("loop", "grouped"):
            block.expert_compute = path
            xi = x.clone().requires_grad_()
            (block(xi) * torch.arange(DIM, dtype=dtype)).sum().backward()
            grads[path] = (xi.grad, block.gate.weight.grad.clone())
            block.gate.weight.grad = None
        for got, want in zip(grads["grouped"], grads["loop"]):
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol)
    block = moe_block(torch.bfloat16).requires_grad_(False)
    block.gate.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        block(torch.randn(1, 16, DIM, dtype=torch.bfloat16))  # bf16 and frozen experts: auto takes grouped
    assert EXPERTS * HIDDEN * DIM not in saved and max(saved) == 16 * TOP_K * DIM  # the routed rows


def test_auto_takes_the_loop_for_trainable_or_fp32_experts_and_grouped_refuses_trainable_ones():
    block = moe_block()
    x = torch.randn(4, DIM)
    assert not block._grouped(x) and not block._grouped(x.bfloat16())  # trainable experts
    block.experts.requires_grad_(False)
    assert not block._grouped(x) and block._grouped(x.bfloat16())
    block.experts.requires_grad_(True)
    block.expert_compute = "grouped"
    with pytest.raises(ValueError, match="expert_compute='grouped' needs frozen"):
        block(x[None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_tensors_plan_balanced_routing(dtype):
    """``mtune plan`` runs the block on fake tensors, whose routing it cannot read: frozen fp32 experts as one expert
    on all rows, trainable ones through the loop with balanced counts, frozen bf16 ones through grouped_mm's fake
    kernel."""
    assert balanced_counts(18, 8) == [3, 3, 2, 2, 2, 2, 2, 2]
    for trainable in (False, True):
        block = moe_block(dtype).requires_grad_(trainable)
        with FakeTensorMode(allow_non_fake_inputs=True):
            out = block(torch.randn(2, 9, DIM, dtype=dtype))
        assert out.shape == (2, 9, DIM) and out.dtype == dtype
