"""Qwen3 dense end to end against transformers and peft: both config.json layouts, packed rows, a LoRA and a QLoRA
fine-tune through the recipe with its own tokenizer, and what the run saves loading in transformers and peft.
(Logits of the shared tiny shape and the checkpoint round trip: tests/mtune/modules/test_transformer.py and
tests/mtune/training/checkpointing/test_hf.py, where ``qwen3`` is one of the families.)"""

import json

import pytest
import torch

from mtune.models import build_model
from mtune.training.checkpointing.hf import CheckpointError, load_hf_config, load_model_from_hf, save_hf_checkpoint
from tests._helpers.models import write_tiny_hf_model
from tests._helpers.recipes import losses, run_recipe_in_process, torchrun, train_overrides, write_instruct_data
from tests._helpers.tokenizers import write_tokenizer_files

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOKENS = torch.randint(0, 505, (2, 40), generator=torch.Generator().manual_seed(5))
BLOCK_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny random Qwen3 saved by transformers 5 (``rope_parameters``, ``dtype``) with a tiny Qwen3 tokenizer."""
    root = tmp_path_factory.mktemp("qwen3")
    vocab = write_tokenizer_files(root / "tok", "qwen3")
    path = write_tiny_hf_model(root, "qwen3", vocab_size=vocab, bos_token_id=None, eos_token_id=vocab - 3)
    write_tokenizer_files(path, "qwen3")
    return path


def hf_logits(path, tokens=TOKENS):
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(tokens).logits


def test_hub_layout_of_transformers_4_reads_as_the_same_model(qwen3_dir, tmp_path):
    config = json.loads((qwen3_dir / "config.json").read_text())
    assert "rope_parameters" in config and "dtype" in config
    # What the Hub's Qwen3 config.json holds (transformers 4.51): rope_theta + rope_scaling, torch_dtype.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for f in qwen3_dir.iterdir():
        (legacy / f.name).write_bytes(f.read_bytes())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None, torch_dtype=config.pop("dtype"),
                  max_window_layers=2, sliding_window=None)
    config.pop("layer_types", None)
    (legacy / "config.json").write_text(json.dumps(config))
    assert load_hf_config(legacy) == load_hf_config(qwen3_dir)
    family, args = load_hf_config(legacy)
    assert family == "qwen3" and args.head_dim == 64 and args.dim // args.n_heads == 32 and args.tie_embeddings
    model = load_model_from_hf(legacy).eval()
    with torch.no_grad():
        assert (model(TOKENS) - hf_logits(qwen3_dir)).abs().max().item() <= 1e-5
    saved = json.loads((save_hf_checkpoint(model, tmp_path / "out", source_dir=legacy) / "config.json").read_text())
    assert saved["torch_dtype"] == "float32" and "dtype" not in saved  # the checkpoint's own field names


def test_written_without_a_source_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    model = build_model("qwen3", "tiny", device="cpu").eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.1)  # so the q/k norms matter
        ours = model(TOKENS.clamp(max=511))
    out = save_hf_checkpoint(model, tmp_path / "fresh")
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
    assert (hf_logits(out, TOKENS.clamp(max=511)) - ours).abs().max().item() <= 1e-5


def test_packed_rows_equal_each_document_alone():
    model = build_model("qwen3", "tiny", device="cpu").eval()
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in (5, 11, 16)]
    input_pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        packed = model(torch.cat(docs)[None], input_pos=input_pos, document_ids=document_ids)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
    assert (packed - alone).abs().max().item() <= 1e-5


@pytest.mark.parametrize("field,value,message", [
    ("attention_bias", True, "qwen3 with attention_bias=true is not supported"),
    ("use_sliding_window", True, "qwen3 with use_sliding_window=true is not supported"),
    ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
])
def test_unsupported_config_fields_name_the_file(field, value, message, qwen3_dir, tmp_path):
    config = json.loads((qwen3_dir / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/config.json: {message}"):
        load_hf_config(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("quantize_base", [False, True])
def test_lora_fine_tune_with_its_tokenizer_and_exports_that_load(quantize_base, qwen3_dir, tmp_path):
    data = write_instruct_data(tmp_path / "data.jsonl")
    extra = {"lora.modules": BLOCK_LINEARS}
    if quantize_base:
        extra.update({"lora.quantize_base": True, "dtype": "bf16"})
    out = run_recipe_in_process("lora_single_device", train_overrides(tmp_path, qwen3_dir, data, **extra))
    run = losses(out)
    assert len(run) == 6 and run[-1] < run[0] - 0.5, run
    if quantize_base:
        return
    # The PEFT adapter on transformers' Qwen3 gives the merged model's logits, and both load in transformers.
    base = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        before = base(TOKENS).logits
        reference = peft.PeftModel.from_pretrained(base, out / "final" / "adapter").eval()(TOKENS).logits
    assert (reference - before).abs().max() > 1e-3  # training moved the adapter
    assert (hf_logits(out / "final" / "model") - reference).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_lora_on_two_ranks_matches_one_device(qwen3_dir, tmp_path):
    """FSDP2 on 2 CPU processes (batch 2 each) against one device (batch 4): the same global batches."""
    from safetensors.torch import load_file

    data = write_instruct_data(tmp_path / "data.jsonl")
    schedule = ["max_steps_per_epoch=3", f"lora.modules=[{','.join(BLOCK_LINEARS)}]"]
    torchrun("lora_distributed", train_overrides(tmp_path / "dist", qwen3_dir, data, batch_size=2) + schedule)
    single = run_recipe_in_process("lora_single_device", train_overrides(tmp_path / "single", qwen3_dir, data)
                                   + schedule)
    distributed = tmp_path / "dist" / "out"
    torch.testing.assert_close(torch.tensor(losses(distributed)), torch.tensor(losses(single)), rtol=0, atol=2e-5)
    expected, got = (load_file(out / "final" / "adapter" / "adapter_model.safetensors") for out in (single,
                                                                                                    distributed))
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=3e-5)
