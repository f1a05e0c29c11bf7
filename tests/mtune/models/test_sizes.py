"""Every named size builds on the meta device with its published parameter count."""

import pytest
import torch

from mtune.models import FAMILIES, build_model, model_args
from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config
from mtune.modules.expert_linear import ExpertLinear

# Parameter counts as published (model cards / safetensors index totals); tied embeddings counted once.
KNOWN = {
    ("llama2", "7B"): 6_738_415_616,
    ("llama2", "13B"): 13_015_864_320,
    ("llama2", "70B"): 68_976_648_192,
    ("llama3", "8B"): 8_030_261_248,
    ("llama3_1", "8B"): 8_030_261_248,
    ("llama3_1", "70B"): 70_553_706_496,
    ("llama3_1", "405B"): 405_853_388_800,
    ("llama3_2", "1B"): 1_235_814_400,
    ("llama3_2", "3B"): 3_212_749_824,
    ("llama3_3", "70B"): 70_553_706_496,
    ("qwen2_5", "0.5B"): 494_032_768,
    ("qwen2_5", "1.5B"): 1_543_714_304,
    ("qwen2_5", "3B"): 3_085_938_688,
    ("qwen2_5", "7B"): 7_615_616_512,
    ("qwen2_5", "14B"): 14_770_033_664,
    # Qwen3: the model cards give 0.6B / 1.7B / 4.0B / 8.2B / 14.8B / 32.8B (non-embedding 0.44B / 1.4B / 3.6B /
    # 6.95B / 13.2B / 31.2B); exact counts of the hub config.json shapes, as transformers builds them (test below).
    ("qwen3", "0.6B"): 596_049_920,
    ("qwen3", "1.7B"): 1_720_574_976,
    ("qwen3", "4B"): 4_022_468_096,
    ("qwen3", "8B"): 8_190_735_360,
    ("qwen3", "14B"): 14_768_307_200,
    ("qwen3", "32B"): 32_762_123_264,
    # Qwen3.5 (the text models): transformers' counts from the same text configs (test_qwen3_5.py); the cards'
    # 0.8B / 2B / 4B / 9B / 27B count the vision tower too
    ("qwen3_5", "0.8B"): 752_393_024,
    ("qwen3_5", "2B"): 1_881_825_088,
    ("qwen3_5", "4B"): 4_205_751_296,
    ("qwen3_5", "9B"): 8_953_803_264,
    ("qwen3_5", "27B"): 26_895_998_464,
    ("qwen3_5", "35B_A3B"): 34_660_610_688,  # Qwen3.5-MoE, the card's 35B
    ("qwen3_5", "122B_A10B"): 122_111_526_912,  # Qwen3.5-MoE, the card's 122B
    # Qwen3-MoE: the model cards' 30.5B / 235B total (3.3B / 22B activated); exact counts of the hub shapes.
    ("qwen3_moe", "30B_A3B"): 30_532_122_624,
    ("qwen3_moe", "235B_A22B"): 235_093_634_560,
    # Gemma 4 text: transformers' count of the same text config (test_gemma4.py compares every shape) plus one frozen
    # scalar per layer (a buffer there); with the vision and audio towers the cards say 5.1B / 8B / 30.7B. E2B and
    # E4B hold 2.36B / 2.85B of it in their per-layer embedding tables.
    ("gemma4", "E2B"): 4_628_569_379,
    ("gemma4", "E4B"): 7_463_013_418,
    ("gemma4", "31B"): 30_697_345_340,
    ("gemma4", "26B_A4B"): 25_233_141_790,  # the mixture of experts (the card's 25.2B total, 3.8B active)
    # gpt-oss: OpenAI's model card gives 20.91B / 116.83B total (3.6B / 5.1B active); transformers counts the same
    # from these configs (its GptOssConfig defaults are the 120B; the 20B has 24 layers of 32 experts)
    ("gpt_oss", "20B"): 20_914_757_184,
    ("gpt_oss", "120B"): 116_829_156_672,
    ("mistral", "7B"): 7_241_732_096,
    ("mistral", "7B-v0.3"): 7_248_023_552,
}
ALL_SIZES = [(family, size) for family, (_, sizes) in FAMILIES.items() for size in sizes]


def n_params(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family,size", [k for k in ALL_SIZES if k in KNOWN])
def test_sizes_build_on_meta_with_published_parameter_counts(family, size):
    model = build_model(family, size)
    assert all(p.is_meta for p in model.parameters())
    assert n_params(model) == KNOWN[(family, size)]


@pytest.mark.parametrize("family", sorted({f for f, s in ALL_SIZES if s == "tiny"}))
def test_tiny_sizes_suit_nf4(family):
    model = build_model(family, "tiny")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]  # not MoE routers: never NF4
    blocks = len(model.layers)  # 2, Gemma 3's 6 (five sliding layers, then a global one), Qwen3.5's 4
    # Phi-4 fuses q/k/v and gate/up; Qwen3-MoE's tiny blocks have attention's 4 and 3 stacked expert projections
    # (ExpertLinear, 8 experts each); a Qwen3.5 DeltaNet layer has 5 projections where attention has 4; Gemma 4's six
    # blocks have 18 attention projections (the global ones no v_proj, the last two only q and o), 18 MLP and 12
    # per-layer-input ones, beside the per-layer projection (its soft-capped head is not a plain nn.Linear); gpt-oss's
    # blocks attention's 4 and 2 stacked expert projections (gate_up fused)
    per_block = {"phi4": 4, "qwen3_moe": 4, "qwen3_5": 7.5, "gemma4": 8, "gpt_oss": 4}.get(family, 7)
    assert len(linears) == blocks * per_block + 1
    experts = [m for m in model.modules() if isinstance(m, ExpertLinear)]
    assert len(experts) == {"qwen3_moe": 3, "gpt_oss": 2}.get(family, 0) * blocks
    # each expert a whole number of NF4 scale blocks (its rows of the projection's NF4 tensor), on 2 ranks too
    assert all(m.in_features * m.out_features % 32768 == 0 for m in experts)
    # the linears QLoRA keeps in the model's dtype (Qwen3.5's per-head in_proj_a / in_proj_b) need not suit NF4
    kept = {id(getattr(m, name)) for m in model.modules() for name in getattr(m, "kept_in_model_dtype", ())}
    assert all(m.weight.numel() % 32768 == 0 for m in linears if id(m) not in kept)
    assert len(kept) == (4 if family == "qwen3_5" else 0)


@pytest.mark.parametrize("family,size", [("llama3_2", "1B"), ("qwen2_5", "7B"), ("mistral", "7B"), ("llama2", "7B"),
                                         ("qwen3", "0.6B"), ("qwen3", "8B"), ("qwen3_moe", "30B_A3B")])
def test_hf_config_round_trip_and_transformers_agrees_on_size(family, size):
    transformers = pytest.importorskip("transformers")
    args = model_args(family, size)
    config = hf_config_from_model_args(args)
    assert model_args_from_hf_config(config)[1] == args
    del config["rope_theta"], config["rope_scaling"]  # transformers 5 reads rope_parameters
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in hf.parameters()) == KNOWN[(family, size)]


def test_unknown_family_and_size():
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        build_model("gpt2", "7B")
    with pytest.raises(ValueError, match=r"unknown size '9B' for family 'llama3_2'; choose one of \['1B', '3B', 'tiny'\]"):
        build_model("llama3_2", "9B")


def test_materialise_on_cpu_in_bf16():
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(torch.zeros(1, 3, dtype=torch.long)).dtype == torch.bfloat16
