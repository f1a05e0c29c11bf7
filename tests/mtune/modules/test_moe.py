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


def output_and_input_grad(fn, x):
    """``fn(x)`` and the gradient of a fixed weighting of it with respect to ``x``, both in fp32."""
    xi = x.clone().requires_grad_()
    out = fn(xi)
    (out.float() * torch.arange(out.shape[-1])).sum().backward()
    return out.float(), xi.grad.float()


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_both_expert_paths_equal_the_per_token_definition(norm_topk_prob):
    """Mutations seen failing: ``order // top_k`` -> ``order % top_k`` (rows scattered to the wrong tokens); the
    top-k weights not renormalised; the grouped path with ``up`` and ``gate`` swapped."""
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


def test_nf4_experts_run_grouped_and_equal_the_loop():
    """QLoRA's frozen NF4 experts: ``auto`` takes the grouped path (each projection dequantized once, not per
    expert), whose output and input gradient equal the loop's per-expert NF4 matmuls. Mutation seen failing: NF4
    experts kept out of the grouped path (``auto`` takes the loop)."""
    from mtune.modules.nf4_linear import is_nf4

    block = moe_block(torch.bfloat16).requires_grad_(False)
    for projection in block.experts.projections():
        projection.nf4 = True
        projection.quantize_()
    assert all(is_nf4(p.weight) for p in block.experts.projections())
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert block._grouped(x.view(-1, DIM))
    results = {}
    for path in ("loop", "auto"):
        block.expert_compute = path
        results[path] = output_and_input_grad(block, x)
    for got, want in zip(results["auto"], results["loop"]):
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=0, atol=0.02 * scale)  # bf16 matmuls in another order


def _stacked_peak(fake: bool, fused: bool = False) -> int:
    """The tracked peak of dequantizing one NF4 projection of 8 experts ``[8, 512, 256]`` for the grouped kernel
    (``fused``: on fake weights, planned as a run whose dequantization is the compiled kernel)."""
    import contextlib

    from mtune.modules.expert_linear import ExpertLinear
    from mtune.training.planning.replay import replayed_nf4_dequantization
    from mtune.training.planning.tracker import TensorTracker

    mode = FakeTensorMode() if fake else None
    with mode or contextlib.nullcontext(), torch.no_grad():
        projection = ExpertLinear(8, 256, 512, dtype=torch.bfloat16)
        projection.weight.normal_(0, 0.02)
        projection.nf4 = True
        projection.quantize_()
        tracker = TensorTracker(fake_mode=mode)
        with tracker, replayed_nf4_dequantization(tracker, fused=True) if fused else contextlib.nullcontext():
            projection.stacked()
        return tracker.take_interval().peak["device"]


def test_nf4_stacked_weight_is_dequantized_by_parts_and_planned_from_one():
    """The grouped path dequantizes an NF4 projection an eighth at a time: the peak is the bf16 result plus about one
    eighth's transient (whole, torchao's int64 codes would be several times the result); on the planner's fake
    tensors one part is run, and gives the same peak as the eight real ones. Mutations seen failing: the fake loop
    stopped before its first part (the plan 2.3 MiB low); one part of the whole projection (the bound)."""
    result = 8 * 512 * 256 * 2
    real = _stacked_peak(fake=False)
    assert result < real <= 2.25 * result
    assert _stacked_peak(fake=True) == real


def test_where_the_kernel_dequantizes_a_stacked_projection_is_dequantized_whole(monkeypatch):
    """Where dequantization allocates only its result (CUDA's compiled kernel), the grouped path dequantizes an NF4
    projection in one call, with no copy: planned for such a run, the peak is the bf16 result and its block scales
    (one value per 64) and nothing beside them; a real weight dequantized whole gives the parts' values bit for bit.
    Mutation seen failing: ``stacked`` deaf to ``decodes_alone`` (the plan then holds an eighth beside the result)."""
    from mtune.modules import expert_linear

    result = 8 * 512 * 256 * 2
    assert _stacked_peak(fake=True, fused=True) == result + result // 64
    projection = expert_linear.ExpertLinear(8, 256, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        projection.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(3))
    projection.nf4 = True
    projection.quantize_()
    by_parts = projection.stacked()
    monkeypatch.setattr(expert_linear, "decodes_alone", lambda weight: True)
    assert torch.equal(projection.stacked(), by_parts)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.02)])
