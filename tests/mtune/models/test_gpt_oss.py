"""gpt-oss against transformers: both config.json layouts, logits through sinks, sliding windows and YaRN (past the
window and past YaRN's original context), the clamped experts where the clamp bites, the hub's whole-expert
checkpoint layout both ways, packed rows against each document alone, sink attention against its formula on every
kernel, and LoRA / QLoRA steps on the experts."""

import json

import pytest
import torch
from safetensors import safe_open

from mtune.models import build_model, model_args
from mtune.modules.attention import causal_attention
from mtune.modules.packed_attention import batch_segments
from mtune.training.checkpointing.hf import load_hf_config, load_model_from_hf, save_hf_checkpoint
from tests._helpers.lora import lora_cfg, lora_steps
from tests._helpers.models import load_hf_model, logits_of, tiny_hf_model

transformers = pytest.importorskip("transformers")
# 80 tokens: 10 windows of layer 0, and past YaRN's original 64-token context
TOKENS = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(5))
FP32_ATOL = 1e-5  # logits of about +-1; measured 5.5e-6 (SDPA), 1.2e-5 before the weights were scaled down


def _clamping(hf):
    """Expert gate/up weights large enough that the clamp at 7 bites on a share of the features (checked below)."""
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.25)
            layer.mlp.experts.down_proj.normal_(0.0, 0.02)
    return hf


@pytest.fixture(scope="module")
def hf_model():
    return _clamping(tiny_hf_model("gpt_oss"))


@pytest.fixture(scope="module")
def oss_dir(hf_model, tmp_path_factory):
    """The tiny model saved by transformers 5 (``rope_parameters``, ``dtype``, experts whole)."""
    out = tmp_path_factory.mktemp("gpt_oss") / "gpt_oss"
    hf_model.save_pretrained(out)
    return out


def hub_layout(src, dst):
    """``src`` with the hub's config.json layout (transformers 4.55: ``rope_theta`` and ``rope_scaling``,
    ``torch_dtype``, ``experts_per_token`` beside ``num_experts_per_tok``, ``initial_context_length``)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope, torch_dtype=config.pop("dtype"),
                  experts_per_token=config["num_experts_per_tok"], initial_context_length=64)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_both_config_layouts_match_transformers_logits(hf_model, oss_dir, tmp_path):
    """Logits within 1e-5 (fp32) of transformers' eager attention with sinks, on the SDPA / dense-mask path and on
    the per-segment kernel, for the checkpoint as transformers 5 saves it and in the hub's layout.
    Mutations seen failing: sinks left out of the softmax; YaRN's cos/sin scale dropped; truncate read as true;
    the clamp on up removed; the gate and up features de-interleaved (chunked in halves)."""
    legacy = hub_layout(oss_dir, tmp_path / "legacy")
    assert load_hf_config(legacy) == load_hf_config(oss_dir)
    family, args = load_hf_config(legacy)
    assert (family, args.n_experts, args.top_k, args.layer_types, args.sliding_window) == (
        "gpt_oss", 8, 2, ["sliding_attention", "full_attention"], 8)
    assert args.rope_scaling == dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0,
                                     original_max_position_embeddings=64, truncate=False)
    expected = logits_of(hf_model, TOKENS)
    for path in (oss_dir, legacy):
        model = load_model_from_hf(path).eval()
        for kernel in ("auto", "segments"):
            model.attention_kernel = kernel
            assert (logits_of(model, TOKENS) - expected).abs().max().item() <= FP32_ATOL, (path.name, kernel)
    assert {"sdpa_causal", "dense_mask", "sdpa_per_segment"} <= model.attention_kernels_run


def test_the_clamp_bites_and_routing_matches(hf_model, oss_dir, monkeypatch):
    """The parity above covers the clamp: 2-20% of the gate / up features lie beyond +-7 in layer 0. Each token's
    experts are transformers' (softmax over the top-k logits = renormalised top-k probabilities)."""
    from mtune.modules import clamped_experts

    model = load_model_from_hf(oss_dir).eval()
    seen = {}
    swiglu = clamped_experts.clamped_swiglu

    def recorded(gate_up, alpha, limit):
        seen.setdefault("gu", []).append(gate_up)
        return swiglu(gate_up, alpha, limit)

    monkeypatch.setattr(clamped_experts, "clamped_swiglu", recorded)
    hooks = [model.layers[0].mlp.router.register_forward_hook(lambda m, i, o: seen.__setitem__("ours", o)),
             hf_model.model.layers[0].mlp.router.register_forward_hook(lambda m, i, o: seen.__setitem__("hf", o))]
    with torch.no_grad():
        model(TOKENS), hf_model(TOKENS)
    for hook in hooks:  # hf_model is the module's: later tests run it unhooked
        hook.remove()
    share = (torch.cat(seen["gu"][:8]).abs() > 7).float().mean().item()  # layer 0's 8 experts
    assert 0.02 <= share <= 0.2, share
    _, hf_weights, hf_experts = seen["hf"]
    _, weights, experts = seen["ours"]
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=1e-5)


