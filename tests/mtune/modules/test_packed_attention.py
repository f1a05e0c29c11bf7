"""Packed attention by segment boundaries against the dense-mask path (the oracle): logits and every gradient."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mtune.models import build_model
from mtune.modules.packed_attention import (Segments, batch_segments, document_boundaries, segment_attention,
                                            segment_bound, segment_kernel)
from tests._helpers.training import LargestTensor


def packed_batch(lengths_per_row, vocab=512, pad_to=None, seed=0):
    """Rows of documents with the given lengths (the last row padded to ``pad_to`` as the collator does)."""
    gen = torch.Generator().manual_seed(seed)
    s = pad_to or sum(lengths_per_row[0])
    tokens, pos, ids = [], [], []
    for lengths in lengths_per_row:
        lengths = list(lengths) + ([s - sum(lengths)] if sum(lengths) < s else [])  # padding: its own document
        tokens.append(torch.randint(0, vocab, (s,), generator=gen))
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
        ids.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(tokens), torch.stack(pos), torch.stack(ids)


def logits_and_grads(model, kernel, tokens, input_pos, document_ids):
    model.attention_kernel = kernel
    model.zero_grad()
    logits = model(tokens, input_pos=input_pos, document_ids=document_ids)
    (logits.float().square().mean() + logits[:, :, 0].sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_round_off(actual, expected, name="", scale=1e-5):
    """fp32 round-off: every element within ``scale`` times the tensor's largest magnitude (seen: 2e-7 to 7e-7)."""
    error = (actual - expected).abs().max().item()
    assert error <= scale * expected.abs().max().item(), f"{name}: max error {error}"


def assert_same(model, tokens, input_pos=None, document_ids=None):
    ref, ref_grads = logits_and_grads(model, "dense_mask", tokens, input_pos, document_ids)
    out, grads = logits_and_grads(model, "segments", tokens, input_pos, document_ids)
    assert_round_off(out, ref, "logits")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_round_off(grad, ref_grads[name], name)


# Row 0: mixed lengths (11 and 13 exceed the mistral tiny window of 8, 1 is a one-token document); row 1: one
# document fills the row exactly; row 2: documents then padding.
ROWS = [(5, 11, 1, 13, 2), (32,), (7, 9)]


@pytest.mark.parametrize("family", ["llama3_1", "qwen2_5", "mistral", "gemma4"])  # gemma4: shared keys, values
def test_segments_equal_dense_mask(family):
    torch.manual_seed(0)
    model = build_model(family, "tiny", device="cpu")
    for name, p in model.named_parameters():  # norms and biases off their ones / zeros: their gradients checked too
        p.data.add_(torch.randn_like(p), alpha=0.05)
        if name.endswith(("q_norm.weight", "k_norm.weight")) and family == "gemma4":
            p.data.mul_(0.3)  # unscaled scores of random normed heads: see tests/_helpers/models.py
    assert_same(model, *packed_batch(ROWS, pad_to=32))


def test_sliding_window_without_packing_equal_dense_mask():
    model = build_model("mistral", "tiny", device="cpu")
    tokens = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(3))
    assert_same(model, tokens)  # one segment per row, 30 > the window of 8


def test_auto_uses_the_dense_mask_only_for_short_rows():
    from mtune.modules.packed_attention import DENSE_MASK_UP_TO

    model = build_model("llama3_1", "tiny", device="cpu")
    assert model.attention_kernel == "auto"
    for s, dense in [(DENSE_MASK_UP_TO, True), (DENSE_MASK_UP_TO + 1, False)]:
        _, input_pos, ids = packed_batch([(s // 2, s - s // 2)])
        mask, _, segments = model._attention_layout(input_pos, ids, caching=False)
        assert (mask is not None, segments is None) == (dense, dense)


def test_document_boundaries():
    _, _, ids = packed_batch(ROWS, pad_to=32)
    assert document_boundaries(ids, 3, 32).tolist() == [0, 5, 16, 17, 30, 32, 64, 71, 80, 96]
    assert document_boundaries(None, 2, 5, torch.device("cpu")).tolist() == [0, 5, 10]
    assert document_boundaries(ids, 3, 32).dtype == torch.int32



@pytest.mark.parametrize("family", ["llama3_1", "mistral"])
def test_no_tensor_of_s_squared_elements(family):
    """No step of the segments kernel makes a tensor of s² elements; on llama3_1 the dense-mask kernel, run once as
    the oracle, shows the probe does see one. (The mistral case once also asserted ``largest.get("dense_mask",
    s * s) >= s * s``, which compared s² with itself.) Mutation checked: the segments kernel never chosen in
    ``transformer.py`` (every call on the dense mask) fails both families' second assertion."""
    s = 768  # s² = 590K elements; the largest activations are [s, 512] (logits, MLP) = 393K
    model = build_model(family, "tiny", device="cpu")
    tokens, input_pos, ids = packed_batch([(200, 24, 500)], pad_to=s)
    kernels = ("dense_mask", "segments") if family == "llama3_1" else ("segments",)  # the oracle sees s² once
    largest = {}
    for kernel in kernels:
        model.attention_kernel = kernel
        with LargestTensor() as seen:
            model(tokens, input_pos=input_pos, document_ids=ids).sum().backward()
        largest[kernel] = seen.largest
    if family == "llama3_1":  # the oracle: the dense mask does build an s x s tensor (this probe can see one)
        assert largest["dense_mask"] >= s * s
    assert largest["segments"] <= s * 512  # no tensor above the largest activation: no s x s


def test_fake_tensors_run_one_segment_per_row():
    model = build_model("mistral", "tiny", device="cpu")
    model.attention_kernel = "segments"
    tokens, input_pos, ids = packed_batch(ROWS, pad_to=32)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_ids = mode.from_tensor(ids)
        cu = document_boundaries(fake_ids, 3, 32)
        assert cu.shape == (4,)  # row boundaries: the values of document_ids are unknown
        out = model(mode.from_tensor(tokens), input_pos=mode.from_tensor(input_pos), document_ids=fake_ids)
        out.sum().backward()
    assert out.shape == (3, 32, 512)


def test_segment_attention_alone_matches_per_document_sdpa():
    # One row, three documents, GQA: each document's slice of the output is causal SDPA over that document alone.
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 20, 16, generator=gen) for h in (4, 2, 2))
    segments = Segments(torch.tensor([0, 6, 7, 20], dtype=torch.int32), 13)
    out = segment_attention(q, k, v, segments).view(1, 20, 4, 16).transpose(1, 2)
    for a, e in [(0, 6), (6, 7), (7, 20)]:
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e],
                                                               is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out[:, :, a:e], ref, rtol=0, atol=1e-6)


