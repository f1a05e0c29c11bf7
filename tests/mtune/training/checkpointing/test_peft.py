"""PEFT adapter export / import and merged export, against peft and transformers (the oracles)."""

import json

import pytest
import torch
from safetensors import safe_open

from mtune.modules.lora import LoRALinear
from mtune.modules.lora_state import lora_state_dict
from mtune.training.checkpointing.hf import save_hf_checkpoint
from mtune.training.checkpointing.merge import merged_hf_weights, save_merged_model
from mtune.training.checkpointing.peft import AdapterError, load_peft_adapter, save_peft_adapter
from tests._helpers.lora import lora_cfg, trained_lora_model
from tests._helpers.models import write_tiny_hf_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(5))
# Max |logit| difference between the merged original-precision export of a QLoRA run and the NF4 model it trained,
# on the random tiny test model, fp32 (logits std ~0.32): measured 0.261 (LoRA) and 0.281 (DoRA) with q/v/o adapted.
# It is the NF4 rounding of every frozen linear; docs/checkpoints.md states it.
QLORA_MERGE_DISTANCE = 0.3


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("base"), "llama3_1")


def hf_base(base_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def logits(model):
    with torch.no_grad():
        out = model(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def read_tensors(path):
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update((k, f.get_tensor(k)) for k in f.keys())
    return out


@pytest.mark.parametrize("use_dora", [False, True])
def test_saved_adapter_and_merge_match_peft(use_dora, base_dir, tmp_path):
    model = trained_lora_model(base_dir, use_dora=use_dora)
    ours = logits(model)
    save_peft_adapter(model, tmp_path / "adapter", lora_cfg(use_dora), base_model_name_or_path=base_dir)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir) and config["use_dora"] is use_dora

    reference = peft.PeftModel.from_pretrained(hf_base(base_dir), tmp_path / "adapter").eval()
    ref = logits(reference)
    assert (ref - logits(hf_base(base_dir))).abs().max() > 1e-2  # the adapter matters...
    assert (ours - ref).abs().max().item() <= 1e-5  # ...and PEFT reads it as mtune trained it

    # Merged export from the adapter directory equals PEFT's merge_and_unload.
    merged_dir = save_merged_model(base_dir, tmp_path / "adapter", tmp_path / "merged", max_shard_size="500KB")
    assert len(list(merged_dir.glob("model-*.safetensors"))) > 1
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    peft_merged = reference.merge_and_unload()
    assert (logits(merged) - logits(peft_merged)).abs().max().item() <= 1e-5
    assert (logits(merged) - ours).abs().max().item() <= 1e-5

    # From the live model: the same tensors, bit for bit.
    from_dir = read_tensors(merged_dir)
    from_model = dict(merged_hf_weights(base_dir, model))
    assert from_model.keys() == from_dir.keys()
    assert all(torch.equal(from_model[k], from_dir[k]) for k in from_dir)


def test_merge_keeps_original_precision_and_streams(base_dir, tmp_path):
    # A bf16 base checkpoint: untouched tensors pass through bit for bit, merged ones come back in bf16.
    bf16_dir = tmp_path / "bf16"
    source = read_tensors(base_dir)
    save_hf_checkpoint({k: v.to(torch.bfloat16) for k, v in source.items()}, bf16_dir, source_dir=base_dir)
    model = trained_lora_model(base_dir, modules=["q_proj", "v_proj"])
    stream = merged_hf_weights(bf16_dir, model)
    assert not isinstance(stream, (dict, list))  # a generator: one tensor at a time
    stored = read_tensors(bf16_dir)
    for key, tensor in stream:
        assert tensor.dtype == torch.bfloat16
        if key.endswith(("q_proj.weight", "v_proj.weight")):
            layer = model.get_submodule(key.removeprefix("model.").removesuffix(".weight"))
            delta = layer.scaling * layer.lora_b.weight @ layer.lora_a.weight
            assert torch.equal(tensor, (stored[key].float() + delta).to(torch.bfloat16))
            assert not torch.equal(tensor, stored[key])
        else:
            assert torch.equal(tensor, stored[key])
    out = save_merged_model(bf16_dir, model, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("use_dora", [False, True])
def test_qlora_merge_within_documented_distance(use_dora, base_dir, tmp_path):
    qlora = trained_lora_model(base_dir, use_dora=use_dora, quantize_base=True, modules=["q_proj", "v_proj", "o_proj"])
    assert type(qlora.layers[0].self_attn.q_proj.weight).__name__ == "NF4Tensor"
    trained = logits(qlora)
    save_merged_model(base_dir, qlora, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    distance = (logits(merged) - trained).abs().max().item()
    assert 1e-4 < distance <= QLORA_MERGE_DISTANCE  # the base is the original, not the NF4 copy...
    # ...and the merge is exactly the adapter on the original base: the same A, B (and DoRA magnitudes) on an
    # unquantized LoRA model.
    plain = trained_lora_model(base_dir, use_dora=use_dora, modules=["q_proj", "v_proj", "o_proj"])
    plain.load_state_dict(lora_state_dict(qlora), strict=False)
    assert (logits(merged) - logits(plain)).abs().max().item() <= 1e-5


def test_load_peft_adapter_restores_tensors_and_refuses_mismatch(base_dir, tmp_path):
    saved = trained_lora_model(base_dir, use_dora=True, modules=["q_proj", "v_proj", "lm_head"], seed=2)
    save_peft_adapter(saved, tmp_path / "adapter")
    fresh = trained_lora_model(base_dir, use_dora=True, modules=["q_proj", "v_proj", "lm_head"], seed=3)
    load_peft_adapter(fresh, tmp_path / "adapter")
    want, got = lora_state_dict(saved), lora_state_dict(fresh)
    assert want.keys() == got.keys() and len(want) == 5 * 3  # q, v in 2 layers + lm_head; A, B, magnitude
    assert all(torch.equal(want[k], got[k]) for k in want)

    mismatches = [
        (dict(use_dora=True, modules=["q_proj", "v_proj", "lm_head"], rank=4), "r=8 but the model has lora.rank=4"),
        (dict(use_dora=True, modules=["q_proj", "v_proj", "lm_head"], alpha=8), "lora_alpha=16.0 .* lora.alpha=8.0"),
        (dict(use_dora=True, modules=["q_proj", "v_proj"]), "target_modules=.* lora.modules="),
        (dict(use_dora=False, modules=["q_proj", "v_proj", "lm_head"]), "use_dora=True .* lora.use_dora=False"),
    ]
    for kwargs, message in mismatches:
        other = trained_lora_model(base_dir, **kwargs)
        with pytest.raises(AdapterError, match=message):
            load_peft_adapter(other, tmp_path / "adapter")
    with pytest.raises(AdapterError, match="adapter_config.json: not found"):
        load_peft_adapter(fresh, tmp_path)
    assert sum(isinstance(m, LoRALinear) for m in fresh.modules()) == 5


def test_save_refuses_a_lora_node_that_disagrees_and_the_node_rebuilds_the_adapter(base_dir, tmp_path):
    """rank, alpha and DoRA come from the model, and a lora node saying otherwise is refused; the node rebuilt from a
    saved DoRA adapter has its settings."""
    from mtune.training.checkpointing.peft import lora_node_from_adapter

    model = trained_lora_model(base_dir, use_dora=True, modules=["q_proj", "v_proj"])
    for key, value in (("rank", 4), ("alpha", 8), ("use_dora", False)):
        with pytest.raises(AdapterError, match=rf"^lora\.{key}={value} but the model's adapters have {key}="):
            save_peft_adapter(model, tmp_path / key, {key: value})
    save_peft_adapter(model, tmp_path / "adapter", lora_cfg(True, modules=["q_proj", "v_proj"]))
    assert lora_node_from_adapter(tmp_path / "adapter") == dict(
        modules=["q_proj", "v_proj"], rank=8, alpha=16, dropout=0.0, use_dora=True, quantize_base=False,
        adapter_dir=str(tmp_path / "adapter"))


def test_merge_refuses_what_it_cannot_fold_and_casts_every_tensor(base_dir):
    """No adapter, an adapted module the base lacks, or factors of another shape are refused; with ``dtype`` every
    tensor, adapted or not, comes back in it (oracle: the stored tensors cast, the adapter's B being zero)."""
    from mtune.training.checkpointing.hf import CheckpointError, load_model_from_hf
    from mtune.training.checkpointing.peft import Adapter, AdapterLayer

    with pytest.raises(AdapterError, match="the model has no LoRA adapter to export"):
        merged_hf_weights(base_dir, load_model_from_hf(base_dir))
    stored = read_tensors(base_dir)
    out_dim, in_dim = stored["model.layers.0.self_attn.q_proj.weight"].shape
    zero = AdapterLayer(torch.randn(2, in_dim), torch.zeros(out_dim, 2), 2.0)
    with pytest.raises(CheckpointError, match=r"adapts model\.layers\.9\.self_attn\.q_proj\.weight \(and 0 more\)"):
        merged_hf_weights(base_dir, Adapter({"layers.9.self_attn.q_proj": zero}))
    wrong = AdapterLayer(torch.zeros(2, in_dim + 1), torch.zeros(out_dim, 2), 2.0)
    with pytest.raises(CheckpointError, match=rf"has shape \[{out_dim}, {in_dim}\] but the adapter expects "
                                              rf"\[{out_dim}, {in_dim + 1}\]"):
        list(merged_hf_weights(base_dir, Adapter({"layers.0.self_attn.q_proj": wrong})))
    merged = dict(merged_hf_weights(base_dir, Adapter({"layers.0.self_attn.q_proj": zero}), dtype=torch.bfloat16))
    assert merged.keys() == stored.keys()
    assert all(torch.equal(merged[k], stored[k].to(torch.bfloat16)) for k in stored)