def test_the_experts_compile_in_one_graph_through_the_clamp(oss_dir):
    """The grouped experts' backward under torch.compile (the hidden rows' vjp by torch.func.vjp) through gpt-oss's
    clamped SwiGLU, on layer 0's own input, where the clamp bites (above): one graph, no break, and eager's output and
    input gradient (aot_eager: dynamo's and AOT autograd's tracing). Mutation seen failing: torch.autograd.grad in
    that backward (six graphs, five breaks)."""
    model = load_model_from_hf(oss_dir).to(torch.bfloat16).requires_grad_(False)
    mlp = model.layers[0].mlp
    seen = {}
    hook = mlp.register_forward_pre_hook(lambda module, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(TOKENS)
    hook.remove()
    x = seen["x"]
    assert mlp._grouped(x.reshape(-1, x.shape[-1]))

    def out_and_grad(fn):
        rows = x.clone().requires_grad_()
        out = fn(rows)
        (out.float() * torch.arange(out.shape[-1])).sum().backward()
        return out.float(), rows.grad.float()

    eager = out_and_grad(mlp)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(mlp)(x.clone().requires_grad_())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    for got, want in zip(out_and_grad(torch.compile(mlp, backend="aot_eager")), eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0.01 * want.abs().max().item())


def test_saved_whole_experts_load_in_transformers(oss_dir, tmp_path):
    """Saved without a source checkpoint (config from the arguments) and with one: the experts whole and transposed
    under the hub's names, and transformers' logits equal ours. Mutation seen failing: the weights saved
    untransposed (transformers then refuses the shapes)."""
    torch.manual_seed(0)
    model = build_model("gpt_oss", "tiny", device="cpu").eval()
    ours = logits_of(model, TOKENS)
    out = save_hf_checkpoint(model, tmp_path / "fresh")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (8, 256, 256)
    assert shapes["model.layers.1.mlp.experts.down_proj"] == (8, 128, 256)
    assert shapes["model.layers.1.mlp.experts.down_proj_bias"] == (8, 256)
    assert shapes["model.layers.0.self_attn.sinks"] == (4,) and shapes["model.layers.0.mlp.router.bias"] == (8,)
    assert (logits_of(load_hf_model(out), TOKENS) - ours).abs().max().item() <= FP32_ATOL
    again = save_hf_checkpoint(load_model_from_hf(oss_dir), tmp_path / "again", source_dir=oss_dir)
    assert torch.equal(logits_of(load_hf_model(again), TOKENS), logits_of(load_hf_model(oss_dir), TOKENS))


def _reference(q, k, v, sinks, allowed):
    """The formula: softmax over [scores, sink] per head, the sink's column dropped (``allowed`` [s, s] bool)."""
    h = q.shape[1]
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.view(1, h, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = probs @ v
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("window", [None, 4])
def test_sink_attention_equals_its_formula_on_every_kernel(window):
    """Causal SDPA (no window), the dense mask and the per-segment kernel (packed documents, some longer than the
    window) against the formula; outputs and the gradients of q, k, v and the sinks within 1e-5. Mutations seen
    failing: the sink key's value one instead of zero; the sink feature not multiplied by sqrt(d) (the sink logit
    then scaled by 1/sqrt(d))."""
    gen = torch.Generator().manual_seed(0)
    b, s, d = 1, 19, 16
    q, k, v = (torch.randn(b, n, s, d, generator=gen, requires_grad=True) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=gen).requires_grad_()
    lengths = [3, 9, 7]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    i = torch.arange(s)
    causal = i[None, :] <= i[:, None]
    if window is not None:
        causal = causal & (i[None, :] > i[:, None] - window)
    packed = causal & (doc[None, :] == doc[:, None])
    cases = {"dense": (packed[None, None], None, packed),
             "segments": (None, batch_segments(doc[None], b, s, longest=max(lengths)), packed)}
    if window is None:
        cases["causal"] = (None, None, causal)
    for name, (mask, segments, allowed) in cases.items():
        expected = _reference(q, k, v, sinks, allowed)
        got = causal_attention(q, k, v, mask, segments, window, sinks)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=name)
        weights = torch.randn(expected.shape, generator=gen)
        want = torch.autograd.grad((expected * weights).sum(), (q, k, v, sinks))
        have = torch.autograd.grad((got * weights).sum(), (q, k, v, sinks))
        for w, h in zip(want, have):
            torch.testing.assert_close(h, w, rtol=0, atol=1e-5, msg=name)


def test_packed_rows_equal_each_document_alone(oss_dir):
    """Documents longer than the window packed into one row, through both kernels: each equals its document alone
    (the sinks restart with each document's softmax)."""
    model = load_model_from_hf(oss_dir).eval()
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in (5, 21, 14)]
    input_pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    document_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        alone = torch.cat([model(d[None])[0] for d in docs])
        for kernel in ("dense_mask", "segments"):
            model.attention_kernel = kernel
            packed = model(torch.cat(docs)[None], input_pos=input_pos, document_ids=document_ids)[0]
            assert (packed - alone).abs().max().item() <= FP32_ATOL, kernel


