"""Model setup streams a checkpoint into a meta-device model: the full-precision model is never allocated whole, and
QLoRA's frozen weights are NF4 as soon as they arrive."""

from dataclasses import replace

import pytest
import torch
from torch import nn

from mtune.modules.lora import reset_lora_parameters
from mtune.modules.nf4_linear import is_nf4
from mtune.training.memory import phases
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
    from mtune.training.checkpointing import placing

    original_place = placing._place

    def watch(model, name, tensor, dtype, device):
        original_place(model, name, tensor, dtype, device)
        full_precision_alive.append(sum(
            1 for n, m in model.named_modules()
            if n.startswith("layers.") and n.endswith("proj") and not m.weight.is_meta and not is_nf4(m.weight)))

    monkeypatch.setattr(placing, "_place", watch)
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

    from mtune.training.memory.registry import MemoryConfig
    from mtune.training.model_setup import parameter_summary

    lora, full = MemoryConfig(lora={"modules": ["q_proj"]}), MemoryConfig()
    model = nn.Module()
    model.base = nn.Linear(1000, 2600, bias=False)  # 2.6M
    model.lora_a = nn.Linear(1000, 260, bias=False)  # 0.26M adapter parameters, named as LoRA's are
    model.base.requires_grad_(False)
    assert parameter_summary(model, "llama3", lora) == ("llama3, 2.6M base parameters + 0.26M adapter = 2.9M, 0.26M "
                                                        "trainable (9.09%)")
    model.base.requires_grad_(True)
    del model.lora_a
    assert parameter_summary(model, "llama3", full) == "llama3, 2.6M parameters, 2.60M trainable (100.00%)"



@pytest.mark.parametrize("tied", [False, True])
def test_random_weights_arrive_one_module_at_a_time_with_init_weights_values(tied, monkeypatch):
    # without a checkpoint (random weights: the planner, benchmarks, the GPU suite) the frozen base must not exist
    # whole on the device either: weight offloading and NF4 take each module as it is drawn
    source = resolve_model_source({"family": "llama3_1", "size": "tiny"})
    source = replace(source, args=replace(source.args, tie_embeddings=tied))
    lora = {"modules": ["q_proj", "v_proj", "gate_proj"], "rank": 4, "alpha": 8, "quantize_base": True}
    to_empty = nn.Module.to_empty

    def one_module(self, *, device, recurse=True):
        assert not recurse, "to_empty(recurse=True) would allocate every weight at once"
        return to_empty(self, device=device, recurse=recurse)

    arrived = []
    on_weights = phases.on_weights
    monkeypatch.setattr(nn.Module, "to_empty", one_module)
    monkeypatch.setattr(phases, "on_weights", lambda model, module, *args: (
        on_weights(model, module, *args), arrived.append(is_nf4(getattr(module, "weight", None)))))
    torch.manual_seed(0)
    model, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    monkeypatch.undo()
    nf4 = sum(1 for m in model.modules() if is_nf4(getattr(m, "weight", None)))
    assert nf4 == 7 * source.args.n_layers and sum(arrived) == nf4  # each NF4 base quantized as it arrived
    # oracle: the whole-model initialisation of the model without adapters (so the base does not depend on them),
    # then the adapters' own draws
    torch.manual_seed(0)
    plain, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, materialize=False)
    plain.to_empty(device="cpu")
    plain.init_weights()
    reference, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=lora,
                               materialize=False)
    reference.to_empty(device="cpu")
    reference.load_state_dict(plain.state_dict(), strict=False)
    reset_lora_parameters(reference)
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        want = expected[name]
        if is_nf4(param):
            param, want = param.get_original_weight(), want.get_original_weight()
        assert torch.equal(param, want), name
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied


def test_setup_model_continues_from_lora_adapter_dir_and_refuses_a_damaged_one(tmp_path):
    """``lora.adapter_dir`` gives the adapters the saved tensors (oracle: the saving model's own adapters, trained
    away from a fresh init); with verify_checksums a byte changed in the checkpoint is refused before loading.
    Mutations seen failing: setup_model without its adapter block (fresh adapters); without the checksum check."""
    from mtune.training.checkpointing.checkpoint_dir import CheckpointWriter
    from mtune.training.checkpointing.manifest import DamagedCheckpointError
    from mtune.training.checkpointing.peft import save_peft_adapter

    source = resolve_model_source({"family": "llama3_1", "size": "tiny"})
    lora = {"modules": ["q_proj", "v_proj"], "rank": 4, "alpha": 8, "use_dora": True}
    saved, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=lora)
    trained = {name: torch.randn_like(p) for name, p in saved.named_parameters() if p.requires_grad}
    saved.load_state_dict(trained, strict=False)
    step = CheckpointWriter(tmp_path).save(step=1, epoch=0, config={}, kind="lora",
                                           write_fn=lambda tmp: save_peft_adapter(saved, tmp / "adapter"))
    node = {**lora, "adapter_dir": str(step / "adapter")}
    model, _ = setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=node, verify_checksums=True)
    loaded = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert loaded.keys() == trained.keys()
    for name, want in trained.items():
        assert torch.equal(loaded[name], want), name
    weights = step / "adapter" / "adapter_model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-8:] = bytes(8)  # the last tensor's tail, not the header: still a readable file
    weights.write_bytes(bytes(raw))
    with pytest.raises(DamagedCheckpointError, match="adapter_model.safetensors: checksum mismatch"):
        setup_model(source, device=torch.device("cpu"), dtype=torch.float32, lora=node, verify_checksums=True)
