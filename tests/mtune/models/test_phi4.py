"""Phi-4 and Phi-4-mini against transformers' Phi3 and peft: Phi-4-mini's LongRoPE short and long factors with
partial rotation, Phi-4 (14B)'s whole-head plain RoPE and untied embeddings, both config.json layouts, the fused
projections kept fused (checkpoint keys and LoRA adapters), the named sizes' parameter counts, and LoRA (both) and
QLoRA (mini) fine-tunes through the recipe whose saved adapter and merged model load in peft and transformers. (The
shared tiny-shape logits and checkpoint round trip: test_transformer.py and test_hf.py.)"""

import json

import pytest
import torch

from mtune.models import build_model, model_args
from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config
from mtune.training.checkpointing.hf import load_hf_config, load_model_from_hf, save_hf_checkpoint
from tests._helpers.models import write_tiny_hf_model
from tests._helpers.recipes import losses, run_recipe_in_process, train_overrides, write_instruct_data
from tests._helpers.tokenizers import write_tokenizer_files

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.fixture(scope="module")
def phi4_dir(tmp_path_factory):
    """A tiny random Phi-4-mini saved by transformers 5 with a tiny Phi-4 tokenizer."""
    root = tmp_path_factory.mktemp("phi4")
    vocab = write_tokenizer_files(root / "tok", "phi4_mini")
    path = write_tiny_hf_model(root, "phi4", vocab_size=vocab, bos_token_id=500, eos_token_id=500, pad_token_id=500)
    write_tokenizer_files(path, "phi4_mini")
    return path


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("length", [40, 64, 65, 120])
def test_short_and_long_rope_factors_match_transformers(length, phi4_dir):
    """Rows within the original 64-token context use the short factors, longer ones the long factors."""
    tokens = torch.randint(0, 505, (2, length), generator=torch.Generator().manual_seed(length))
    hf = transformers.AutoModelForCausalLM.from_pretrained(phi4_dir, dtype=torch.float32).eval()
    model = load_model_from_hf(phi4_dir).eval()
    assert {n.split(".")[-2] for n, _ in model.named_parameters() if "layers.0." in n} >= {"qkv_proj", "gate_up_proj"}
    assert model.rope.head_dim == 48 and model.args.head_dim == 64
    assert (logits(model, tokens) - logits(hf, tokens)).abs().max().item() <= 1e-5