def test_biased_clamped_experts_run_grouped_and_equal_the_loop(dtype, atol):
    """gpt-oss's experts (fused, interleaved gate/up, biased, the clamp biting) on the grouped path: each row's bias
    picked by its expert, output and input gradient equal to the per-expert loop's (relative to the largest value).
    Mutations seen failing: the biases left out of the grouped path; each row given the next expert's bias
    (``searchsorted`` without ``right``)."""
    from mtune.modules.clamped_experts import ClampedSwiGLUExperts

    torch.manual_seed(0)
    block = MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True, router_name="router", router_bias=True,
                experts=ClampedSwiGLUExperts(EXPERTS, DIM, HIDDEN))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)  # gate/up values past the clamp's 7 too
    block = block.to(dtype).requires_grad_(False)
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(6)).to(dtype) * 3
    assert block.experts.can_group(x.view(-1, DIM))
    results = {}
    for path in ("loop", "grouped"):
        block.expert_compute = path
        results[path] = output_and_input_grad(block, x)
    for got, want in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(got, want, rtol=0, atol=atol * want.abs().max().item())


@pytest.mark.parametrize("path", ["auto", "loop"])
def test_nf4_experts_compile(path):
    """QLoRA's NF4 experts under torch.compile, grouped and in the loop: dynamo cannot build the NF4 parts the eager
    paths dequantize (torch 2.13 / torchao 0.18: an assertion on their symbolic sizes), so a compiled trace
    dequantizes each projection whole; output and input gradient equal eager's. Mutation seen failing: the parts
    built while compiling (the assertion)."""
    block = moe_block(torch.bfloat16).requires_grad_(False)
    for projection in block.experts.projections():
        projection.nf4 = True
        projection.quantize_()
    block.expert_compute = path
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    eager = output_and_input_grad(block, x)
    compiled = output_and_input_grad(torch.compile(block, backend="aot_eager"), x)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0.01 * want.abs().max().item())


@pytest.mark.parametrize("nf4", [False, True])
def test_the_grouped_experts_compile_in_one_graph(nf4):
    """dynamo traces the grouped path's own backward (the hidden rows' vector-Jacobian product by torch.func.vjp), so
    a compiled MoE block keeps its experts in the block's graph: one graph, no break, plain bf16 or NF4 experts.
    Mutation seen failing: torch.autograd.grad in that backward (breaks at every MoE layer: six graphs here)."""
    block = moe_block(torch.bfloat16).requires_grad_(False)
    if nf4:
        for projection in block.experts.projections():
            projection.nf4 = True
            projection.quantize_()
    block.expert_compute = "grouped"
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).requires_grad_()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _adapted_block(dtype, nf4=False, seed=0):
    """The test block with rank-8 LoRA factors on every expert projection (B nonzero, so every path counts), the
    base frozen (NF4 when ``nf4``)."""
    from mtune.modules.expert_linear import LoRAExpertLinear
    from mtune.modules.nf4_linear import is_nf4

    block = moe_block(dtype, seed=seed).requires_grad_(False)
    experts = block.experts
    for name in ("gate_proj", "up_proj", "down_proj"):
        lora = LoRAExpertLinear(getattr(experts, name), rank=8, alpha=16, quantize_base=nf4)
        with torch.no_grad():
            lora.lora_a.weight.normal_(0, 0.3)
            lora.lora_b.weight.normal_(0, 0.3)
        lora.lora_a.weight.requires_grad_(True)
        lora.lora_b.weight.requires_grad_(True)
        lora.quantize_()
        assert is_nf4(lora.weight) == nf4
        setattr(experts, name, lora)
    return block


@pytest.mark.parametrize("dtype, atol, nf4", [(torch.float32, 2e-5, False), (torch.bfloat16, 0.03, False),
                                              (torch.bfloat16, 0.03, True)], ids=["fp32", "bf16", "nf4"])
@pytest.mark.parametrize("tokens", [9, 2], ids=["every_expert", "experts_without_rows"])
def test_lora_experts_run_grouped_and_equal_the_loop(dtype, atol, nf4, tokens):
    """Per-expert LoRA factors on the grouped path (QLoRA's NF4 base too): output, input gradient and every factor's
    gradient equal the per-expert loop's (relative to each tensor's largest value); an expert without rows gets zero
    gradients. Mutations seen failing: B's gradient without the scaling; A's gradient halved; the LoRA term left out
    of the input gradient."""
    block = _adapted_block(dtype, nf4=nf4)
    x = torch.randn(2, tokens, DIM, generator=torch.Generator().manual_seed(7)).to(dtype)
    assert block.experts.can_group(x.view(-1, DIM))
    factors = [p for n, p in block.named_parameters() if "lora_" in n]
    results = {}
    for path in ("loop", "grouped"):
        block.expert_compute = path
        for p in factors:
            p.grad = None
        out, grad_x = output_and_input_grad(block, x)
        results[path] = [out, grad_x, *(p.grad.float() for p in factors)]
    for got, want in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(got, want, rtol=0, atol=atol * want.abs().max().item())
    if tokens == 2:  # 4 routed rows over 8 experts: some got none
        assert any(g.flatten(1).abs().sum(1).eq(0).any() for g in results["grouped"][2:])