@pytest.mark.parametrize("quantize_base", [False, True], ids=["lora", "qlora"])
def test_lora_and_qlora_steps_lower_the_loss(oss_dir, quantize_base):
    """LoRA on attention and on both expert projections (each expert its own pair; QLoRA: the experts' gate_up and
    down stored NF4 in bf16, the routers and sinks in the model's dtype), AdamW steps on one batch: the loss falls
    by 0.75 nat in 8 LoRA steps (measured 6.355 -> 5.413), by 0.35 in 4 QLoRA steps (bf16 on CPU is slow; measured
    6.36 -> 5.90 at step 4, 5.44 at step 8)."""
    lora = lora_cfg(quantize_base=quantize_base, modules=["q_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"])
    model, run = lora_steps(oss_dir, lora, steps=4 if quantize_base else 8)
    experts = model.layers[0].mlp.experts
    assert type(experts.gate_up_proj).__name__ == "LoRAExpertLinear" and experts.gate_up_proj.nf4 == quantize_base
    assert model.layers[0].mlp.router.weight.dtype == (torch.bfloat16 if quantize_base else torch.float32)
    assert run[-1] < run[0] - (0.35 if quantize_base else 0.75), run


def test_named_sizes_write_what_transformers_reads_as_the_published_models():
    """The 120B's config.json as mtune writes it equals transformers' GptOssConfig defaults (the 120B) in every
    field both have, the 20B's differs only in its layers and experts, and both read back as the same arguments.
    (The parameter counts: test_sizes.py.)"""
    from mtune.models.hf_config import hf_config_from_model_args, model_args_from_hf_config

    defaults = transformers.GptOssConfig().to_dict()
    for size, changes in (("120B", {}), ("20B", dict(num_hidden_layers=24, num_local_experts=32))):
        args = model_args("gpt_oss", size)
        config = hf_config_from_model_args(args)
        want = {**defaults, **changes, "layer_types": transformers.GptOssConfig(**changes).layer_types}
        rope = {k: v for k, v in config["rope_parameters"].items()}
        assert rope == want["rope_parameters"] | {"rope_theta": 150000.0}
        skip = {"rope_parameters", "rope_scaling", "rope_theta", "dtype", "router_aux_loss_coef", "architectures"}
        assert {k: v for k, v in config.items() if k in want and k not in skip} == {
            k: want[k] for k in config if k in want and k not in skip}
        assert model_args_from_hf_config(config) == ("gpt_oss", args)