def _varlen_as_cuda_allocates(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), enable_gqa=False):
    """A CPU stand-in for ``varlen_attn``: causal SDPA per segment of the flat ``[tokens, heads, d]`` inputs, into an
    output allocated as the CUDA kernel (and torch's fake kernel) allocate it, ``torch.empty_like(query)``, which keeps
    a dense query's strides. Like the kernel's grid, it computes the first ``max_q`` queries of each segment only
    (the rest stay NaN here), so a bound below a segment's length shows."""
    out = torch.full_like(q, float("nan"))
    bounds = cu_q.tolist()
    for a, e in zip(bounds, bounds[1:]):
        seg = torch.nn.functional.scaled_dot_product_attention(
            *(t[a:e].transpose(0, 1) for t in (q, k, v)), is_causal=True, enable_gqa=enable_gqa)
        out[a:min(e, a + max_q)] = seg.transpose(0, 1)[:max_q]
    return out


def test_varlen_output_of_one_row_reaches_the_projection(monkeypatch):
    """One packed row of queries laid out ``[b, h, s, d]`` (Qwen3.5's gated attention makes them so): the varlen
    kernel's flat queries are then a strided view, its output keeps those strides, and the ``[b, s, h * d]`` result
    must still come out (it failed with a view error on an H100, 2026-11-26). Equal to the per-segment path."""
    from mtune.modules import packed_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 20, 16, generator=gen) for h in (4, 2, 2))
    segments = Segments(torch.tensor([0, 6, 7, 20], dtype=torch.int32), 13)
    expected = segment_attention(q, k, v, segments)  # sdpa_per_segment on the CPU
    monkeypatch.setattr(packed_attention, "_VARLEN", [(_varlen_as_cuda_allocates, {"window_size", "enable_gqa"})])
    monkeypatch.setattr(packed_attention, "segment_kernel", lambda *args, **kwargs: "varlen_flash")
    torch.testing.assert_close(segment_attention(q, k, v, segments), expected, rtol=0, atol=1e-6)


def test_segment_bound_is_the_next_power_of_two_within_the_row():
    assert [segment_bound(n, 4096) for n in (1, 90, 128, 129, 1000, 3000, 4096)] == [128, 128, 128, 256, 1024,
                                                                                       4096, 4096]
    assert segment_bound(None, 4096) == 4096  # nothing known: the row
    assert segment_bound(300, 200) == 200 and segment_bound(5, 64) == 64  # never past the row


def test_a_segment_longer_than_its_bound_is_refused():
    q = k = v = torch.zeros(1, 2, 20, 8)
    with pytest.raises(ValueError, match="^a segment of 13 tokens, above its Segments' longest=12$"):
        segment_attention(q, k, v, Segments(torch.tensor([0, 6, 7, 20], dtype=torch.int32), 12))


# Documents of at most 90 tokens in rows of 512 (padding 60 and 17 tokens): the varlen bound is 128, not 512.
BOUNDED_ROWS = [(90, 37, 85, 64, 70, 50, 16, 40), (77, 88, 20, 90, 90, 90, 40)]


