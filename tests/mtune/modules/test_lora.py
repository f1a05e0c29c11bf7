"""LoRA / DoRA against PEFT (the oracle): same weights and adapters give the same logits, and mtune's export loads
in PEFT."""

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

from mtune.models import build_model
from mtune.modules.lora import LoRALinear, apply_lora, reset_lora_parameters
from mtune.modules.lora_state import (
    adapter_config,
    load_peft_adapter_state_dict,
    lora_state_dict,
    merge_lora_weights,
    peft_adapter_state_dict,
)
from tests._helpers.models import tiny_hf_model

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
TOKENS = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(3))


def mtune_twin(hf_model):
    model = build_model("llama3_1", "tiny", device="cpu")
    state = {k.removeprefix("model."): v for k, v in hf_model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def peft_model(hf, use_dora):
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL, use_dora=use_dora)
    model = peft.get_peft_model(copy.deepcopy(hf), config)
    torch.manual_seed(4)
    with torch.no_grad():  # non-zero B and a magnitude away from ||W||, so the adapters matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
            elif "lora_magnitude_vector" in name:
                param.mul_(1 + 0.1 * torch.randn_like(param))
    return model.eval()


@pytest.mark.parametrize("use_dora", [False, True])
def test_logits_match_peft_and_export_loads_in_peft(use_dora, tmp_path):
    hf = tiny_hf_model("llama3_1")
    reference = peft_model(hf, use_dora)
    model = mtune_twin(hf)
    apply_lora(model, ALL, rank=8, alpha=16, use_dora=use_dora)
    load_peft_adapter_state_dict(model, peft.get_peft_model_state_dict(reference))
    with torch.no_grad():
        ours, ref = model(TOKENS), reference(TOKENS).logits
        plain = hf(TOKENS).logits
    assert (plain - ref).abs().max() > 1e-2  # the adapter changes the output...
    assert (ours - ref).abs().max().item() <= 1e-5  # ...and mtune changes it the same way

    # Export: adapter_model.safetensors + adapter_config.json load with PeftModel.from_pretrained.
    save_file({k: v.contiguous() for k, v in peft_adapter_state_dict(model).items()}, tmp_path / "adapter_model.safetensors")
    config = adapter_config(ALL, rank=8, alpha=16, use_dora=use_dora)
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    with torch.no_grad():
        assert (loaded(TOKENS).logits - ours).abs().max().item() <= 1e-5

    # Merged weights: a plain model holding them gives the adapted logits; PEFT's own merge agrees.
    merged = merge_lora_weights(model)
    assert not any("lora" in k or "magnitude" in k for k in merged)
    plain_model = build_model("llama3_1", "tiny", device="cpu").eval()
    plain_model.load_state_dict(merged, strict=True)
    peft_merged = reference.merge_and_unload().state_dict()
    with torch.no_grad():
        assert (plain_model(TOKENS) - ref).abs().max().item() <= 1e-5
    for key, value in merged.items():
        assert (value - peft_merged["model." + key if key != "lm_head.weight" else key]).abs().max() <= 1e-6


def test_only_adapters_train_and_start_at_base_model():
    model = build_model("llama3_1", "tiny", device="cpu")
    base = copy.deepcopy(model)
    apply_lora(model, ["q_proj", "v_proj", "down_proj"], rank=4, alpha=8, use_dora=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(lora_state_dict(model)) and len(trainable) == 2 * 3 * 3
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), base(TOKENS), rtol=0, atol=1e-6)
    model(TOKENS).square().mean().backward()
    assert all((p.grad is None) != p.requires_grad for p in model.parameters())


def test_meta_build_then_init_starts_at_base_model():
    model = build_model("llama3_1", "tiny")  # meta device
    apply_lora(model, ["q_proj", "lm_head"], rank=4, alpha=8, use_dora=True)
    model.to_empty(device="cpu")
    model.init_weights()  # reaches the LoRA base weights (LoRALinear is an nn.Linear)...
    reset_lora_parameters(model)  # ...then the adapters: B = 0, magnitude = ||W||
    assert isinstance(model.lm_head, LoRALinear)
    assert abs(model.lm_head.weight.std().item() - 0.02) < 2e-3
    plain = build_model("llama3_1", "tiny", device="cpu").eval()
    plain.load_state_dict(merge_lora_weights(model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS), plain(TOKENS), rtol=0, atol=1e-6)


