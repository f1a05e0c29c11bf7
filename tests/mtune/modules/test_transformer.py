"""The decoder against transformers' implementations, weights copied in memory (checkpoint files: test_hf.py)."""

import pytest
import torch

from mtune.models import build_model
from tests._helpers.models import FAMILY_CONFIGS, mtune_twin, tiny_hf_model

FAMILIES = list(FAMILY_CONFIGS)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
    hf = tiny_hf_model(family)
    model = mtune_twin(hf, family)
    # 100 tokens: past Llama 3.1's tiny "original" context (64) and Mistral's tiny sliding window (8).
    tokens = torch.randint(0, 512, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(tokens), hf(tokens).logits
    assert ours.shape == ref.shape == (2, 100, 512)
    assert (ours - ref).abs().max().item() <= 1e-5


def test_return_hidden_and_tied_head():
    hf = tiny_hf_model("llama3_2")
    model = mtune_twin(hf, "llama3_2")
    assert model.lm_head.weight is model.embed_tokens.weight
    tokens = torch.randint(0, 512, (1, 12))
    with torch.no_grad():
        hidden = model(tokens, return_hidden=True)
        assert hidden.shape == (1, 12, 256)
        torch.testing.assert_close(model.lm_head(hidden), model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama3_1", "mistral", "qwen3_5", "gemma4"])
def test_packed_batch_matches_documents_run_alone(family):
    # seeded: the weights came from whatever the global generator held after the tests before, and gemma4's packed
    # and per-document sums, taken in other orders, drift apart by up to 1.9e-5 on some draws (seeds 0-5)
    torch.manual_seed(0)
    model = build_model(family, "tiny", device="cpu").eval()
    gen = torch.Generator().manual_seed(2)
    # 16 > the mistral and gemma4 windows of 8; 70 > a Gated DeltaNet chunk of 64 (qwen3_5: its state restarts per
    # document); gemma4: keys and values shared across layers stay within their documents
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in (5, 11, 16, 70)]
    tokens = torch.cat(docs)[None]
    input_pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(tokens, input_pos=input_pos, document_ids=document_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    assert (packed - alone).abs().max().item() <= 1e-5


def test_blocks_take_tensors_only_and_build_on_meta():
    model = build_model("tiny")
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    x = torch.randn(1, 4, 256)
    cos, sin = model.rope(torch.arange(4)[None], x.dtype)
    assert model.layers[0](x, cos, sin).shape == (1, 4, 256)


@pytest.mark.parametrize("size", ["8B", "1B"])
def test_llama3_rope_frequencies_match_transformers_at_full_size(size):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mtune.models import model_args
    from mtune.modules.rotary import rope_inv_freq

    args = model_args("llama3_1" if size == "8B" else "llama3_2", size)
    config = LlamaConfig(hidden_size=args.dim, num_attention_heads=args.n_heads, head_dim=args.head_dim,
                         rope_parameters={**args.rope_scaling, "rope_theta": args.rope_theta})
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert torch.equal(rope_inv_freq(args.head_dim, args.rope_theta, args.rope_scaling), reference)


@pytest.mark.parametrize("scaling", [
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096),  # YaRN's defaults: truncate, betas
    dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=64),
    dict(rope_type="yarn", factor=40.0, beta_fast=16.0, mscale=1.0, mscale_all_dim=0.707,
         original_max_position_embeddings=4096),
    dict(rope_type="yarn", factor=4.0, beta_fast=128.0, attention_factor=1.25, original_max_position_embeddings=2048),
    dict(rope_type="proportional", partial_rotary_factor=0.25, factor=8.0),
], ids=["yarn_defaults", "yarn_untruncated", "yarn_mscale", "yarn_attention_factor", "proportional"])
def test_yarn_and_proportional_frequencies_match_transformers(scaling):
    """Oracle: transformers' rope init functions. theta=10 puts YaRN's ramp end past the last dimension (clamped
    there; with beta_fast=128 the ramp starts within the rotated half, so the clamp shows); the attention factor
    (given, from mscale ratios, or from ln(factor)) as transformers scales cos and sin."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mtune.modules.rotary import rope_inv_freq, yarn_attention_factor

    for theta in (10.0, 150000.0):
        max_len = int(scaling.get("factor", 1) * scaling.get("original_max_position_embeddings", 64))
        config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=max_len,
                             rope_parameters={**scaling, "rope_theta": theta})
        reference, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        torch.testing.assert_close(rope_inv_freq(64, theta, dict(scaling)), reference, rtol=1e-6, atol=0)
        if scaling["rope_type"] == "yarn":
            assert yarn_attention_factor(scaling) == pytest.approx(attention_factor, rel=1e-12)
