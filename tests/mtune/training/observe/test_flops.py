"""flops_per_token against torch's FlopCounterMode on a tiny model, and against the issue's worked figures."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mtune.training.memory.registry import MemoryConfig
from mtune.models import build_model
from mtune.modules.lora import apply_lora
from mtune.modules.loss import ChunkedCrossEntropyLoss, CrossEntropyLoss
from mtune.training.memory.techniques.activation_checkpointing.checkpoint import apply_activation_checkpointing
from mtune.training.observe.flops import flops_per_token, utilization

TINY = dict(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32, intermediate_dim=256, vocab_size=512,
            tie_embeddings=False)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
B, S = 2, 64


def _counted(lora=None, every_n=0, chunked=False, tie=False, policy="block", freeze_last=False):
    """(per-token FLOPs by aten op as FlopCounterMode counts one real training step, flops_per_token). ``chunked``:
    ChunkedCrossEntropyLoss, which recomputes the head's projection only when the head is adapted. ``freeze_last``:
    the last block's adapters frozen (its inputs still need gradients, for the blocks below)."""
    torch.manual_seed(0)
    model = build_model("llama3_2", "tiny", device="cpu", **{**TINY, "tie_embeddings": tie})
    if lora:
        apply_lora(model, lora, rank=4, alpha=8)
    if freeze_last:
        for name, param in model.layers[-1].named_parameters():
            param.requires_grad_("lora" not in name and param.requires_grad)
    if every_n:
        apply_activation_checkpointing(model, every_n, policy=policy)
    tokens = torch.randint(0, TINY["vocab_size"], (B, S))
    documents = torch.zeros(B, S, dtype=torch.long)
    documents[:, 30:] = 1  # two packed documents: a block-causal mask
    positions = torch.cat([torch.arange(30), torch.arange(S - 30)]).expand(B, S)
    loss_fn = ChunkedCrossEntropyLoss(4) if chunked else CrossEntropyLoss()
    # The math backend runs attention as bmm's that FlopCounterMode sees (the CPU flash kernel it does not count).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = model(tokens, input_pos=positions, document_ids=documents, return_hidden=chunked)
        loss, _ = loss_fn(out, tokens.roll(-1, 1), model.lm_head)
        loss.backward()
    per_op = {str(op): n / (B * S) for op, n in counter.get_flop_counts()["Global"].items()}
    recomputes = chunked and loss_fn.recomputes_projection(model.lm_head)
    memory = MemoryConfig(enable_activation_checkpointing=bool(every_n), activation_checkpointing_policy=policy,
                          activation_checkpointing_every_n_layers=every_n or 1)
    return per_op, flops_per_token(model, S, memory, loss_recomputes_projection=recomputes)


@pytest.mark.parametrize("case", [
    dict(),                                   # full fine-tune
    dict(tie=True),                           # tied output projection: its weight gradient counted once
    dict(lora=ALL),                           # LoRA everywhere: frozen bases cost one backward matmul
    dict(every_n=1),                          # checkpointing every block: hfu counts the recomputation
    dict(every_n=2, chunked=True),            # blocks 0 and 2; the chunked loss's gradients come with its forward
    dict(lora=ALL, every_n=1, chunked=True),
    dict(lora=ALL + ["lm_head"], chunked=True),  # adapted head: the chunked loss projects twice
    dict(every_n=1, policy="selective_op"),   # keeps matmul outputs: recomputes no counted FLOPs
    # Where autograd skips work (mutations seen failing on each): LoRA on the MLP only, so block 0's attention has
    # no backward (attention's backward counted whenever it runs); LoRA on the head only, so nothing below it needs
    # a gradient (the head's input gradient counted always); frozen adapters in the last block, whose input still
    # needs a gradient through A and B (``2r * out`` into B's input counted only when the adapters train).
    dict(lora=["gate_proj", "up_proj", "down_proj"]),
    dict(lora=["lm_head"]),
    dict(lora=ALL, freeze_last=True),
])
def test_matches_flop_counter_mode(case):
    per_op, fpt = _counted(**case)
    assert fpt.hardware == sum(per_op.values())
    head_recomputed = case.get("chunked") and "lm_head" in case.get("lora", [])
    if (not case.get("every_n") or case.get("policy") == "selective_op") and not head_recomputed:
        assert fpt.recompute == 0 and fpt.model == fpt.hardware
    if head_recomputed:
        assert fpt.recompute > 0