def test_clear_errors():
    tied = build_model("llama3_2", "tiny", device="cpu")
    with pytest.raises(ValueError, match="ties lm_head to embed_tokens: remove lm_head"):
        apply_lora(tied, ["lm_head"], rank=4, alpha=8)
    with pytest.raises(ValueError, match="unknown names \\['qproj'\\]"):
        apply_lora(tied, ["qproj"], rank=4, alpha=8)
    # another family's names (Phi-4's fused projections) beside this one's: refused, not dropped
    with pytest.raises(ValueError) as err:
        apply_lora(build_model("llama3_1", "tiny", device="cpu"), ["qkv_proj", "o_proj", "gate_up_proj"], rank=4,
                   alpha=8)
    assert str(err.value) == ("lora.modules ['gate_up_proj', 'qkv_proj'] match no projection of this llama3 model: it "
                              "has ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', "
                              "'v_proj']")
    lora = apply_lora(build_model("llama3_1", "tiny", device="cpu"), ["q_proj"], rank=4, alpha=8)
    with pytest.raises(ValueError, match="adapter does not match"):
        load_peft_adapter_state_dict(lora, {})


class _OneLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 48, bias=True)

    def forward(self, x):
        return self.proj(x)


def test_dora_with_dropout_trains_as_peft():
    """DoRA in training mode with dropout against PEFT on one layer: same output and adapter gradients under the same
    dropout mask. Guards PEFT's rescaling of the dropped input's base output (not x's) and its detached row norm."""
    torch.manual_seed(0)
    plain = _OneLinear()
    reference = peft.get_peft_model(copy.deepcopy(plain), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["proj"], use_dora=True, lora_dropout=0.3))
    ref_layer = reference.base_model.model.proj
    with torch.no_grad():
        ref_layer.lora_B["default"].weight.normal_(0, 0.3)
        ref_layer.lora_magnitude_vector["default"].weight.mul_(1.5)
    ours = LoRALinear.from_linear(copy.deepcopy(plain.proj), rank=4, alpha=8, dropout=0.3, use_dora=True)
    with torch.no_grad():
        ours.lora_a.weight.copy_(ref_layer.lora_A["default"].weight)
        ours.lora_b.weight.copy_(ref_layer.lora_B["default"].weight)
        ours.magnitude.copy_(ref_layer.lora_magnitude_vector["default"].weight)
    reference.train(), ours.train()
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(6, 48, generator=torch.Generator().manual_seed(2))
    outputs = []
    for model in (reference, ours):
        torch.manual_seed(5)  # one dropout call each: the same mask
        out = model(x)
        (out * weights).sum().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)
    pairs = [(ours.lora_a.weight, ref_layer.lora_A["default"].weight),
             (ours.lora_b.weight, ref_layer.lora_B["default"].weight),
             (ours.magnitude, ref_layer.lora_magnitude_vector["default"].weight)]
    for mine, theirs in pairs:
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)


def test_adapter_a_starts_kaiming_uniform_as_peft():
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform with a=sqrt(5), PEFT's default init), B zero."""
    torch.manual_seed(0)
    layer = LoRALinear.from_linear(torch.nn.Linear(256, 64), rank=16, alpha=32)
    layer.reset_adapter()
    bound = 256**-0.5
    largest = layer.lora_a.weight.abs().max().item()
    assert 0.99 * bound <= largest <= bound  # 4096 draws: the largest lies within 1% of the bound
    assert torch.count_nonzero(layer.lora_b.weight) == 0


def test_merge_adapter_returns_the_dtype_asked_for():
    """merge_adapter(..., dtype=fp32) of a bf16 base: W + s B A computed and returned in fp32, not the base's dtype."""
    from mtune.modules.lora import merge_adapter

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(12, 10, generator=gen).to(torch.bfloat16)
    a, b = torch.randn(3, 10, generator=gen), torch.randn(12, 3, generator=gen)
    merged = merge_adapter(weight, a, b, 0.5, dtype=torch.float32)
    assert merged.dtype == torch.float32
    expected = weight.double() + 0.5 * (b.double() @ a.double())
    torch.testing.assert_close(merged.double(), expected, rtol=0, atol=1e-5)