def test_other_quantizations_are_refused(oss_dir, tmp_path):
    """A gpt-oss checkpoint quantized otherwise than the hub's MXFP4 is refused by name, not misread."""
    from mtune.training.checkpointing.hf import CheckpointError

    quantized = hub_layout(oss_dir, tmp_path / "bnb")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="quantization_config 'bitsandbytes' is not supported"):
        load_hf_config(quantized)


def test_expert_adapters_load_in_peft_on_transformers_experts(hf_model, oss_dir, tmp_path):
    """Adapters on attention and on both expert projections, saved in PEFT's form (gate_up_proj's adapter as it
    is: transformers' parameter has the same interleaved features), give mtune's logits within 2e-5 (fp32; measured
    1.1e-5: peft adds the delta to the expert weights, mtune runs the low-rank path beside them) under peft on
    transformers' model, and load back into mtune unchanged. Mutation seen failing: lora_B's columns laid
    out expert-major (no permute)."""
    import copy

    peft = pytest.importorskip("peft")
    from mtune.modules.lora import apply_lora
    from mtune.training.checkpointing.peft import load_peft_adapter, save_peft_adapter
    from tests._helpers.models import mtune_twin

    modules = ["q_proj", "v_proj", "gate_up_proj", "down_proj"]
    base = mtune_twin(hf_model, "gpt_oss")
    again = apply_lora(copy.deepcopy(base), modules, rank=4, alpha=8)
    ours = apply_lora(base, modules, rank=4, alpha=8)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.05)
        expected = ours(TOKENS)
    assert (expected - logits_of(hf_model, TOKENS)).abs().max() > 1e-2
    save_peft_adapter(ours, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert "rank_pattern" not in config or not config["rank_pattern"]
    hf = copy.deepcopy(hf_model)
    with torch.no_grad():
        got = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()(TOKENS).logits
    assert (got - expected).abs().max().item() <= 2e-5
    load_peft_adapter(again, tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(again(TOKENS), expected)
    from mtune.training.checkpointing.merge import save_merged_model

    merged = save_merged_model(oss_dir, ours, tmp_path / "merged")
    assert (logits_of(load_hf_model(merged), TOKENS) - expected).abs().max().item() <= 2e-5


def _expert_adapters(hf_model, adapter_dir):
    """mtune's twin of ``hf_model`` with random rank-4 adapters on both expert projections, saved as PEFT's
    directory in ``adapter_dir``."""
    from mtune.modules.lora import apply_lora
    from mtune.training.checkpointing.peft import save_peft_adapter
    from tests._helpers.models import mtune_twin

    ours = apply_lora(mtune_twin(hf_model, "gpt_oss"), ["gate_up_proj", "down_proj"], rank=4, alpha=8)
    torch.manual_seed(4)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if ".lora_" in name:
                param.normal_(0, 0.05)
    save_peft_adapter(ours, adapter_dir)
    return ours


def test_an_adapter_directory_merges_into_the_whole_experts(hf_model, oss_dir, tmp_path):
    """The PEFT directory of adapters on gate_up_proj and down_proj (rank 4 per expert) merged into the transformers-
    saved base checkpoint (experts whole and transposed) writes the tensors peft's merge_and_unload gives on
    transformers' GptOss model (fp32, 1e-6) and those the run's own merge of the live model writes; a key the merge
    reads wrong would differ by the adapters' deltas (over 1e-2). Mutation seen failing: the directory's gate_up_proj
    adapter split into gate and up halves as for Qwen3-MoE (the merge then names model.layers.0.mlp.experts.0
    .gate_proj.weight, which the checkpoint does not hold)."""
    import copy

    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from mtune.training.checkpointing.merge import save_merged_model

    ours = _expert_adapters(hf_model, tmp_path / "adapter")
    merged = load_file(str(save_merged_model(oss_dir, tmp_path / "adapter", tmp_path / "merged") / "model.safetensors"))
    live = load_file(str(save_merged_model(oss_dir, ours, tmp_path / "live") / "model.safetensors"))
    with torch.no_grad():
        reference = peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), tmp_path / "adapter").merge_and_unload()
    expected = {k: v.detach() for k, v in reference.state_dict().items()}
    base = load_file(str(oss_dir / "model.safetensors"))
    assert set(merged) == set(base) == set(live)
    for key in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert (merged[key] - base[key]).abs().max().item() > 1e-2  # the adapters moved it
    for key, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[key], rtol=0, atol=1e-6, msg=key)
        torch.testing.assert_close(tensor, live[key], rtol=0, atol=1e-6, msg=key)


