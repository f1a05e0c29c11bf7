"""Qwen3.5 dense (text) against transformers and peft: the text tower of the hub's multimodal checkpoints (vision
and multi-token-prediction weights skipped, saved back text-only), gradients of a step, LoRA steps whose adapter loads
in peft, and what it refuses. (The shared tiny-shape logits, checkpoint round trip and packed rows:
test_transformer.py and test_hf.py; the Gated DeltaNet against its recurrence: test_gated_deltanet.py.)"""

import json
import logging
from functools import partial

import pytest
import torch

from mtune.models import build_model, model_args
from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config
from mtune.modules.generation import generate
from mtune.training.checkpointing.hf import CheckpointError, load_hf_config, load_model_from_hf, save_hf_checkpoint
from tests._helpers.lora import assert_peft_loads_the_adapter, lora_cfg, lora_steps
from tests._helpers.models import (
    load_hf_model, logits_of, mtune_twin, tiny_hf_config, tiny_hf_model, write_tiny_hf_model,
)
from tests._helpers.recipes import losses, plan_and_run, train_overrides, write_instruct_data
from tests._helpers.tokenizers import write_tokenizer_files

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOKENS = torch.randint(0, 500, (2, 80), generator=torch.Generator().manual_seed(5))  # 80 > a DeltaNet chunk
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj",
           "down_proj"]


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5")


logits = partial(logits_of, tokens=TOKENS)


