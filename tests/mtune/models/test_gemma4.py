"""Gemma 4 text (dense) against transformers and peft: the hub's config layout beside transformers 5.24's, saving in
the hub's, the text tower of a multimodal checkpoint (vision and audio skipped), gradients of a step through the
shared keys and values and the per-layer inputs, the soft-capped chunked loss, LoRA / QLoRA steps whose adapter loads
in peft, generation with the KV cache, the named sizes, and what it refuses. (The shared tiny-shape logits,
checkpoint round trip and packed rows: test_transformer.py and test_hf.py; the chat format:
tests/mtune/tokenizers/test_chat.py.)"""

import json
import logging
from functools import partial

import pytest
import torch
from safetensors import safe_open

from mtune.models import build_model, model_args
from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config
from mtune.modules.generation import generate
from mtune.modules.loss import ChunkedCrossEntropyLoss, CrossEntropyLoss
from mtune.training.checkpointing.hf import CheckpointError, load_hf_config, load_model_from_hf, save_hf_checkpoint
from tests._helpers.lora import assert_peft_loads_the_adapter, lora_cfg, lora_steps
from tests._helpers.models import (
    load_hf_model, logits_of, mtune_twin, stacked_expert_state, tiny_gemma4_multimodal, tiny_hf_model,
    write_tiny_hf_model,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOKENS = torch.randint(0, 500, (2, 40), generator=torch.Generator().manual_seed(5))
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("gemma4"), "gemma4")


logits = partial(logits_of, tokens=TOKENS)


