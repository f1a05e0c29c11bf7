"""Gemma 3 text against transformers and peft: both config.json layouts, the text tower of a multimodal checkpoint
(vision weights skipped, saved back text-only), the named sizes, packed rows past the sliding window, the embedding
scale in the model's dtype, and LoRA / QLoRA steps whose adapter loads in peft. (The shared tiny-shape logits and
checkpoint round trip: test_transformer.py and test_hf.py.)"""

import json
import logging
from functools import partial

import pytest
import torch

from mtune.models import build_model, model_args
from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config
from mtune.modules.sandwich_block import ScaledEmbedding
from mtune.training.checkpointing.hf import CheckpointError, load_hf_config, load_model_from_hf, save_hf_checkpoint
from tests._helpers.lora import assert_peft_loads_the_adapter, lora_cfg, lora_steps
from tests._helpers.models import load_hf_model, logits_of, tiny_hf_config, write_tiny_hf_model

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOKENS = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("gemma3"), "gemma3")


logits = partial(logits_of, tokens=TOKENS)


def test_hub_layout_of_transformers_4_reads_as_the_same_model(gemma3_dir, tmp_path):
    config = json.loads((gemma3_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    del config["layer_types"]
    # google/gemma-3-1b-pt's layout (transformers 4.50): the global layers' rope_theta / rope_scaling, the local base
    # apart, the interleaving as a pattern, torch_dtype.
    full = dict(rope["full_attention"])
    config.update(rope_theta=full.pop("rope_theta"), rope_scaling=full,
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"], sliding_window_pattern=6,
                  torch_dtype=config.pop("dtype"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_hf_config(tmp_path) == load_hf_config(gemma3_dir)
    family, args = load_hf_config(tmp_path)
    assert family == "gemma3" and args.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert (args.rope_local_theta, args.rope_scaling) == (10000.0, {"rope_type": "linear", "factor": 8.0})


def test_multimodal_checkpoint_loads_its_text_tower_and_saves_it_text_only(tmp_path, caplog):
    text = tiny_hf_config("gemma3")
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       mm_tokens_per_image=4, image_token_index=511, boi_token_index=509,
                                       eoi_token_index=510)
    torch.manual_seed(0)
    multimodal = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in multimodal.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                param.normal_(0.0, 0.1)
    multimodal.save_pretrained(tmp_path / "mm")
    with caplog.at_level(logging.INFO, logger="mtune.training.checkpointing.hf"):
        model = load_model_from_hf(tmp_path / "mm").eval()
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1
    assert "tensors of other towers (vision, audio, multi-token prediction) skipped" in skipped[0]
    ours = logits(model)
    assert (ours - logits(multimodal)).abs().max().item() <= 1e-5
    out = save_hf_checkpoint(model, tmp_path / "text", source_dir=tmp_path / "mm")
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert (logits(load_hf_model(out)) - ours).abs().max().item() <= 1e-5


@pytest.mark.parametrize("size", ["1B", "27B"])
def test_named_sizes_agree_with_transformers(size):
    args = model_args("gemma3", size)
    config = hf_config_from_model_args(args)
    assert model_args_from_hf_config(config)[1] == args
    del config["rope_theta"], config["rope_scaling"], config["rope_local_base_freq"]
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    # 1B: the card's "1B"; 27B: the text tower of gemma-3-27b (the vision tower adds ~0.4B); transformers agrees
    published = {"1B": 999_885_952, "27B": 27_009_346_304}[size]
    assert sum(p.numel() for p in build_model("gemma3", size).parameters()) == published
    assert sum(p.numel() for p in hf.parameters()) == published


def test_packed_rows_equal_each_document_alone():
    model = build_model("gemma3", "tiny", device="cpu").eval()
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in (5, 11, 20)]  # 11 and 20 > the window of 8
    input_pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    for kernel in ("dense_mask", "segments"):
        model.attention_kernel = kernel
        with torch.no_grad():
            packed = model(torch.cat(docs)[None], input_pos=input_pos, document_ids=document_ids)[0]
            alone = torch.cat([model(d[None])[0] for d in docs])
        assert (packed - alone).abs().max().item() <= 1e-5, kernel


def test_embedding_scale_is_rounded_to_the_model_dtype():
    emb = ScaledEmbedding(8, 1152, 1152**0.5).to(torch.bfloat16)
    tokens = torch.arange(8)
    expected = emb.weight * torch.tensor(1152**0.5).to(torch.bfloat16)  # 34.0 in bf16, not 33.94
    assert torch.equal(emb(tokens), expected) and torch.tensor(1152**0.5).to(torch.bfloat16).item() == 34.0


@pytest.mark.parametrize("field,value,message", [
    ("final_logit_softcapping", 30.0, "gemma3 with final_logit_softcapping=30.0 is not supported"),
    ("hidden_activation", "gelu", "gemma3 hidden_activation 'gelu' is not supported"),
])
def test_unsupported_config_fields_name_the_file(field, value, message, gemma3_dir, tmp_path):
    config = json.loads((gemma3_dir / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/config.json: {message}"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("quantize_base", [False, True])
def test_lora_steps_lower_the_loss_and_the_adapter_loads_in_peft(quantize_base, gemma3_dir, tmp_path):
    lora = lora_cfg(modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                    quantize_base=quantize_base)
    model, run = lora_steps(gemma3_dir, lora)
    assert run[-1] < run[0] - 0.5, run
    if quantize_base:
        return
    assert_peft_loads_the_adapter(model, lora, gemma3_dir, tmp_path / "adapter", TOKENS)