def test_the_collators_bound_reaches_the_varlen_kernel(monkeypatch):
    """A packed batch from the collator through the training loop's forward, with the varlen kernel (the CPU
    stand-in, which computes only the first ``max_q`` queries of each segment): every call gets the batch's
    longest document rounded up, 128 where the row length was passed before, and the loss is the dense mask's."""
    from mtune.data.collate import collate_padded
    from mtune.modules import packed_attention
    from mtune.modules.loss import ChunkedCrossEntropyLoss
    from mtune.training.loop import forward_loss

    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu")
    tokens, input_pos, ids = packed_batch(BOUNDED_ROWS, pad_to=512)
    lengths = [(ids[r] != ids[r, -1]).sum() for r in range(2)]  # each row's tokens before its padding
    batch = collate_padded([{"tokens": tokens[r, :n].tolist(), "labels": tokens[r, 1:n + 1].tolist(),
                             "input_pos": input_pos[r, :n].tolist(), "document_ids": ids[r, :n].tolist()}
                            for r, n in enumerate(lengths)], pad_id=0, pad_to_multiple_of=512)
    assert batch["tokens"].shape == (2, 512) and batch["longest_document"] == 90
    model.attention_kernel = "dense_mask"
    expected, _ = forward_loss(model, batch, ChunkedCrossEntropyLoss())
    bounds = []

    def recording(*args, **kwargs):
        bounds.append(args[5:7])
        return _varlen_as_cuda_allocates(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "_VARLEN", [(recording, {"window_size", "enable_gqa"})])
    monkeypatch.setattr(packed_attention, "segment_kernel", lambda *args, **kwargs: "varlen_flash")
    model.attention_kernel = "segments"
    loss, _ = forward_loss(model, batch, ChunkedCrossEntropyLoss())
    assert bounds == [(128, 128)] * 2  # each of the two layers
    assert_round_off(loss, expected, "loss")


@torch.library.custom_op("mtune_tests::varlen_stand_in", mutates_args=())
def _varlen_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
               max_k: int, window_size: list[int], enable_gqa: bool = False) -> torch.Tensor:
    return _varlen_as_cuda_allocates(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa)


@_varlen_op.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa=False):
    return torch.empty_like(q)


def test_a_compiled_block_takes_each_new_bound_without_recompiling(monkeypatch):
    """Four batches whose bounds are 128, 256, 512 and 1024 through one compiled block, the varlen kernel a custom op
    as torch's is: two graphs (dynamo specialises the first call, and makes the bound and the number of segments
    symbolic at the second), not one per bound; every output equal to the eager block's."""
    from mtune.modules import packed_attention

    monkeypatch.setattr(packed_attention, "_VARLEN", [(_varlen_op, {"window_size", "enable_gqa"})])
    monkeypatch.setattr(packed_attention, "segment_kernel", lambda *args, **kwargs: "varlen_flash")
    torch.manual_seed(0)
    model = build_model("llama3_1", "tiny", device="cpu")
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    block = model.layers[0]
    compiled = torch.compile(block, backend=counting)
    for longest in (100, 200, 400, 1000):
        lengths = [longest] * (1024 // longest) + [1024 % longest]  # row-filling documents of at most `longest`
        tokens, input_pos, ids = packed_batch([lengths], seed=longest)
        segments = batch_segments(ids, 1, 1024, longest=longest)
        assert segments.longest == segment_bound(longest, 1024)
        x = model.embed_tokens(tokens)
        cos, sin = model.kinds["attention"].rope(input_pos, x.dtype)
        with torch.no_grad():
            assert_round_off(compiled(x, cos, sin, None, None, segments), block(x, cos, sin, None, None, segments))
    assert len(graphs) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_flash_equals_dense_mask_on_cuda():
    model = build_model("mistral", "tiny", device="cuda").to(torch.bfloat16)
    tokens, input_pos, ids = (t.cuda() for t in packed_batch(ROWS, pad_to=32))
    assert segment_kernel(torch.empty(1, device="cuda", dtype=torch.bfloat16), window=8) == "varlen_flash"
    ref, ref_grads = logits_and_grads(model, "dense_mask", tokens, input_pos, ids)
    out, grads = logits_and_grads(model, "segments", tokens, input_pos, ids)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for name, grad in grads.items():
        torch.testing.assert_close(grad.float(), ref_grads[name].float(), rtol=5e-2, atol=5e-2, msg=name)


@pytest.mark.slow
def test_one_optimizer_step_at_64k_tokens():
    """A real 65,536-token packed row (documents of 20 to 2,000 tokens) through forward, backward and AdamW: the
    long-context step runs at all on a CPU, in bounded memory (no s² tensor: the dense mask alone would be 4 GiB)."""
    from mtune.modules.lora import apply_lora
    from mtune.modules.tiled_mlp import apply_tiled_mlp

    torch.manual_seed(0)
    model = apply_tiled_mlp(apply_lora(build_model("llama3_1", "tiny", device="cpu"),
                                       ["q_proj", "k_proj", "v_proj", "o_proj"], rank=8, alpha=16), 8)
    gen = torch.Generator().manual_seed(5)
    lengths, s = [], 65536
    while sum(lengths) < s:
        lengths.append(min(int(torch.randint(20, 2000, (1,), generator=gen)), s - sum(lengths)))
    tokens, input_pos, ids = packed_batch([lengths], pad_to=s)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with LargestTensor() as seen:
        logits = model(tokens, input_pos=input_pos, document_ids=ids)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:])
        loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and seen.largest <= s * 512  # the logits; nothing of s² = 4.3e9 elements
