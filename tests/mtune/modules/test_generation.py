"""Generation with the KV cache against transformers' ``generate``."""

import pytest
import torch

from mtune.modules.generation import generate, sample_next
from tests._helpers.models import mtune_twin, tiny_hf_model


@pytest.mark.parametrize("family", ["llama3_1", "mistral", "qwen2_5", "qwen3", "phi4", "gemma3"])
def test_greedy_generation_matches_transformers(family):
    hf = tiny_hf_model(family)
    model = mtune_twin(hf, family)
    prompt = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    # 40 new tokens run far past Mistral's and Gemma 3's tiny sliding window (8), which the cache mask must honour
    # (Gemma 3: on its sliding layers only). 50 tokens stay within Phi-4's tiny 64-token original context: decoding
    # across it (short factors in the cache, long ones after) is not compared.
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    ours = generate(model, prompt, max_new_tokens=40)
    assert ours.shape == (2, 50)
    assert torch.equal(ours, ref)
    assert not model.caches_are_enabled()


def test_greedy_generation_of_phi4_14B_kind_matches_transformers():
    """Phi-4 (14B)'s kind: the whole head rotated, plain RoPE with base 250,000, untied embeddings; 70 new tokens run
    past the tiny config's 64-token original context, which no longer switches factors."""
    hf = tiny_hf_model("phi4", rope_scaling=None, rope_theta=250000.0, partial_rotary_factor=1.0,
                       tie_word_embeddings=False)
    model = mtune_twin(hf, "phi4", rope_scaling=None, rope_theta=250000.0, partial_rotary_factor=1.0,
                       tie_embeddings=False)
    assert model.rope.head_dim == model.args.head_dim
    prompt = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(2))
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=70, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, max_new_tokens=70), ref)


@pytest.mark.parametrize("family", ["llama3_1", "gemma3"])  # gemma3: its own final norm (1 + weight)
def test_a_prompt_runs_the_head_on_its_last_position_alone(family):
    """``last_only`` (what generation's prompt asks): the last position's logits, equal to the full forward's, and the
    head run on one row of ``[b, 1, dim]`` instead of ``[b, s, dim]``. Mutation seen failing: the norm skipped."""
    model = mtune_twin(tiny_hf_model(family), family).eval()
    tokens = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    heads = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: heads.append(tuple(i[0].shape)))
    with torch.no_grad():
        full, last = model(tokens), model(tokens, last_only=True)
    hook.remove()
    assert heads == [(2, 12, model.lm_head.in_features), (2, 1, model.lm_head.in_features)]
    torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-6)


def test_stop_tokens_end_generation_and_pad_finished_rows():
    hf = tiny_hf_model("llama3_1")
    model = mtune_twin(hf, "llama3_1")
    prompt = [5, 17, 42]
    free = generate(model, prompt, max_new_tokens=8)[0]
    stop = int(free[5])  # the third generated token
    stopped = generate(model, prompt, max_new_tokens=8, stop_tokens=[stop])[0]
    first = (free[3:] == stop).nonzero()[0].item() + 3
    assert torch.equal(stopped, free[: first + 1])


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=gen)) for _ in range(50)}
    assert draws == {2, 3}
    # softmax of [0,1,2,3] puts 0.644 on token 3 and 0.237 on token 2: top_p=0.7 keeps exactly those two.
    draws = {int(sample_next(logits, 1.0, top_p=0.7, generator=gen)) for _ in range(50)}
    assert draws == {2, 3}
    assert int(sample_next(logits)) == 3
