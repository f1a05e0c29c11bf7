"""Qwen3.5-MoE (text) against transformers and peft: a tiny Qwen3_5MoeForCausalLM and the multimodal wrapper's text
tower, saved by transformers, load with the same logits and are saved back in the hub layout; LoRA and QLoRA steps
lower the loss and the adapter loads in peft; the 35B-A3B size builds as transformers builds it.

The tiny shape: Qwen3.5's tiny blocks (a Gated DeltaNet layer, then gated attention) with 8 experts of 128 (each
projection 128 x 256, NF4-friendly), 2 per token, and a shared expert of 256 behind its sigmoid gate.

Mutations seen failing: the top-k weights not renormalised (logits off); the shared expert sized by
``moe_intermediate_size`` (a shape error on load); the shared expert's gate not kept out of QLoRA's NF4."""

import json
import logging
from functools import partial

import pytest
import torch

from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config
from mtune.modules.moe import MoE
from mtune.training.checkpointing.hf import load_hf_config, load_model_from_hf, save_hf_checkpoint
from tests._helpers.lora import assert_peft_loads_the_adapter, lora_cfg, lora_steps
from tests._helpers.models import load_hf_model, logits_of

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOKENS = torch.randint(0, 500, (2, 80), generator=torch.Generator().manual_seed(5))  # 80 > a DeltaNet chunk
TINY = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, layer_types=["linear_attention",
                                                                                    "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=False, pad_token_id=0)
# attention and DeltaNet projections adapted, the experts frozen (NF4 under QLoRA), as the shipped configs do
MIXERS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj"]


def randomised(model):
    """Norms off their init (Qwen3.5's ``1 + weight`` norms around 0, the DeltaNet's output norm around 1) and
    routers off zero, so parity covers them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0 if "linear_attn.norm" in name else 0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.models.qwen3_5_moe.Qwen3_5MoeTextConfig(**TINY)
    hf = randomised(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    out = tmp_path_factory.mktemp("qwen3_5_moe") / "model"
    hf.save_pretrained(out)
    return out


logits = partial(logits_of, tokens=TOKENS)


def test_causal_lm_loads_with_transformers_logits_and_saves_back(moe_dir, tmp_path):
    family, args = load_hf_config(moe_dir)
    assert (family, args.n_experts, args.top_k, args.moe_intermediate_dim, args.shared_expert_intermediate_dim) == (
        "qwen3_5", 8, 2, 128, 256)
    assert model_args_from_hf_config(hf_config_from_model_args(args))[1] == args
    model = load_model_from_hf(moe_dir).eval()
    assert all(isinstance(block.mlp, MoE) and block.mlp.shared_expert_gate is not None for block in model.layers)
    ours = logits(model)
    assert (ours - logits(load_hf_model(moe_dir))).abs().max().item() <= 1e-5
    out = save_hf_checkpoint(model, tmp_path / "saved", source_dir=moe_dir)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"], saved["num_experts"]) == (
        "qwen3_5_moe_text", ["Qwen3_5MoeForCausalLM"], 8)
    assert (logits(load_hf_model(out)) - ours).abs().max().item() <= 1e-5


def test_multimodal_checkpoint_loads_its_text_model(moe_dir, tmp_path, caplog):
    qwen3_5_moe = transformers.models.qwen3_5_moe
    vision = qwen3_5_moe.Qwen3_5MoeVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                                out_hidden_size=256, num_position_embeddings=16, patch_size=4)
    text = json.loads((moe_dir / "config.json").read_text())
    config = qwen3_5_moe.Qwen3_5MoeConfig(text_config=text, vision_config=vision.to_dict())
    torch.manual_seed(1)
    multimodal = randomised(qwen3_5_moe.Qwen3_5MoeForConditionalGeneration(config))
    multimodal.save_pretrained(tmp_path / "mm")
    assert load_hf_config(tmp_path / "mm") == load_hf_config(moe_dir)
    with caplog.at_level(logging.INFO, logger="mtune.training.checkpointing.hf"):
        model = load_model_from_hf(tmp_path / "mm").eval()
    assert any("tensors of other towers" in r.getMessage() for r in caplog.records)
    assert (logits(model) - logits(multimodal)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("quantize_base", [False, True])
def test_lora_steps_lower_the_loss_and_the_adapter_loads_in_peft(quantize_base, moe_dir, tmp_path):
    lora = lora_cfg(modules=MIXERS, quantize_base=quantize_base)
    model, run = lora_steps(moe_dir, lora)
    assert run[-1] < run[0] - 0.5, run
    gate = model.layers[0].mlp.shared_expert_gate
    assert type(gate) is torch.nn.Linear  # kept as it is under QLoRA too (one row: routing, not NF4-sized)
    if quantize_base:
        from mtune.modules.expert_linear import ExpertLinear
        from mtune.modules.nf4_linear import is_nf4

        experts = [m for m in model.layers[0].mlp.experts.modules() if isinstance(m, ExpertLinear)]
        assert len(experts) == 3 and all(is_nf4(m.weight) for m in experts)
        return
    assert_peft_loads_the_adapter(model, lora, moe_dir, tmp_path / "adapter", TOKENS)


def test_greedy_generation_matches_transformers(moe_dir):
    """An 80-token prompt (two DeltaNet chunks, the state carried into decoding), 24 new tokens, token for token as
    transformers' generate on the same checkpoint: the experts route each decoded token as they route it in a full
    forward. Mutation seen failing: the decode step's decay dropped."""
    from mtune.modules.generation import generate

    hf = load_hf_model(moe_dir)
    ref = hf.generate(TOKENS, attention_mask=torch.ones_like(TOKENS), max_new_tokens=24, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    ours = generate(load_model_from_hf(moe_dir).eval(), TOKENS, max_new_tokens=24)
    assert torch.equal(ours, ref)
    assert min(len(set(row.tolist())) for row in ours[:, 80:]) >= 8  # not one token repeated
