"""Model setup streams a checkpoint into a meta-device model: the full-precision model is never allocated whole, and
QLoRA's frozen weights are NF4 as soon as they arrive."""

import torch
from torch import nn

from mtune.modules.nf4_linear import is_nf4
from mtune.training.model_setup import resolve_model_source, setup_model
from tests._helpers.recipes import write_tiny_checkpoint


def test_qlora_setup_never_materialises_the_whole_model(tmp_path, monkeypatch):
    checkpoint = write_tiny_checkpoint(tmp_path)
    source = resolve_model_source({"checkpoint_dir": str(checkpoint)})
    lora = {"modules": ["q_proj", "v_proj"], "rank": 4, "alpha": 8, "quantize_base": True}

    def refuse(self, *args, **kwargs):
        raise AssertionError("to_empty would allocate every weight in full precision at once")

    monkeypatch.setattr(nn.Module, "to_empty", refuse)
    full_precision_alive = []  # after each placement: frozen block weights held in bf16 (placed, not yet NF4)
    from mtune.training.checkpointing import hf

    original_place = hf._place

    def watch(model, name, tensor, dtype, device):
        original_place(model, name, tensor, dtype, device)
        full_precision_alive.append(sum(
            1 for n, m in model.named_modules()
            if n.startswith("layers.") and n.endswith("proj") and not m.weight.is_meta and not is_nf4(m.weight)))

    monkeypatch.setattr(hf, "_place", watch)
    model, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.bfloat16, lora=lora)
    block_linears = [m for n, m in model.named_modules() if n.startswith("layers.") and n.endswith("proj")]
    assert len(block_linears) == 14 and all(is_nf4(m.weight) for m in block_linears)
    # each weight is quantized right after it is placed: never more than the one just read is held in bf16
    assert max(full_precision_alive) == 1
    assert not any(p.is_meta for p in model.parameters())
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.bfloat16 for p in adapters)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(1, 9)[None])).all()


def test_the_parameter_line_gives_the_base_size_and_the_adapter_apart():
    from torch import nn

    from mtune.training.model_setup import parameter_summary

    model = nn.Module()
    model.base = nn.Linear(1000, 2600, bias=False)  # 2.6M
    model.lora_a = nn.Linear(1000, 260, bias=False)  # 0.26M adapter parameters, named as LoRA's are
    model.base.requires_grad_(False)
    assert parameter_summary(model, "llama3") == ("llama3, 2.6M base parameters + 0.26M adapter = 2.9M, 0.26M "
                                                  "trainable (9.09%)")
    model.base.requires_grad_(True)
    del model.lora_a
    assert parameter_summary(model, "llama3") == "llama3, 2.6M parameters, 2.60M trainable (100.00%)"
