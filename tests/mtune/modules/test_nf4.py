"""QLoRA: frozen base weights stored as torchao NF4."""

import copy

import pytest

import torch

from mtune.models import build_model
from mtune.modules.lora import LoRALinear, apply_lora
from mtune.modules.lora_state import lora_state_dict
from mtune.modules.nf4_linear import FrozenNF4Linear, dequantize, is_nf4
from mtune.training.observe.memory_stats import saved_for_backward_bytes

TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(5))


def _bytes(t):
    if is_nf4(t):  # the NF4 codes, block scales (8-bit), scale-of-scales and lookup table
        return sum(getattr(t, name).numel() * getattr(t, name).element_size() for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def _qlora_pair():
    torch.manual_seed(0)
    bf16 = build_model("llama3_1", "tiny", device="cpu", dtype=torch.bfloat16)
    qlora = copy.deepcopy(bf16)
    apply_lora(bf16, ["q_proj", "v_proj"], rank=8, alpha=16)
    apply_lora(qlora, ["q_proj", "v_proj"], rank=8, alpha=16, quantize_base=True)
    with torch.no_grad():
        for p in lora_state_dict(bf16).values():
            p.normal_(0, 0.02)
    qlora.load_state_dict(lora_state_dict(bf16), strict=False)
    return bf16.eval(), qlora.eval()


def test_base_weights_are_nf4_at_quarter_size():
    bf16, qlora = _qlora_pair()
    block_linears = [m for m in qlora.layers.modules() if isinstance(m, (LoRALinear, FrozenNF4Linear))]
    assert len(block_linears) == 2 * 7 and all(is_nf4(m.weight) for m in block_linears)
    assert sum(isinstance(m, FrozenNF4Linear) for m in block_linears) == 2 * 5
    assert not is_nf4(qlora.lm_head.weight)  # untargeted lm_head stays in the model dtype
    nf4_bytes = sum(_bytes(m.weight) for m in block_linears)
    bf16_bytes = sum(m.weight.numel() * 2 for m in block_linears)
    # Measured 0.2581 on the tiny model (0.25 for the 4-bit codes + 8-bit block scales + per-tensor tables;
    # benchmarks/results/tiny_memory_figures/nf4.json).
    assert 0.25 < nf4_bytes / bf16_bytes < 0.275


def test_qlora_forward_matches_lora_on_dequantized_weights():
    bf16, qlora = _qlora_pair()
    dequantized = copy.deepcopy(bf16)
    with torch.no_grad():
        for (name, p), (_, q) in zip(dequantized.named_parameters(), qlora.named_parameters()):
            p.copy_(dequantize(q))
        ref, ours, exact = bf16(TOKENS).float(), qlora(TOKENS).float(), dequantized(TOKENS).float()
    assert ours.dtype == torch.float32 and qlora(TOKENS).dtype == torch.bfloat16  # compute in the model dtype
    # Same computation as bf16 LoRA over the dequantized weights: equal up to bf16 rounding.
    assert (ours - exact).abs().max().item() <= 0.02
    # Against the unquantized bf16 model: NF4 rounding shows (measured relative error 0.17 on random weights,
    # benchmarks/results/tiny_memory_figures/nf4.json).
    assert ((ours - ref).norm() / ref.norm()).item() < 0.3


def test_qlora_trains_only_adapters_and_base_stays_nf4():
    _, qlora = _qlora_pair()
    qlora.train()
    opt = torch.optim.AdamW([p for p in qlora.parameters() if p.requires_grad], lr=1e-3)
    qlora(TOKENS).float().logsumexp(-1).mean().backward()
    opt.step()
    assert all(is_nf4(m.weight) for m in qlora.layers.modules() if isinstance(m, FrozenNF4Linear))
    grads = {n: p.grad for n, p in qlora.named_parameters() if p.grad is not None}
    assert set(grads) == set(lora_state_dict(qlora)) and all(g.abs().sum() > 0 for g in grads.values())


def test_compiled_nf4_and_plain_linears_trace_without_graph_breaks():
    # torchao is imported lazily (mtune/modules/nf4_linear.py); the hot path must still trace as one graph, or every
    # compiled QLoRA block would split at each linear (a cached importer did: QLoRA compiled 0.89x, +0.3 GiB RSS)
    import torch._dynamo

    from mtune.modules.nf4_linear import linear_maybe_nf4, quantize_nf4

    x = torch.randn(4, 256)
    for weight in (torch.randn(128, 256), quantize_nf4(torch.randn(128, 256))):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda x, w: linear_maybe_nf4(x, w) * 2)(x, weight)
        assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_compiled_nf4_linear_saves_what_a_bf16_frozen_linear_saves(checkpointed):
    """Compiled, an NF4 linear must recompute its dequantized weight in backward, not keep it: two frozen linears
    with a GELU between, compiled, save exactly what the same two linears with bf16 weights save, with and without
    a checkpointed region around them, and give the eager NF4 path's output and input gradient. Mutation seen
    failing: torchao's linear_nf4 under compile, which keeps the dequantized weights without checkpointing (on
    torch 2.13 and 2.11) and with it (on torch 2.11: 8B QLoRA on an H100 saved 34 GiB where bf16 LoRA saved 2.2,
    docs/benchmarks.md)."""
    from torch.utils.checkpoint import checkpoint

    from mtune.modules.nf4_linear import FrozenNF4Linear

    torch.manual_seed(0)
    torch._dynamo.reset()
    nf4 = torch.nn.Sequential(FrozenNF4Linear(torch.randn(256, 128, dtype=torch.bfloat16) * 0.05), torch.nn.GELU(),
                              FrozenNF4Linear(torch.randn(128, 256, dtype=torch.bfloat16) * 0.05))
    plain = torch.nn.Sequential(torch.nn.Linear(128, 256, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(256, 128, bias=False)).to(torch.bfloat16)
    for source, target in ((nf4[0], plain[0]), (nf4[2], plain[2])):
        target.weight = torch.nn.Parameter(dequantize(source.weight).detach(), requires_grad=False)

    def run(module, x, compiled):
        forward = (lambda t: checkpoint(module, t, use_reentrant=False)) if checkpointed else module
        return torch.compile(forward)(x) if compiled else forward(x)

    x = torch.randn(2, 64, 128, dtype=torch.bfloat16)
    results = {}
    for name, module, compiled in (("nf4", nf4, True), ("plain", plain, True), ("eager", nf4, False)):
        xg = x.clone().requires_grad_()

        def step():
            out = run(module, xg, compiled)
            out.float().square().sum().backward()
            results[name] = (out.detach(), xg.grad)

        results[name + " bytes"] = saved_for_backward_bytes(step, module)
    assert results["nf4 bytes"] == results["plain bytes"]
    for compiled, plain, eager in zip(results["nf4"], results["plain"], results["eager"]):
        torch.testing.assert_close(compiled, plain, rtol=1.6e-2, atol=1e-2)  # bf16: fused and unfused round apart
        torch.testing.assert_close(compiled, eager, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("shape, dtype", [((128, 256), torch.bfloat16), ((512, 1024), torch.float32)])
def test_a_fake_weight_gets_the_layout_torchao_quantizes_a_real_one_to(shape, dtype):
    # the planner quantizes fake weights by building the layout directly: every inner tensor as to_nf4 makes it
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mtune.modules.nf4_linear import quantize_nf4
    from mtune.training.memory.tensor_bytes import tensor_bytes

    real = quantize_nf4(torch.randn(*shape, dtype=dtype))
    with FakeTensorMode():
        fake = quantize_nf4(torch.empty(*shape, dtype=dtype))
    names, _ = real.__tensor_flatten__()
    assert names == fake.__tensor_flatten__()[0]
    for name in names:
        a, b = getattr(real, name), getattr(fake, name)
        assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), name
    for attr in ("block_size", "n_blocks", "scaler_block_size", "shape", "dtype", "requires_grad"):
        assert getattr(real, attr) == getattr(fake, attr), attr
    assert tensor_bytes(real) == tensor_bytes(fake)


def test_is_nf4_adds_no_guard_that_a_later_import_breaks():
    """A compiled block asks is_nf4 of each weight; asking through sys.modules made torch.compile guard on its
    length, so any import between two steps recompiled every block (seen on an H100 as a 2-3 s second step,
    docs/benchmarks.md). Mutation: the sys.modules lookup back in is_nf4 compiles twice here."""
    import sys
    import types

    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    weight = torch.randn(4, 4)

    @torch.compile(backend=counter)
    def step(x):
        return x * 2 if is_nf4(weight) else x + 1

    torch._dynamo.reset()
    x = torch.randn(4)
    step(x)
    sys.modules["_mtune_test_late_import"] = types.ModuleType("_mtune_test_late_import")  # an import between steps
    try:
        torch.testing.assert_close(step(x), x + 1)
    finally:
        del sys.modules["_mtune_test_late_import"]
    assert counter.frame_count == 1


def test_is_nf4_knows_a_torchao_weight_made_before_mtune_imported_torchao(monkeypatch):
    """Before mtune made an NF4 weight (its torchao handle unset), a weight torchao made is still NF4 and a plain
    one is not. Mutation: answering False while the handle is unset fails this."""
    from mtune.modules import nf4_linear

    weight = nf4_linear.quantize_nf4(torch.randn(128, 128))
    monkeypatch.setattr(nf4_linear, "_nf4", None)
    assert is_nf4(weight) and not is_nf4(torch.randn(128, 128))


@pytest.mark.parametrize("shape, ranks, scaler_block", [((2, 64, 128), 1, 128), ((512, 64), 8, 64)])
def test_a_fake_weight_with_smaller_scaler_blocks_gets_torchaos_layout(shape, ranks, scaler_block):
    """An expert stack whose experts hold 128 scales, and a 2-D weight split over 8 ranks (64 scales a rank), quantize
    their scales in blocks under 256: a fake weight (the planner's) is laid out as torchao's ``to_nf4`` lays out the
    real one with that block, ``scaler_block_size`` included (the planner's dequantization reads it). Mutation seen
    failing: _nf4_layout giving the tensor torchao's default 256 instead of the weight's own scaler block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mtune.modules.nf4_linear import _nf4_api, quantize_nf4

    torch.manual_seed(0)
    real = _nf4_api().to_nf4(torch.randn(*shape).reshape(-1, shape[-1]), 64, scaler_block)
    with FakeTensorMode():
        fake = quantize_nf4(torch.empty(*shape), ranks=ranks)
    for name in real.__tensor_flatten__()[0]:
        a, b = getattr(real, name), getattr(fake, name)
        assert (a.shape, a.dtype, a.stride()) == (b.shape, b.dtype, b.stride()), name
    for attr in ("block_size", "n_blocks", "scaler_block_size", "shape", "dtype"):
        assert getattr(real, attr) == getattr(fake, attr), attr


def test_a_row_chunk_owns_its_codes_and_scales_and_keeps_their_values():
    """A rank's rows of an NF4 weight (as fully_shard splits it) hold storage of their own size only, so the whole
    weight can be freed, and dequantize to the whole weight's rows. Mutation seen failing: the chunk's codes and
    scales kept as views of the whole weight's (each rank would keep every rank's bytes alive)."""
    from mtune.modules.nf4_linear import nf4_row_chunk, quantize_nf4

    torch.manual_seed(0)
    weight = quantize_nf4(torch.randn(512, 64, dtype=torch.bfloat16))
    for index in range(2):
        chunk = nf4_row_chunk(weight, 2, index)
        for name in ("quantized_scalers", "quantization_factor", "quantized_data"):
            inner = getattr(chunk, name)
            assert inner.untyped_storage().nbytes() == inner.numel() * inner.element_size(), name
        assert torch.equal(chunk.get_original_weight(), weight.get_original_weight()[256 * index:256 * (index + 1)])


def test_an_nf4_part_is_its_block_of_the_whole_weights_rows():
    """nf4_part (one expert's share of a stack, as the grouped experts dequantize it) gives the rows of
    ``torch.chunk`` over torchao's dequantization of the whole weight, block ``index`` and no other. Mutation seen
    failing: the parts taken in reverse order (``parts - 1 - index``)."""
    from mtune.modules.nf4_linear import nf4_part, quantize_nf4

    torch.manual_seed(0)
    weight = quantize_nf4(torch.randn(4, 64, 128, dtype=torch.bfloat16))
    whole = weight.get_original_weight()
    for index in range(4):
        assert torch.equal(nf4_part(weight, 4, index).get_original_weight(), whole.chunk(4)[index]), index


def test_a_frozen_nf4_linear_is_f_linear_over_torchaos_values_with_its_bias_and_the_inputs_dtype():
    """An fp32 weight quantized to NF4 with a bias, fed bf16: the output and the input's gradient are F.linear's over
    torchao's dequantized weight cast to bf16, plus the bias; the layer reports nn.Linear's features. Mutations seen
    failing: the bias dropped from forward; the dequantized weight not cast to the input's (forward) or the
    gradient's (backward) dtype; in_features and out_features swapped."""
    torch.manual_seed(0)
    weight, bias = torch.randn(256, 128) * 0.05, torch.randn(256, dtype=torch.bfloat16)
    layer = FrozenNF4Linear(weight, bias)
    assert (layer.in_features, layer.out_features) == (128, 256)
    dense = layer.weight.get_original_weight().bfloat16()
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    grad = torch.randn(3, 256, dtype=torch.bfloat16)
    results = []
    for forward in (layer, lambda t: torch.nn.functional.linear(t, dense) + bias):
        xg = x.clone().requires_grad_()
        out = forward(xg)
        out.backward(grad)
        results.append((out, xg.grad))
    for ours, want in zip(*results):
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, want)