def test_qlora_stores_experts_of_the_published_width_as_nf4():
    """gpt-oss's experts (2880 x 5760 and 2880 x 2880 per expert) are not a whole number of torchao's 256-scale
    groups (16384 values), so their NF4 uses the largest power-of-two group that divides an expert's scales (128
    and 64 for those; here 2880-wide experts of 1152 and 576 rows, which take the same groups at a tenth of the
    size): each expert's NF4 rows dequantize to exactly the rows of the whole weight's dequantization, and an
    expert's matmul through its NF4 part equals the dequantized weight's. Mutation seen failing: the group kept at
    256 (the expert split then cuts a group: view error)."""
    from mtune.modules.expert_linear import ExpertLinear
    from mtune.modules.nf4_linear import linear_maybe_nf4

    torch.manual_seed(0)
    for hidden, groups in ((1152, 128), (576, 64)):
        layer = ExpertLinear(2, 2880, hidden, bias=True, dtype=torch.bfloat16)
        layer.weight.data.normal_(0, 0.02)
        layer.nf4 = True
        layer.quantize_()
        assert layer.weight.scaler_block_size == groups
        whole = layer.plain_weight()
        x = torch.randn(3, 2880, dtype=torch.bfloat16)
        for e in range(2):
            part = layer.piece(e)[0]
            assert torch.equal(part.get_original_weight(), whole[e])
            torch.testing.assert_close(linear_maybe_nf4(x, part), x @ whole[e].t(), rtol=0, atol=0)