def test_hub_layout_of_transformers_4_reads_as_the_same_model(phi4_dir, tmp_path):
    config = json.loads((phi4_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    # microsoft/Phi-4-mini-instruct's config.json: rope_theta, a "type": "longrope" rope_scaling, the partial rotary
    # factor and the original context at the top level, torch_dtype, a sliding window longer than the context.
    config.update(rope_theta=rope.pop("rope_theta"), partial_rotary_factor=rope.pop("partial_rotary_factor"),
                  rope_scaling={"type": rope.pop("rope_type"), "short_factor": rope["short_factor"],
                                "long_factor": rope["long_factor"]},
                  torch_dtype=config.pop("dtype"), sliding_window=1024)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_hf_config(tmp_path) == load_hf_config(phi4_dir)
    family, args = load_hf_config(tmp_path)
    assert family == "phi4" and args.partial_rotary_factor == 0.75 and args.sliding_window is None
    assert args.rope_scaling["attention_factor"] == pytest.approx((1 + torch.log(torch.tensor(8.0)).item()
                                                                   / torch.log(torch.tensor(64.0)).item()) ** 0.5)


def test_named_size_and_written_config_agree_with_transformers():
    args = model_args("phi4", "mini")
    config = hf_config_from_model_args(args)
    assert model_args_from_hf_config(config)[1] == args
    del config["rope_theta"], config["rope_scaling"]
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    ours = sum(p.numel() for p in build_model("phi4", "mini").parameters())
    # 3,836,021,760: Phi-4-mini-instruct's "3.8B" (tied embeddings counted once)
    assert ours == sum(p.numel() for p in hf.parameters()) == 3_836_021_760


def test_written_without_a_source_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    model = build_model("phi4", "tiny", device="cpu").eval()
    tokens = torch.randint(0, 512, (1, 90), generator=torch.Generator().manual_seed(1))
    out = save_hf_checkpoint(model, tmp_path / "fresh")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (logits(hf, tokens) - logits(model, tokens)).abs().max().item() <= 1e-5


@pytest.fixture(scope="module")
def phi4_14B_dir(tmp_path_factory):
    """A tiny random model of Phi-4 (14B)'s kind saved by transformers 5: the whole head rotated, plain RoPE with
    base 250,000, untied embeddings, with a tiny Phi-4 tokenizer (<|im_sep|> turns)."""
    root = tmp_path_factory.mktemp("phi4_14B")
    vocab = write_tokenizer_files(root / "tok", "phi4")
    path = write_tiny_hf_model(root, "phi4", vocab_size=vocab, rope_scaling=None, rope_theta=250000.0,
                               partial_rotary_factor=1.0, tie_word_embeddings=False, bos_token_id=500,
                               eos_token_id=502, pad_token_id=504)
    write_tokenizer_files(path, "phi4")
    return path


def test_phi4_14B_kind_matches_transformers_in_both_layouts(phi4_14B_dir, tmp_path):
    tokens = torch.randint(0, 505, (2, 100), generator=torch.Generator().manual_seed(7))
    hf = transformers.AutoModelForCausalLM.from_pretrained(phi4_14B_dir, dtype=torch.float32).eval()
    model = load_model_from_hf(phi4_14B_dir).eval()
    assert model.rope.head_dim == model.args.head_dim == 64 and model.lm_head.weight is not model.embed_tokens.weight
    assert (logits(model, tokens) - logits(hf, tokens)).abs().max().item() <= 1e-5
    # microsoft/phi-4's config.json (transformers 4.47): rope_theta at the top level, rope_scaling null, no
    # partial_rotary_factor (Phi3Config's default 1.0), the original context equal to the context, torch_dtype.
    config = json.loads((phi4_14B_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], rope_scaling=None, sliding_window=None, torch_dtype=config.pop("dtype"),
                  original_max_position_embeddings=config["max_position_embeddings"])
    config.pop("partial_rotary_factor", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    family, args = load_hf_config(tmp_path)
    assert (family, args) == load_hf_config(phi4_14B_dir)
    assert args.partial_rotary_factor == 1.0 and args.rope_scaling is None and not args.tie_embeddings


def test_phi4_14B_named_size_counts_as_transformers_does():
    args = model_args("phi4", "14B")
    config = hf_config_from_model_args(args)
    assert model_args_from_hf_config(config)[1] == args
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    ours = sum(p.numel() for p in build_model("phi4", "14B", device="meta").parameters())
    # 14,659,507,200: microsoft/phi-4's "14.7B" (lm_head untied)
    assert ours == sum(p.numel() for p in hf.parameters()) == 14_659_507_200


@pytest.mark.slow
@pytest.mark.parametrize("kind,quantize_base", [("mini", False), ("mini", True), ("14B", False)])
def test_lora_on_fused_projections_trains_and_exports_that_load(kind, quantize_base, request, tmp_path):
    phi4_dir = request.getfixturevalue({"mini": "phi4_dir", "14B": "phi4_14B_dir"}[kind])
    data = write_instruct_data(tmp_path / "data.jsonl")
    extra = {"lora.modules": FUSED}
    if quantize_base:
        extra.update({"lora.quantize_base": True, "dtype": "bf16"})
    out = run_recipe_in_process("lora_single_device", train_overrides(tmp_path, phi4_dir, data, **extra))
    run = losses(out)
    assert len(run) == 6 and run[-1] < run[0] - 0.5, run
    if quantize_base:
        return
    config = json.loads((out / "final" / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(FUSED)  # fused modules stay fused in the export
    tokens = torch.randint(0, 505, (2, 40), generator=torch.Generator().manual_seed(5))
    base = transformers.AutoModelForCausalLM.from_pretrained(phi4_dir, dtype=torch.float32).eval()
    before = logits(base, tokens)
    reference = logits(peft.PeftModel.from_pretrained(base, out / "final" / "adapter").eval(), tokens)
    assert (reference - before).abs().max() > 1e-3
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "final" / "model", dtype=torch.float32).eval()
    assert (logits(merged, tokens) - reference).abs().max().item() <= 1e-5


def test_fused_projections_count_the_flops_of_separate_ones():
    """Phi-4's tiny shape is Llama 3.2's tiny (tied, 256 wide, 4/2 heads of 64, MLP 512) with fused projections."""
    from mtune.training.observe.flops import flops_per_token

    assert flops_per_token(build_model("phi4", "tiny"), 64) == flops_per_token(build_model("llama3_2", "tiny"), 64)


def test_tiled_fused_mlp_gives_the_untiled_gradients():
    from mtune.modules.tiled_mlp import apply_tiled_mlp, mlp_tiles

    torch.manual_seed(0)
    plain = build_model("phi4", "tiny", device="cpu")
    tiled = apply_tiled_mlp(build_model("phi4", "tiny", device="cpu"), 4)
    tiled.load_state_dict(plain.state_dict())
    assert mlp_tiles(tiled.layers[0].mlp, tokens=64) == 4
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(3))
    for model in (plain, tiled):
        model(tokens).float().square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), tiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