def test_lora_experts_with_dropout_take_the_loop():
    from mtune.modules.expert_linear import LoRAExpertLinear

    block = moe_block(torch.bfloat16).requires_grad_(False)
    block.experts.up_proj = LoRAExpertLinear(block.experts.up_proj, rank=8, alpha=16, dropout=0.1)
    assert not block.experts.can_group(torch.randn(4, DIM, dtype=torch.bfloat16))


def test_lora_experts_on_an_nf4_base_compile():
    """The grouped path with per-expert factors (its own backward) under torch.compile (aot_eager): output, input
    gradient and every factor's gradient equal eager's."""
    block = _adapted_block(torch.bfloat16, nf4=True)
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    factors = [p for n, p in block.named_parameters() if "lora_" in n]
    results = []
    for fn in (block, torch.compile(block, backend="aot_eager")):
        for p in factors:
            p.grad = None
        results.append([*output_and_input_grad(fn, x), *(p.grad.float() for p in factors)])
    for got, want in zip(*results[::-1]):
        torch.testing.assert_close(got, want, rtol=0, atol=0.01 * want.abs().max().item())


def test_router_refuses_top_k_outside_the_experts_and_routes_bf16_in_fp32():
    """A top_k of 0 or past n_experts is refused. bf16 logits: probabilities in fp32 (oracle: softmax of the
    upcast logits here), so no ties from bf16 rounding flip experts and the renormalised weights round once."""
    from mtune.modules.moe import Router

    for top_k in (0, 5):
        with pytest.raises(ValueError, match="must be between 1 and n_experts=4"):
            Router(DIM, 4, top_k)
    torch.manual_seed(0)
    router = Router(DIM, EXPERTS, TOP_K, norm_topk_prob=True).to(torch.bfloat16)
    x = torch.randn(512, DIM, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits, weights, experts = router(x)
    probs, chosen = torch.softmax(logits.float(), dim=-1).topk(TOP_K)
    assert torch.equal(experts, chosen)
    assert torch.equal(weights, (probs / probs.sum(-1, keepdim=True)).to(torch.bfloat16))


def test_router_logits_are_kept_only_for_the_aux_loss_and_taken_once():
    """With the loss off a forward keeps no [tokens, n_experts] logits; with it on, router_aux_loss takes them
    (coef * n_experts * sum_e f_e P_e, written out here) and the next call finds none."""
    from mtune.modules.moe import router_aux_loss

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = block = moe_block()
    x = torch.randn(1, 6, DIM, generator=torch.Generator().manual_seed(2))
    block(x)
    assert block.router_logits is None and router_aux_loss(model) is None
    block.aux_loss_coef = 0.5
    block(x)
    probs = torch.softmax(x[0] @ block.gate.weight.T, dim=-1)
    picks = torch.zeros(EXPERTS).index_add_(0, probs.topk(TOP_K).indices.flatten(), torch.ones(6 * TOP_K))
    expected = 0.5 * EXPERTS * (picks / 6 * probs.mean(0)).sum()
    torch.testing.assert_close(router_aux_loss(model), expected, rtol=1e-6, atol=0)
    assert block.router_logits is None and router_aux_loss(model) is None


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouping_needs_16_byte_aligned_widths_and_frozen_experts_or_no_grad():
    """bf16 experts 20 wide (40 bytes a row: 8- but not 16-byte aligned) cannot group; trainable ones can under
    no_grad (nothing to train), not with gradients on."""
    from mtune.modules.moe import Experts

    x = torch.randn(4, DIM, dtype=torch.bfloat16)
    assert not Experts(EXPERTS, DIM, 20).to(torch.bfloat16).requires_grad_(False).can_group(x)
    experts = Experts(EXPERTS, DIM, HIDDEN).to(torch.bfloat16)
    assert not experts.can_group(x)
    with torch.no_grad():
        assert experts.can_group(x)


def test_clamped_swiglu_defaults_are_gpt_oss_published_ones():
    """alpha 1.702 and limit 7 by default (oracle: the formula written out with those numbers)."""
    from mtune.modules.clamped_experts import ClampedSwiGLUExperts

    gate_up = torch.randn(5, 2 * HIDDEN, generator=torch.Generator().manual_seed(3)) * 6
    gate, up = gate_up[:, 0::2].clamp(max=7.0), gate_up[:, 1::2].clamp(-7.0, 7.0)
    expected = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    got = ClampedSwiGLUExperts(EXPERTS, DIM, HIDDEN).hidden(gate_up)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # fp32 round-off of outputs up to ~60