def test_gated_deltanet_layers_counted_by_hand():
    """Qwen3.5 tiny's forward FLOPs per token at 16 positions, counted by hand from the module docstring: per Gated
    DeltaNet layer (0 and 2) its projections (qkv 256 -> 512, z 256 -> 256, b and a 256 -> 4, out 256 -> 256), the
    causal convolution ``2 * taps * channels`` (4 taps on 512) and the recurrence ``6 * v_heads * k_dim * v_dim``
    (4 heads of 64 x 64), independent of the length; per full-attention layer (1 and 3) q (gated: 512 wide), k, v
    (128) and o, and attention over 16 keys (4 heads of 64); every layer's MLP (3 x 256 x 512); the tied head. A
    full fine-tune's backward is twice every term. Mutations seen failing: the recurrence counted as 4 (not 6) x
    k_dim x v_dim per head; the convolution left out."""
    linear = lambda i, o: 2 * i * o  # noqa: E731
    deltanet = linear(256, 512) + linear(256, 256) + 2 * linear(256, 4) + linear(256, 256) + 2 * 4 * 512 \
        + 6 * 4 * 64 * 64
    attention = linear(256, 512) + 2 * linear(256, 128) + linear(256, 256) + 4 * 16 * 4 * 64
    expected = 2 * (deltanet + attention) + 4 * 3 * linear(256, 512) + linear(256, 512)
    fpt = flops_per_token(build_model("qwen3_5", "tiny"), 16)
    assert fpt.forward == expected and fpt.backward == 2 * expected


@pytest.mark.parametrize("family, size, overrides", [
    ("gemma4", "tiny", {}),  # per-layer inputs: the decoder's per_layer_model_projection (dim -> n_layers * p)
    # Qwen3.5-MoE's blocks, full attention only (the DeltaNet's chunked kernel is not its model FLOPs): the shared
    # expert and its sigmoid gate (dim -> 1)
    ("qwen3_5", "tiny", dict(layer_types=["full_attention"] * 2, n_layers=2, n_experts=8, top_k=2,
                             moe_intermediate_dim=128, shared_expert_intermediate_dim=128)),
])
def test_every_linear_of_the_model_is_counted(family, size, overrides):
    """Full fine-tunes of models with linears outside the blocks' attention and MLP: flops_per_token equals
    FlopCounterMode's count of a real forward + backward. Bugs this found (fixed): Gemma 4's
    ``per_layer_model_projection`` and Qwen3.5-MoE's ``shared_expert_gate`` were not counted (1.18 MFLOPs and
    3 KFLOPs per token short here). Mutations seen failing: the shared expert left out; Gemma 4's per-layer gate
    and projection left out."""
    torch.manual_seed(0)
    model = build_model(family, size, device="cpu", **overrides)
    tokens = torch.randint(0, 512, (1, 16))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().square().mean().backward()
    assert flops_per_token(model, 16).hardware == counter.get_total_flops() / 16


def test_partial_lora_first_block_computes_no_input_gradients():
    # LoRA on q, v only: in block 0 the frozen embedding and norm mean no input gradient for q/k/v, and k_proj has
    # no backward at all. The matmuls match exactly; attention differs only where the math backend skips dK
    # (block 0), which the fused CPU kernel computes anyway, so flops_per_token counts it.
    per_op, fpt = _counted(lora=["q_proj", "v_proj"])
    linears = sum(n for op, n in per_op.items() if op != "aten.bmm")  # mm, and addmm for LoRA's B
    assert fpt.parts["linear"] + fpt.parts["adapters"] + fpt.parts["output"] == linears
    qk_grad_of_block0 = 2 * S * TINY["n_heads"] * TINY["head_dim"]
    assert fpt.parts["attention"] - qk_grad_of_block0 == per_op["aten.bmm"]