def test_the_sharded_loader_reads_whole_experts(oss_dir):
    """The FSDP2 loader's path on one unsharded process (every row) turns the whole, transposed experts as the
    single-device loader does: the same logits (two ranks: the test below). Mutation seen failing: the sharded
    loader left untransposed (a shape error naming the key)."""
    from mtune.training.checkpointing.sharded import load_hf_checkpoint_sharded

    model = load_hf_checkpoint_sharded(build_model("gpt_oss", "tiny"), oss_dir, dtype=torch.float32, device="cpu")
    assert torch.equal(logits_of(model.eval(), TOKENS), logits_of(load_model_from_hf(oss_dir).eval(), TOKENS))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_dequantizes_as_transformers_does(dtype):
    """Random MXFP4 expert blocks and scales (every code, scales 2**-20 to 2**12) dequantize to exactly
    transformers' convert_moe_packed_tensors, as [E, out, in] rows (transformers' is their transpose). Mutations
    seen failing: the high nibble first; the scale bias 128."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from mtune.models.gpt_oss.mxfp4 import dequantize_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)  # 3 experts, 8 rows of 128
    scales = torch.randint(107, 140, (3, 8, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    assert ours.shape == (3, 8, 128) and theirs.shape == (3, 128, 8)
    assert torch.equal(ours, theirs.transpose(1, 2))


def _mxfp4_experts(state: dict) -> tuple[dict, dict]:
    """``state`` (a transformers-saved gpt-oss) with its expert weights as the hub publishes them (random MXFP4
    ``*_blocks`` / ``*_scales``), and with those dequantized by transformers' convert_moe_packed_tensors (fp32)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(1)
    quantized, dense = dict(state), dict(state)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows_out = state[key].shape  # transformers: [E, in, out]
        blocks = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(119, 124, (experts, rows_out, rows_in // 32), generator=gen, dtype=torch.uint8)
        del quantized[key]
        quantized[f"{key}_blocks"], quantized[f"{key}_scales"] = blocks, scales
        dense[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    return quantized, dense


def _write_checkpoint(out, files: dict[str, dict], config: dict):
    """A checkpoint directory in ``out``: ``files`` (file name -> tensors; an index when there are several) and
    ``config``."""
    from safetensors.torch import save_file

    out.mkdir()
    for name, tensors in files.items():
        save_file(tensors, str(out / name), metadata={"format": "pt"})
    if len(files) > 1:
        weight_map = {key: name for name, tensors in files.items() for key in tensors}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_hubs_mxfp4_experts_load_dequantized(oss_dir, tmp_path):
    """The tiny checkpoint with its experts as the hub publishes them (MXFP4 ``*_blocks`` / ``*_scales``, an mxfp4
    ``quantization_config``; here random codes and scales) loads with the logits of the same checkpoint whose experts
    transformers' convert_moe_packed_tensors dequantized (transformers' model of it, fp32 within 1e-5); a save of it
    drops the quantization_config and transformers reads it back. Mutation seen failing: the blocks dequantized into
    transformers' [E, in, out] layout (a shape error naming the key)."""
    from safetensors.torch import load_file

    quantized, dense = _mxfp4_experts(load_file(str(oss_dir / "model.safetensors")))
    config = json.loads((oss_dir / "config.json").read_text())
    _write_checkpoint(tmp_path / "mxfp4", {"model.safetensors": quantized},
                      {**config, "quantization_config": {"quant_method": "mxfp4"}})
    _write_checkpoint(tmp_path / "dense", {"model.safetensors": dense}, config)
    model = load_model_from_hf(tmp_path / "mxfp4", dtype=torch.float32).eval()
    expected = logits_of(load_hf_model(tmp_path / "dense"), TOKENS)
    assert (logits_of(model, TOKENS) - expected).abs().max().item() <= FP32_ATOL
    saved = save_hf_checkpoint(model, tmp_path / "saved", source_dir=tmp_path / "mxfp4")
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    assert (logits_of(load_hf_model(saved), TOKENS) - expected).abs().max().item() <= FP32_ATOL


def _two_rank_worker(rank: int, tmp: str, ckpt: str) -> None:
    from mtune.training.checkpointing.dcp import save_gathered_hf_checkpoint
    from mtune.training.checkpointing.sharded import load_hf_checkpoint_sharded
    from mtune.training.distributed import shard_model
    from mtune.training.model_setup import resolve_model_source, setup_model

    model, _ = setup_model(resolve_model_source({"checkpoint_dir": ckpt}), device=torch.device("cpu"),
                           dtype=torch.float32, materialize=False)
    shard_model(model)
    load_hf_checkpoint_sharded(model, ckpt, dtype=torch.float32, device="cpu")
    experts = model.layers[0].mlp.experts.gate_up_proj.weight
    with torch.no_grad():
        logits = model.eval()(TOKENS)
    torch.save({"logits": logits, "local_experts": experts.to_local().shape[0]}, f"{tmp}/rank{rank}.pt")
    save_gathered_hf_checkpoint(model, f"{tmp}/export", source_dir=ckpt)


def test_two_ranks_load_their_experts_and_export_them_whole(oss_dir, tmp_path):
    """FSDP2 on 2 CPU processes: each rank reads its 4 of the 8 experts' rows out of the whole, transposed
    checkpoint tensors; the sharded model's logits equal one device's (fp32, 1e-5), and the gathered export writes
    whole experts that transformers loads with the same logits. Mutation seen failing: every rank reading the first
    experts' rows (rank 1's logits then differ)."""
    from tests._helpers.distributed import run_on_ranks

    run_on_ranks(_two_rank_worker, tmp_path, str(tmp_path), str(oss_dir))
    expected = logits_of(load_model_from_hf(oss_dir).eval(), TOKENS)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert out["local_experts"] == 4
        assert (out["logits"] - expected).abs().max().item() <= FP32_ATOL
    assert (logits_of(load_hf_model(tmp_path / "export"), TOKENS) - expected).abs().max().item() <= FP32_ATOL


def _mxfp4_in_two_files(oss_dir, out):
    """The hub's layout of ``oss_dir`` in ``out``: MXFP4 experts (:func:`_mxfp4_experts`), their blocks in one file
    and everything else in another, an index naming both, an mxfp4 ``quantization_config``; returns ``(out, the
    dequantized twin's tensors)``."""
    from safetensors.torch import load_file

    quantized, dense = _mxfp4_experts(load_file(str(oss_dir / "model.safetensors")))
    files = {"model-00001-of-00002.safetensors": {k: v for k, v in quantized.items() if k.endswith("_blocks")},
             "model-00002-of-00002.safetensors": {k: v for k, v in quantized.items() if not k.endswith("_blocks")}}
    config = json.loads((oss_dir / "config.json").read_text())
    return _write_checkpoint(out, files, {**config, "quantization_config": {"quant_method": "mxfp4"}}), dense


def _mxfp4_rank_worker(rank: int, tmp: str, ckpt: str) -> None:
    from mtune.training.checkpointing.sharded import load_hf_checkpoint_sharded
    from mtune.training.distributed import shard_model

    model = build_model("gpt_oss", "tiny")  # on meta
    shard_model(model)
    load_hf_checkpoint_sharded(model, ckpt, dtype=torch.bfloat16, device="cpu")
    experts = {name: p.to_local() for name, p in model.named_parameters() if ".experts." in name}
    with torch.no_grad():
        logits = model.eval()(TOKENS)
    torch.save({"logits": logits, "experts": experts}, f"{tmp}/rank{rank}.pt")


def test_two_ranks_dequantize_their_experts_of_the_hubs_mxfp4_checkpoint(oss_dir, tmp_path):
    """FSDP2 on 2 CPU processes from the hub's layout (MXFP4 blocks in one file, their scales in another, an index
    naming both): each rank's rows of every expert parameter (its 4 of the 8 experts) equal the single-device load's
    bit for bit (bf16), and both ranks' logits equal one device's exactly. Mutation seen failing: every rank reading
    the first experts' blocks and scales (rank 1's rows differ)."""
    from tests._helpers.distributed import run_on_ranks

    ckpt = _mxfp4_in_two_files(oss_dir, tmp_path / "mxfp4")[0]

    run_on_ranks(_mxfp4_rank_worker, tmp_path, str(tmp_path), str(ckpt))
    one = load_model_from_hf(ckpt, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = one(TOKENS)
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(out["experts"]) == 8  # 2 layers x gate_up / down x weight / bias
        for name, local in out["experts"].items():
            assert local.shape[0] == 4 and torch.equal(local, one.get_parameter(name)[4 * rank:4 * rank + 4]), name
        assert torch.equal(out["logits"], expected)


def test_an_adapter_merges_into_the_hubs_mxfp4_experts_dequantized(hf_model, oss_dir, tmp_path):
    """The expert adapters' directory merged into the hub's layout (MXFP4 blocks and scales in two files) writes,
    in fp32, exactly what merging it into the dequantized twin (transformers' convert_moe_packed_tensors) writes:
    the experts whole and transposed under their plain keys, no blocks or scales, and a config without the
    quantization_config. Mutation seen failing: the dequantized [E, out, in] experts written untransposed (the
    merge then folds the adapters into the wrong features: a shape error on down_proj)."""
    from safetensors.torch import load_file

    from mtune.training.checkpointing.merge import save_merged_model

    _expert_adapters(hf_model, tmp_path / "adapter")
    ckpt, dense = _mxfp4_in_two_files(oss_dir, tmp_path / "mxfp4")
    twin = _write_checkpoint(tmp_path / "dense", {"model.safetensors": dense},
                             json.loads((oss_dir / "config.json").read_text()))
    merged = save_merged_model(ckpt, tmp_path / "adapter", tmp_path / "merged", dtype=torch.float32)
    expected = load_file(str(save_merged_model(twin, tmp_path / "adapter", tmp_path / "twin_merged",
                                               dtype=torch.float32) / "model.safetensors"))
    got = {}
    for path in merged.glob("*.safetensors"):
        got.update(load_file(str(path)))
    assert set(got) == set(expected) and not any(k.endswith(("_blocks", "_scales")) for k in got)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    assert "quantization_config" not in json.loads((merged / "config.json").read_text())