def test_hub_layout_reads_as_transformers_5_layout_and_is_what_mtune_saves(gemma4_dir, tmp_path):
    """transformers 5.24 saves the global layers' shape per layer (per_layer_config); the hub's files name it
    global_head_dim / num_global_key_value_heads. Both read as one model, and a model saved without a source
    checkpoint (hub layout) loads in transformers with the same logits."""
    config = json.loads((gemma4_dir / "config.json").read_text())
    assert config["per_layer_config"]["1"] == {"head_dim": 128, "num_key_value_heads": 1}
    del config["per_layer_config"]
    config.update(global_head_dim=128, num_global_key_value_heads=1)
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "config.json").write_text(json.dumps(config))
    family, args = load_hf_config(gemma4_dir)
    assert family == "gemma4" and load_hf_config(tmp_path / "hub") == (family, args)
    assert (args.global_head_dim, args.global_n_kv_heads, args.keys_are_values) == (128, 1, True)
    assert [args.kv_source(i) for i in range(6)] == [None] * 4 + [2, 3]
    assert model_args_from_hf_config(hf_config_from_model_args(args))[1] == args

    model = load_model_from_hf(gemma4_dir).eval()
    out = save_hf_checkpoint(model.state_dict(), tmp_path / "saved", model_args=args)
    saved = json.loads((out / "config.json").read_text())
    assert (saved["global_head_dim"], saved["num_global_key_value_heads"]) == (128, 1)
    assert "per_layer_config" not in saved
    assert (logits(load_hf_model(out)) - logits(model)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("text_family", ["gemma4", "gemma4_moe"])
def test_multimodal_checkpoint_loads_its_text_tower_and_saves_it_text_only(text_family, tmp_path, caplog):
    """The hub's layout (text model under model.language_model., vision and audio beside it); for the MoE shape
    (26B-A4B's) the experts are held fused, model.language_model.layers.N.experts.gate_up_proj / down_proj, and are
    saved so again."""
    multimodal = tiny_gemma4_multimodal(text_family)
    multimodal.save_pretrained(tmp_path / "mm")
    with caplog.at_level(logging.INFO, logger="mtune.training.checkpointing.hf"):
        model = load_model_from_hf(tmp_path / "mm").eval()
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    with safe_open(str(tmp_path / "mm" / "model.safetensors"), "pt") as f:
        n_other = sum(not k.startswith("model.language_model.") for k in f.keys())  # vision and audio
    assert len(skipped) == 1 and f"{n_other} tensors of other towers" in skipped[0]
    ours = logits(model)
    assert (ours - logits(multimodal)).abs().max().item() <= 1e-5
    out = save_hf_checkpoint(model, tmp_path / "text", source_dir=tmp_path / "mm")
    saved = json.loads((out / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == ("gemma4_text", ["Gemma4ForCausalLM"])
    with safe_open(str(tmp_path / "mm" / "model.safetensors"), "pt") as f:
        text_keys = {k.replace("model.language_model.", "model.") for k in f.keys() if "language_model" in k}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == text_keys  # the hub's names (fused experts too), no others
    assert (logits(load_hf_model(out)) - ours).abs().max().item() <= 1e-5


def test_moe_checkpoint_loads_with_its_logits_and_saves_its_experts_fused(tmp_path):
    """26B-A4B's layout on the tiny shape: transformers' save_pretrained holds each layer's experts whole
    (layers.N.experts.gate_up_proj [8, 256, 256], gate rows first, and down_proj [8, 256, 128]); mtune loads them
    into its separate gate / up / down projections with transformers' logits, and saving without a source checkpoint
    writes them fused again in a config transformers reads as the same model (the sharded load: below; as NF4:
    tests/mtune/training/test_nf4_experts_sharded.py). Mutations seen failing: gate and up swapped on loading
    (placing.place) or on saving (join_side_by_side), the per-expert scales left out of the routing weights, the
    router fed the experts' normed input."""
    checkpoint = write_tiny_hf_model(tmp_path, "gemma4_moe")
    model = load_model_from_hf(checkpoint).eval()
    ours = logits(model)
    assert (ours - logits(load_hf_model(checkpoint))).abs().max().item() <= 1e-5
    out = save_hf_checkpoint(model.state_dict(), tmp_path / "saved", model_args=model.args)
    config = json.loads((out / "config.json").read_text())
    assert [config[k] for k in ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")] == [
        True, 8, 2, 128]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert [k for k in f.keys() if ".layers.0.experts." in k] == ["model.layers.0.experts.down_proj",
                                                                       "model.layers.0.experts.gate_up_proj"]
    assert (logits(load_hf_model(out)) - ours).abs().max().item() <= 1e-5


def _sharded_moe_rank_worker(rank: int, tmp: str, ckpt: str) -> None:
    from mtune.training.checkpointing.sharded import load_hf_checkpoint_sharded
    from mtune.training.distributed import shard_model

    model = build_model("gemma4", "tiny_moe")  # on meta
    shard_model(model)
    load_hf_checkpoint_sharded(model, ckpt, dtype=torch.float32, device="cpu")
    experts = {name: p.to_local() for name, p in model.named_parameters() if ".experts." in name}
    torch.save(experts, f"{tmp}/rank{rank}.pt")


def test_two_ranks_read_their_experts_rows_of_the_fused_checkpoint(tmp_path):
    """FSDP2 on 2 CPU processes from transformers' save_pretrained of the MoE shape (experts.gate_up_proj [8, 256,
    256] gate rows first, experts.down_proj [8, 256, 128]): each rank's rows of every expert weight (its 4 of the 8
    experts, gate / up / down of each layer) equal the single-device load's exactly. Mutations seen failing: gate
    and up split the wrong way round, every rank reading the first experts' rows (rank 1 differs)."""
    from tests._helpers.distributed import run_on_ranks

    checkpoint = write_tiny_hf_model(tmp_path / "hf", "gemma4_moe")
    run_on_ranks(_sharded_moe_rank_worker, tmp_path, str(tmp_path), str(checkpoint))
    one = load_model_from_hf(checkpoint, dtype=torch.float32)
    n_layers = one.args.n_layers
    for rank in range(2):
        experts = torch.load(tmp_path / f"rank{rank}.pt")
        assert len([n for n in experts if n.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight"))]) \
            == 3 * n_layers
        for name, local in experts.items():
            assert local.shape[0] == 4 and torch.equal(local, one.get_parameter(name)[4 * rank:4 * rank + 4]), name


def test_moe_expert_adapters_merge_into_the_fused_checkpoint(tmp_path):
    """Adapters on the experts (and q_proj), read back from their PEFT directory, merged into the transformers-saved
    checkpoint whose experts are fused: transformers' model of the merged checkpoint gives the LoRA model's logits
    (the recipe's merge from the live model: test_packed_lora_run... below). Mutation seen failing: the gate and up
    halves of gate_up_proj swapped in the merge."""
    from mtune.training.checkpointing.merge import save_merged_model
    from mtune.training.checkpointing.peft import save_peft_adapter
    from tests._helpers.lora import trained_lora_model

    checkpoint = write_tiny_hf_model(tmp_path, "gemma4_moe")
    modules = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    model = trained_lora_model(checkpoint, modules=modules)
    ours = logits(model)
    save_peft_adapter(model, tmp_path / "adapter", lora_cfg(modules=modules))
    merged = save_merged_model(checkpoint, tmp_path / "adapter", tmp_path / "merged")  # the live model's: the recipe
    assert (logits(load_hf_model(merged)) - ours).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_gradients_of_a_step_match_transformers(family):
    """Every parameter's gradient within 1e-5 relative (the shared layers' queries reach back into the keys and
    values of layers 2 and 3; every layer's per-layer input into both embedding tables; the MoE shape's router,
    its scales and the experts, whose gate and up gradients are the halves of transformers' gate_up_proj's). The tied
    table is compared too: its gradient sums the lookup, the per-layer projection's input and the output head. Tokens
    avoid the pad id 0, whose rows transformers never trains (its embeddings' padding_idx; mtune's tables have
    none)."""
    hf = tiny_hf_model(family).train()
    model = mtune_twin(hf, family).train()
    tokens = TOKENS.clamp(min=1)
    targets = tokens[:, 1:].reshape(-1)
    for m in (hf, model):
        out = m(tokens[:, :-1])
        out = out if isinstance(out, torch.Tensor) else out.logits
        torch.nn.functional.cross_entropy(out.reshape(-1, 512), targets).backward()
    theirs = stacked_expert_state({k.removeprefix("model."): p.grad for k, p in hf.named_parameters()})
    checked = 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert name.endswith("layer_scalar")  # a buffer in transformers: never trained
            continue
        ref = theirs[name]
        assert (param.grad - ref).norm() <= 1e-5 * ref.norm() + 1e-8, name
        checked += 1
    assert checked == len(theirs)


@pytest.mark.parametrize("chunked_path", ["projected", "checkpointed"])
def test_chunked_loss_soft_caps_as_the_model_does(chunked_path):
    """The chunked loss equals cross-entropy over the model's soft-capped logits, in value and gradients, both where
    it computes gradients in forward and where it recomputes each chunk through the head (a hook on it). Checked
    failing with the cap left out of either path."""
    model = build_model("gemma4", "tiny", device="cpu")
    with torch.no_grad():
        model.embed_tokens.weight.mul_(40)  # logits far past the cap of 30, so capping matters
    labels = torch.randint(0, 512, TOKENS.shape, generator=torch.Generator().manual_seed(6))
    labels[0, :5] = -100
    if chunked_path == "checkpointed":
        model.lm_head.register_forward_hook(lambda *args: None)
    grads = []
    for loss_fn in (CrossEntropyLoss(), ChunkedCrossEntropyLoss(num_chunks=3)):
        model.zero_grad()
        total, n = loss_fn(model(TOKENS, return_hidden=loss_fn.needs_hidden), labels, model.lm_head)
        (total / n).backward()
        grads.append((total.detach(), model.embed_tokens.weight.grad.clone(), model.layers[5].mlp.up_proj.weight.grad))
    assert ChunkedCrossEntropyLoss.recomputes_projection(model.lm_head) == (chunked_path == "checkpointed")
    (full, embed, up), (chunked, embed_c, up_c) = grads
    assert (chunked - full).abs().item() <= 1e-5 * full.abs().item()
    assert (embed_c - embed).norm() <= 1e-5 * embed.norm() and (up_c - up).norm() <= 1e-5 * up.norm()


@pytest.mark.parametrize("family,quantize_base", [("gemma4", False), ("gemma4", True), ("gemma4_moe", False)])
def test_lora_steps_lower_the_loss_and_the_adapter_loads_in_peft(quantize_base, family, gemma4_dir, tmp_path):
    """AdamW steps on one batch (8; 4 for the MoE shape) lower the loss by more than 1.0 nat (LoRA on every
    projection: for the MoE shape the dense MLP's and, per expert, the experts'); the LoRA adapter loads in peft on
    transformers' model with the same logits. (QLoRA on the MoE shape: the packed recipe run below, as its shipped
    config trains.)"""
    checkpoint = gemma4_dir if family == "gemma4" else write_tiny_hf_model(tmp_path, family)
    lora = lora_cfg(modules=LINEARS, quantize_base=quantize_base)
    model, run = lora_steps(checkpoint, lora, steps=4 if family == "gemma4_moe" else 8)
    assert run[-1] < run[0] - 1.0, run
    if quantize_base:
        return
    assert_peft_loads_the_adapter(model, lora, checkpoint, tmp_path / "adapter", TOKENS)


def test_flops_count_the_dense_mlp_the_router_and_top_k_experts():
    """tiny_moe's forward FLOPs per token, counted by hand: per sliding layer q/k/v/o (256, 128, 128 wide on 256;
    o 256 -> 256) and attention over 16 keys with 4 heads of 64, per global layer q (512) and k (128, the values too)
    and o (512 -> 256) with heads of 128; in every layer the dense MLP (3 x 256 x 512), the router (8 x 256) and 2
    experts of three 128 x 256 projections; then the output head. Mutation seen failing: the experts left out (the
    dense MLP alone counted, as before the MoE block)."""
    from mtune.training.observe.flops import flops_per_token

    linear = lambda i, o: 2 * i * o  # noqa: E731
    sliding = linear(256, 256) + 2 * linear(256, 128) + linear(256, 256) + 4 * 16 * 4 * 64
    full = linear(256, 512) + linear(256, 128) + linear(512, 256) + 4 * 16 * 4 * 128
    mlps = 3 * linear(256, 512) + linear(256, 8) + 2 * 3 * linear(256, 128)
    expected = 2 * (sliding + full) + 4 * mlps + linear(256, 512)
    assert flops_per_token(build_model("gemma4", "tiny_moe"), 16).forward == expected


# (transformers config fields, mtune argument overrides) on the tiny shapes, for generation
GENERATION_SHAPES = {
    # layers 4 and 5 reuse layer 2's (sliding) and 3's (global) keys and values; per-layer inputs (E2B's, E4B's);
    # the global layers' keys double as values (31B's, 26B-A4B's attention_k_eq_v)
    "gemma4": ("gemma4", {}, {}),
    # E2B's and E4B's global layers: a v_proj of their own, the model's 2 KV heads, beside the sharing and per-layer
    # inputs above
    "gemma4_values": ("gemma4", dict(attention_k_eq_v=False), dict(keys_are_values=False, global_n_kv_heads=None)),
    # 26B-A4B's block: experts beside the dense MLP, keys as values, no sharing or per-layer inputs
    "gemma4_moe": ("gemma4_moe", {}, {}),
}


@pytest.mark.parametrize("shape", list(GENERATION_SHAPES))
def test_greedy_generation_matches_transformers(shape):
    """mtune's generate (its KV cache) equals transformers' greedy generate token for token: 10-token prompts and 40
    new tokens, past the window of 8, so the sliding layers' cache mask (and the reusing sliding layer's, which reads
    its source's whole cache) cuts. Mutations seen failing (the MoE shape, which shares nothing, only the second):
    the reusing layers handed the cache of layers 0 and 1 (their kinds, the wrong layers) while decoding; the window
    dropped from the cache mask (TransformerDecoder._mask); the reusing sliding layer given the global layers' mask
    while decoding; a source handing on this call's keys and values instead of its whole cache."""
    family, hf_fields, overrides = GENERATION_SHAPES[shape]
    hf = tiny_hf_model(family, **hf_fields)
    model = mtune_twin(hf, family, **overrides)
    prompt = torch.randint(1, 512, (2, 10), generator=torch.Generator().manual_seed(0))
    ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert torch.equal(generate(model, prompt, max_new_tokens=40), ref)
    assert not model.caches_are_enabled()


def test_cached_decoding_gives_the_logits_of_one_forward():
    """Only the layers that make keys and values get a cache, each of its own layout (sliding: 2 KV heads of 64;
    global: 1 of 128); fed a 10-token prompt, then 5 tokens, then one at a time to 40, the cached model's logits are
    those of one forward over all 40 without a cache (within 1e-5; 2.2e-6 measured), and after reset_caches the
    prompt gives the same logits again. Mutations seen failing: those of the test above (the first three 1.21, 1.58
    and 0.55 apart; the fourth on the mask's shape)."""
    model = mtune_twin(tiny_hf_model("gemma4"), "gemma4")
    tokens = torch.randint(1, 512, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(2, 40)
        caches = [layer.self_attn.kv_cache for layer in model.layers]
        assert [None if c is None else tuple(c.k.shape) for c in caches] == [(2, 2, 40, 64), (2, 1, 40, 128)] * 2 + [
            None, None]
        assert model.caches_are_enabled()
        steps = [model(tokens[:, :10]), model(tokens[:, 10:15])] + [model(tokens[:, i:i + 1]) for i in range(15, 40)]
        assert (torch.cat(steps, dim=1) - full).abs().max().item() <= 1e-5
        model.reset_caches()
        assert torch.equal(model(tokens[:, :10]), steps[0])
    model.remove_caches()
    assert not model.caches_are_enabled() and all(layer.self_attn.kv_cache is None for layer in model.layers)


def test_a_prompt_runs_the_reusing_layers_on_its_last_position_alone():
    """Generation's prompt (``last_only``, caches set up) runs the layers that reuse others' keys and values, the last
    two, on its last position alone, as transformers' prefill does: they write no cache. Its logits are the last row
    of one uncached forward, and decoding on from that cache gives the rest (within 1e-5). Mutations seen failing:
    the mask's query rows not cut to the last (a shape error); the cut one layer early, on the last source layer
    (the layers' row counts)."""
    model = mtune_twin(tiny_hf_model("gemma4"), "gemma4")
    tokens = torch.randint(1, 512, (2, 20), generator=torch.Generator().manual_seed(6))
    seen = []
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1])) for layer in model.layers]
    with torch.no_grad():
        full = model(tokens)
        seen.clear()
        model.setup_caches(2, 20)
        prompt = model(tokens[:, :12], last_only=True)
        assert seen == [12, 12, 12, 12, 1, 1] and prompt.shape == (2, 1, full.shape[-1])
        decoded = [model(tokens[:, i:i + 1]) for i in range(12, 20)]
    for hook in hooks:
        hook.remove()
    model.remove_caches()
    assert (prompt - full[:, 11:12]).abs().max().item() <= 1e-5
    assert (torch.cat(decoded, dim=1) - full[:, 12:]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("field,value,message", [
    ("enable_moe_block", True, "gemma4 with enable_moe_block=true needs num_experts, top_k_experts, "
                               "moe_intermediate_size"),
    ("hidden_activation", "gelu", "gemma4 hidden_activation 'gelu' is not supported"),
    ("use_bidirectional_attention", "all", "gemma4 with use_bidirectional_attention"),
    ("num_kv_shared_layers", 5, "num_kv_shared_layers=5: a shared layer's kind has no earlier layer"),
])
def test_unsupported_config_fields_name_the_file(field, value, message, gemma4_dir, tmp_path):
    config = json.loads((gemma4_dir / "config.json").read_text())
    config[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/config.json: {message}"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize("size", ["E2B", "E4B", "31B", "26B_A4B"])
def test_named_size_builds_as_transformers_builds_it(size):
    args = model_args("gemma4", size)
    config = hf_config_from_model_args(args)
    assert model_args_from_hf_config(config)[1] == args
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    theirs = stacked_expert_state({k.removeprefix("model."): p for k, p in hf.named_parameters()})  # meta tensors
    theirs = {k: tuple(p.shape) for k, p in theirs.items() if k != "lm_head.weight"}
    ours = {k: tuple(p.shape) for k, p in build_model("gemma4", size).named_parameters() if k != "lm_head.weight"}
    assert {k: v for k, v in ours.items() if not k.endswith("layer_scalar")} == theirs


@pytest.mark.parametrize("family,quantize_base", [("gemma4", False), ("gemma4_moe", True)])
def test_packed_lora_run_with_its_tokenizer_and_the_plan_of_its_tensors(family, quantize_base, tmp_path):
    """Through the recipe: packed rows, the checkpoint's own Gemma 4 tokenizer.json and chat format, the loss
    falling by more than 0.3 nat in 4 steps; `mtune plan` gives the tracked peak within 0.1% (per-layer tables,
    shared keys and values, the soft-capped chunked loss included) and the parameters, gradients and optimizer state
    to the byte. The MoE shape runs as 26B-A4B's shipped config does, QLoRA: NF4 experts and dense MLPs beside
    them, the experts' gate_proj adapters, the routed rows, and the merged model saved with its experts fused."""
    from tests._helpers.recipes import losses, plan_and_run, train_overrides, write_instruct_data
    from tests._helpers.tokenizers import write_tokenizer_files

    vocab = write_tokenizer_files(tmp_path / "tok", "gemma4")
    checkpoint = write_tiny_hf_model(tmp_path, family, vocab_size=vocab, bos_token_id=vocab - 3,
                                     eos_token_id=vocab - 4)
    write_tokenizer_files(checkpoint, "gemma4")
    overrides = train_overrides(tmp_path, checkpoint, write_instruct_data(tmp_path / "data.jsonl"), **{
        "dataset.packed": True, "memory_breakdown": True, "max_steps_per_epoch": 4,
        "lora.modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"], "lora.quantize_base": quantize_base})
    plan, out, measured = plan_and_run("lora_single_device", overrides)
    run = losses(out)
    assert run[-1] < run[0] - 0.3, run
    assert plan.device_peak_bytes == pytest.approx(measured["device_peak_bytes"], rel=1e-3)
    for category in ("parameters", "gradients", "optimizer_state"):
        assert plan.device[category] == measured["device"][category], category


def test_plans_keep_the_kv_sharing_tail():
    """Gemma 4's last layers reuse earlier keys and values (no K/V projections; E2B's with double-wide MLPs), so no
    shorter run of blocks repeats through the model: `--fit` plans it whole, and a plan of the first N blocks counts
    only the sharing layers among them. Mutation seen failing: `layer_period` reading layer_types alone (2 for the
    tiny model, whose 2-block plan then refused its 2 sharing layers, as `--fit` on gemma4/31B_qlora's flag set did)."""
    from mtune.models import layer_period, shortened

    tiny, e2b = model_args("gemma4", "tiny"), model_args("gemma4", "E2B")
    assert (layer_period(tiny), layer_period(e2b), layer_period(model_args("gemma4", "31B"))) == (6, 35, 6)
    assert [shortened(tiny, n).n_kv_shared_layers for n in (2, 4, 5, 6)] == [0, 0, 1, 2]
    assert shortened(e2b, 16).n_kv_shared_layers == 1 and shortened(e2b, 15).n_kv_shared_layers == 0