def _fixture_model():
    # The head-to-head benchmark's model: 30.9M parameters, 26.7M of them in matmuls (lm_head included).
    return build_model("llama3_2", "tiny", dim=512, n_layers=8, n_heads=8, n_kv_heads=2, head_dim=64,
                       intermediate_dim=1408, vocab_size=8192, tie_embeddings=False)


def test_issue_worked_figures():
    model = _fixture_model()  # on meta: nothing is allocated
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    a = 4 * 512 * 8 * 64 * 8  # attention forward per token at 512: 4 * seq * heads * head_dim * layers
    assert round(n / 1e6, 1) == 26.7 and round(a / 1e6, 1) == 8.4
    full = flops_per_token(model, 512)
    assert full.model == full.hardware == 6 * n + 3 * a
    assert full.model / 1e6 == pytest.approx(185.6, abs=0.05)
    # A chunked loss that recomputes (an adapted head): one more lm_head forward (2 * 512 * 8192) in hfu only.
    recomputed = flops_per_token(model, 512, loss_recomputes_projection=True)
    assert recomputed.hardware - recomputed.model == 2 * 512 * 8192

    apply_lora(model, ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], rank=8, alpha=16)
    lora = flops_per_token(model, 512)
    adapters = sum(p.numel() for name, p in model.named_parameters() if p.requires_grad)
    # The issue's closed form 4N + 3A + 6 * adapters, less what autograd never computes: block 0's q/k/v input
    # gradients (its input comes from the frozen embedding) and its q/v adapters' input gradients.
    skipped = 2 * 512 * (512 + 128 + 128) + 2 * 8 * 512 * 2
    assert lora.model == 4 * n + 3 * a + 6 * adapters - skipped
    assert lora.model / 1e6 == pytest.approx(135.6, rel=0.01)  # the issue's rounded figure: 134.6


def test_memory_config_decides_checkpointing():
    model = _fixture_model()
    off = flops_per_token(model, 256)
    every = flops_per_token(model, 256, MemoryConfig(enable_activation_checkpointing=True,
                                                     activation_checkpointing_every_n_layers=1))
    every4 = flops_per_token(model, 256, MemoryConfig(enable_activation_checkpointing=True,
                                                      activation_checkpointing_every_n_layers=4))
    assert off.recompute == 0 and every.model == off.model
    assert every4.recompute == pytest.approx(every.recompute * 2 / 8)  # blocks 0 and 4 of 8
    # Attention grows with the row: twice the sequence, twice the attention, the same projections.
    longer = flops_per_token(model, 512)
    assert longer.parts["attention"] == 2 * off.parts["attention"]
    assert longer.parts["linear"] == off.parts["linear"]
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(model, 0)


def test_utilization():
    assert utilization(185.6e6, 1000.0, 204e9) == pytest.approx(0.9098, abs=1e-4)
    assert utilization(1.0, 1.0, 0.0) == 0.0


def test_mean_document_length_is_per_batch_not_per_row():
    """Two rows of a packed micro-batch: documents of 3 and 1 tokens, then 1 and 3. The keys a query is counted
    against, token-weighted: (3² + 1² + 1² + 3²) / 8 = 2.5 positions, whatever the batch size.

    Mutation checked: ``mean_document_length`` dividing by the row length ``s`` instead of ``b * s`` (5.0 here:
    normalised per row) fails; every other packed FLOPs test uses batch 1, where the two agree."""
    from mtune.training.observe.flops import mean_document_length

    ids = torch.tensor([[0, 0, 0, 1], [0, 1, 1, 1]])
    assert mean_document_length(ids) == 20 / 8
    assert mean_document_length(ids[:1]) == 10 / 4  # one row: the same convention