def test_multimodal_checkpoint_loads_its_text_model_and_saves_it_text_only(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    qwen3_5 = transformers.models.qwen3_5
    vision = qwen3_5.Qwen3_5VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                         out_hidden_size=256, num_position_embeddings=16, patch_size=4)
    config = qwen3_5.Qwen3_5Config(text_config=tiny_hf_config("qwen3_5").to_dict(), vision_config=vision.to_dict(),
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    multimodal = qwen3_5.Qwen3_5ForConditionalGeneration(config).eval()
    multimodal.save_pretrained(tmp_path / "mm")
    # the hub's files also hold the multi-token-prediction layers, which transformers ignores on load
    weights = load_file(tmp_path / "mm" / "model.safetensors")
    save_file({**weights, "mtp.fc.weight": torch.randn(256, 512)}, tmp_path / "mm" / "model.safetensors",
              metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="mtune.training.checkpointing.hf"):
        model = load_model_from_hf(tmp_path / "mm").eval()
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    n_other = sum(k.startswith(("model.visual.", "mtp.")) for k in weights) + 1
    assert len(skipped) == 1 and f"{n_other} tensors of other towers" in skipped[0]
    ours = logits(model)
    with torch.no_grad():
        assert (ours - multimodal(TOKENS).logits).abs().max().item() <= 1e-5
    out = save_hf_checkpoint(model, tmp_path / "text", source_dir=tmp_path / "mm")
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("qwen3_5_text", ["Qwen3_5ForCausalLM"])
    assert (logits(load_hf_model(out)) - ours).abs().max().item() <= 1e-5


def test_config_with_rope_fields_at_the_top_level_reads_as_the_same_model(qwen3_5_dir, tmp_path):
    config = json.loads((qwen3_5_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                  torch_dtype=config.pop("dtype"))
    del config["layer_types"]
    config["full_attention_interval"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_hf_config(tmp_path) == load_hf_config(qwen3_5_dir)
    family, args = load_hf_config(tmp_path)
    assert family == "qwen3_5" and args.layer_types == ["linear_attention", "full_attention"] * 2
    assert model_args_from_hf_config(hf_config_from_model_args(args))[1] == args


def test_gradients_of_a_step_match_transformers():
    """Every parameter's gradient within 1e-5 relative, and the gradient reaching the token embeddings' output. (The
    tied embedding table's own gradient is not compared: transformers 5.24's Qwen3.5 in training mode leaves the
    embedding lookup's share out of it, though the gradient reaching the lookup's output equals ours.)"""
    hf = tiny_hf_model("qwen3_5").train()
    model = mtune_twin(hf, "qwen3_5").train()
    targets = TOKENS[:, 1:].reshape(-1)
    reaching = {}
    for key, m, embed in (("hf", hf, hf.model.embed_tokens), ("ours", model, model.embed_tokens)):
        def keep_gradient(mod, inputs, out, key=key):
            out.register_hook(lambda grad: reaching.__setitem__(key, grad))

        embed.register_forward_hook(keep_gradient)
        out = m(TOKENS[:, :-1])
        out = out if isinstance(out, torch.Tensor) else out.logits
        torch.nn.functional.cross_entropy(out.reshape(-1, 512), targets).backward()
    assert (reaching["ours"] - reaching["hf"]).norm() <= 1e-5 * reaching["hf"].norm()
    theirs = {k.removeprefix("model."): p.grad for k, p in hf.named_parameters()}
    checked = 0
    for name, param in model.named_parameters():
        if name == "embed_tokens.weight":
            continue
        ref = theirs[name]
        # The decay's parameters (A_log, dt_bias: 4 values a layer) gather their gradient over every position of
        # the scan, with cancellation, from gradients ~1000x below the others': measured 1.3e-5 to 6.1e-5 relative
        # in fp32 (by the thread count: the reduction order), 1.9e-5 to 4.8e-5 in fp64 (transformers' scan runs in
        # fp32 whatever the input). Every other parameter: 1e-5.
        tolerance = 1e-4 if name.endswith(("A_log", "dt_bias")) else 1e-5
        assert (param.grad - ref).norm() <= tolerance * ref.norm(), name
        checked += "linear_attn" in name
    assert checked == 2 * 9  # every DeltaNet parameter of both linear-attention layers was compared


@pytest.mark.parametrize("quantize_base", [False, True])
def test_lora_steps_lower_the_loss_and_the_adapter_loads_in_peft(quantize_base, qwen3_5_dir, tmp_path):
    lora = lora_cfg(modules=LINEARS, quantize_base=quantize_base)
    model, run = lora_steps(qwen3_5_dir, lora)
    assert run[-1] < run[0] - 0.5, run
    if quantize_base:
        return
    assert_peft_loads_the_adapter(model, lora, qwen3_5_dir, tmp_path / "adapter", TOKENS)


@pytest.fixture(scope="module")
def untied():
    """The tiny Qwen3.5 with its own output head, transformers' and mtune's twin: with tied embeddings these random
    models predict their input token again, and greedy generation only repeats it."""
    hf = tiny_hf_model("qwen3_5", tie_word_embeddings=False)
    return hf, mtune_twin(hf, "qwen3_5", tie_embeddings=False)


def greedy(model, prompt, steps):
    """``steps`` greedy tokens ``[b, steps]`` through the model's caches as they stand (set up by the caller)."""
    nxt, out = model(prompt)[:, -1].argmax(-1), []
    for _ in range(steps):
        out.append(nxt)
        nxt = model(nxt[:, None])[:, -1].argmax(-1)
    return torch.stack(out, 1)


def test_greedy_generation_matches_transformers(untied):
    """An 80-token prompt (two DeltaNet chunks: the state carried between them into decoding), 24 new tokens, token
    for token as transformers' generate. Mutations seen failing: the step's decay dropped, the convolution's
    inputs not carried (a decode step convolving from zeros)."""
    hf, model = untied
    ref = hf.generate(TOKENS, attention_mask=torch.ones_like(TOKENS), max_new_tokens=24, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    ours = generate(model, TOKENS, max_new_tokens=24)
    assert torch.equal(ours, ref) and not model.caches_are_enabled()
    assert min(len(set(row.tolist())) for row in ours[:, 80:]) >= 8  # not one token repeated


def test_decoding_state_and_logits_match_token_by_token_and_the_full_forward(untied):
    """The state a prompt leaves (chunks) equals the one it leaves fed a token at a time (steps); decoding on from it
    in calls of 1, 3 and 12 tokens (steps, steps, chunks from the state) gives the full no-cache forward's logits;
    after reset_caches the same caches generate the same tokens again. Mutations seen failing: the step's decay
    dropped (states 0.036 apart); the convolution's inputs not carried; reset_caches not zeroing the recurrent
    state (the zero check; without it, the states compared); the decoder's cache slots skipping the recurrent layers
    (no state set up: generation and this test fail); caches_are_enabled reading layer 0's self_attn only (a
    DeltaNet layer on Qwen3.5: caches never used)."""
    _, model = untied
    deltanets = [layer.linear_attn for layer in model.layers if hasattr(layer, "linear_attn")]
    more = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        full = model(torch.cat([TOKENS, more], 1))
        model.setup_caches(2, 128)
        assert model.caches_are_enabled()
        logits = [model(TOKENS)]
        prompt_state = [(d.decoding_state.conv.clone(), d.decoding_state.recurrent.clone()) for d in deltanets]
        logits += [model(more[:, a:b]) for a, b in [(0, 1), (1, 4), (4, 16)]]
        model.reset_caches()
        assert not any(d.decoding_state.conv.any() or d.decoding_state.recurrent.any() for d in deltanets)
        for t in range(TOKENS.shape[1]):
            model(TOKENS[:, t:t + 1])
        for d, (conv, recurrent) in zip(deltanets, prompt_state, strict=True):
            torch.testing.assert_close(d.decoding_state.conv, conv, rtol=0, atol=1e-6)
            torch.testing.assert_close(d.decoding_state.recurrent, recurrent, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-4, atol=1e-4)
        model.reset_caches()
        first = greedy(model, TOKENS, 8)
        model.reset_caches()
        assert torch.equal(greedy(model, TOKENS, 8), first)
    model.remove_caches()
    assert not model.caches_are_enabled() and all(d.decoding_state is None for d in deltanets)


def test_a_row_of_the_state_holds_what_its_size_says():
    """Qwen3.5 9B's decoding state per row, on the meta device: 24 DeltaNet layers of 32 heads x 128 x 128 fp32
    (2 MiB each) and 3 carried inputs of 8192 channels in bf16, constant in the context's length; its 8 attention
    layers' KV caches grow with it."""
    model = build_model("qwen3_5", "9B")
    model.setup_caches(1, 1024, torch.bfloat16)
    sizes = {name: buf.numel() * buf.element_size() for name, buf in model.named_buffers()}
    recurrent = sum(v for k, v in sizes.items() if k.endswith("decoding_state.recurrent"))
    conv = sum(v for k, v in sizes.items() if k.endswith("decoding_state.conv"))
    kv = sum(v for k, v in sizes.items() if "kv_cache" in k)
    assert (recurrent, conv) == (24 * 32 * 128 * 128 * 4, 24 * 8192 * 3 * 2) == (48 * 2**20, 1179648)
    assert kv == 8 * 2 * 4 * 1024 * 256 * 2  # 8 layers, keys and values, 4 KV heads, 1024 positions of 256
    model.remove_caches()


@pytest.mark.parametrize("field,value,message", [
    ("hidden_act", "gelu", "qwen3_5 hidden_act 'gelu' is not supported"),
    ("attention_bias", True, "qwen3_5 with attention_bias=true is not supported"),
    ("layer_types", ["linear_attention", "sliding_attention"] * 2, "layer_types must give one of"),
])
def test_unsupported_config_fields_name_the_file(field, value, message, qwen3_5_dir, tmp_path):
    config = json.loads((qwen3_5_dir / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/config.json: {message}"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("size,full_layers", [("0.8B", 6), ("2B", 6), ("4B", 8), ("9B", 8), ("27B", 16),
                                             ("35B_A3B", 10), ("122B_A10B", 12)])
def test_named_size_builds_as_transformers_builds_it(size, full_layers):
    """Each named size's config.json, written back, reads as the same args and transformers builds it with our count
    (tied embeddings counted once; the mixtures of experts as Qwen3_5MoeForCausalLM). Mutation seen failing: 2B's
    linear_n_v_heads 32."""
    args = model_args("qwen3_5", size)
    config = hf_config_from_model_args(args)
    assert model_args_from_hf_config(config)[1] == args
    del config["rope_theta"], config["partial_rotary_factor"]
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    ours = sum(p.numel() for p in build_model("qwen3_5", size).parameters())
    assert ours == sum(p.numel() for p in hf.parameters())
    assert args.layer_types.count("full_attention") == full_layers


def test_packed_lora_run_with_its_tokenizer_and_the_plan_of_its_tensors(tmp_path):
    """Through the recipe: packed rows of several documents, the checkpoint's own tokenizer.json (its Qwen3.5 chat
    format), the loss falling; `mtune plan`'s fake tensors (which cannot read where documents end) give the tracked
    peak within 0.1% and the parameters, gradients and optimizer state to the byte."""
    vocab = write_tokenizer_files(tmp_path / "tok", "qwen3_5")
    checkpoint = write_tiny_hf_model(tmp_path, "qwen3_5", vocab_size=vocab, bos_token_id=None, eos_token_id=vocab - 3)
    write_tokenizer_files(checkpoint, "qwen3_5")
    overrides = train_overrides(tmp_path, checkpoint, write_instruct_data(tmp_path / "data.jsonl"), **{
        "dataset.packed": True, "memory_breakdown": True, "max_steps_per_epoch": 4,
        "lora.modules": ["q_proj", "v_proj", "in_proj_qkv", "out_proj", "gate_proj"]})
    plan, out, measured = plan_and_run("lora_single_device", overrides)
    run = losses(out)
    assert run[-1] < run[0] - 0.3, run
    assert plan.device_peak_bytes == pytest.approx(measured["device_peak_bytes"], rel=1e-3)
    for category in ("parameters", "gradients", "optimizer_state"):
        assert plan.device[category] == measured["device"][category], category


def test_a_plan_shortened_to_whole_periods_keeps_the_layer_mix():
    """--fit plans a deep model with a few blocks and extrapolates: the blocks it keeps are whole repetitions of the
    layer pattern, with ``layer_types`` cut to match (left whole, the args refused the shorter model). Mutations
    seen failing: ``layer_types`` not cut; the period ignored by ``planned_layers`` (2 and 4 blocks)."""
    from mtune.models import layer_period, shortened
    from mtune.training.planning.estimate import planned_layers

    args = model_args("qwen3_5", "9B")
    assert (layer_period(args), layer_period(model_args("qwen3_5", "tiny")), layer_period(model_args("llama3", "8B")),
            layer_period(model_args("gemma3", "27B"))) == (4, 2, 1, 6)
    short = shortened(args, 8)
    assert short.n_layers == 8 and short.layer_types == ["linear_attention"] * 3 + ["full_attention"] + \
        ["linear_attention"] * 3 + ["full_attention"]
    from mtune._cli.catalog import find_config, find_recipe, load_recipe_module
    from mtune._cli.run import load_and_check

    cfg = load_and_check(load_recipe_module(find_recipe("lora_single_device")),
                         find_config("qwen3_5/9B_lora_single_device"),
                         ["model.checkpoint_dir=null", "model.family=qwen3_5", "model.size=9B", "tokenizer.path=null"])
    assert planned_layers(cfg) == (4, 8)
