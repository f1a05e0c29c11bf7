"""``weight_storage_dtype``: the frozen block linears of the shipped tiny model (pretrained, 4 layers) in fp8,
quantized one tensor at a time while the checkpoint streams in; their bytes, the error against the unquantized
model, skip patterns, refusals, and composition with checkpointing, offloading, DoRA and compile."""

import copy
from pathlib import Path

import pytest
import torch

import mtune
from mtune.config.errors import ConfigError
from mtune.training.memory.registry import MemoryConfig
from mtune.data import instruct_dataset
from mtune.data.collate import collate_padded
from mtune.modules.fp8_linear import FrozenFp8Linear, has_fp8_storage, is_fp8_stored, stored_weight
from mtune.modules.lora import LoRALinear
from mtune.modules.lora_state import lora_state_dict, merge_lora_weights
from mtune.modules.loss import CrossEntropyLoss
from mtune.tokenizers import load_tokenizer
from mtune.training.memory import phases
from mtune.training.memory.techniques.activation_offloading.offload import OffloadActivations
from tests._helpers.training import apply_memory_techniques
from mtune.training.placement import Placement
from mtune.training.model_setup import resolve_model_source, setup_model
from tests._helpers.training import assert_close, assert_identical, loss_and_grads

TINY = Path(mtune.__file__).parent / "assets" / "tiny"
SOURCE = resolve_model_source({"checkpoint_dir": str(TINY / "model")})
LORA = {"modules": ["q_proj", "v_proj"], "rank": 8, "alpha": 16}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def batch():
    tokenizer = load_tokenizer(str(TINY / "model"), max_seq_len=64)
    dataset = instruct_dataset(tokenizer, source=str(TINY / "data" / "train.jsonl"), train_on_input=False)
    return collate_padded([dataset[i] for i in range(16)], pad_id=tokenizer.pad_id)


def _model(dtype=torch.float32, lora=LORA, **memory):
    return setup_model(SOURCE, device=CPU, dtype=dtype, lora=lora, memory=MemoryConfig(**memory))[0]


def _logits_and_loss(model, batch):
    with torch.no_grad():
        logits = model(batch["tokens"]).float()
        loss_sum, n = CrossEntropyLoss()(logits, batch["labels"])
    return logits, (loss_sum / n).item()


def _block_linears(model):
    return {n: m for n, m in model.layers.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}


def test_streamed_load_quantizes_each_weight_on_arrival_to_half_the_bf16_bytes(monkeypatch):
    unquantized_seen = []
    on_weights = phases.on_weights

    def quantize_and_count(model, module, *args):  # after each tensor arrives: how many sit in bf16 right now?
        on_weights(model, module, *args)
        unquantized_seen.append(sum(has_fp8_storage(m) and not m.weight.is_meta and not is_fp8_stored(m)
                                    for m in model.modules()))

    monkeypatch.setattr(phases, "on_weights", quantize_and_count)
    model = _model(torch.bfloat16, weight_storage_dtype="float8_e4m3fn")
    assert unquantized_seen and max(unquantized_seen) == 0  # the bf16 model never exists at once

    linears = _block_linears(model)
    assert len(linears) == 4 * 7 and all(is_fp8_stored(m) for m in linears.values())
    assert sum(isinstance(m, LoRALinear) for m in linears.values()) == 4 * 2  # adapted: only the base is fp8
    assert all(p.dtype == torch.bfloat16 for k, p in lora_state_dict(model).items())
    # embeddings, norms and lm_head (tied here) keep the model dtype
    assert model.embed_tokens.weight.dtype == model.norm.weight.dtype == torch.bfloat16
    assert not has_fp8_storage(model.lm_head)
    fp8_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears.values())
    scale_bytes = sum(m.weight_scale.numel() * 4 for m in linears.values())
    bf16_bytes = sum(m.weight.numel() * 2 for m in linears.values())
    assert fp8_bytes == bf16_bytes // 2
    # the scales: 4 bytes per output row, 4/256 or 4/512 bytes per value: 1.39% of the fp8 codes here
    assert scale_bytes == 4 * sum(m.out_features for m in linears.values())
    assert 0.505 < (fp8_bytes + scale_bytes) / bf16_bytes < 0.51


@pytest.mark.parametrize("storage,max_rel_l2,max_loss_change", [("float8_e4m3fn", 0.015, 0.002),
                                                                 ("float8_e5m2", 0.04, 0.002)])
def test_logits_and_loss_stay_close_to_the_unquantized_model(batch, storage, max_rel_l2, max_loss_change):
    # Measured on 16 word-reversal samples, fp32 compute: e4m3 logits 0.90% off (relative L2), loss 2.4120 ->
    # 2.4128 (+0.03%); e5m2 2.58%, 2.4131 (+0.04%). bf16 compute: e4m3 0.99%, e5m2 2.57%
    # (benchmarks/results/tiny_memory_figures/fp8.json).
    reference_logits, reference_loss = _logits_and_loss(_model(), batch)
    logits, loss = _logits_and_loss(_model(weight_storage_dtype=storage), batch)
    assert (logits - reference_logits).norm() / reference_logits.norm() < max_rel_l2
    assert abs(loss - reference_loss) / reference_loss < max_loss_change


def test_skip_patterns_keep_matching_modules_in_the_model_dtype():
    model = _model(weight_storage_dtype="float8_e4m3fn",
                   weight_storage_skip_patterns=["model.layers.0.*", "layers.*.mlp.down_proj"])
    for name, module in _block_linears(model).items():
        assert is_fp8_stored(module) == (not name.startswith("0.") and not name.endswith("down_proj")), name
    with pytest.raises(ConfigError, match=r"weight_storage_skip_patterns \['model.layer.0.\*'\] match no linear"):
        _model(weight_storage_dtype="float8_e4m3fn", weight_storage_skip_patterns=["model.layer.0.*"])


def test_trainable_and_nf4_weights_are_refused():
    with pytest.raises(ConfigError, match="weight_storage_dtype=float8_e4m3fn stores frozen weights, but "
                                          "layers.0.self_attn.q_proj.weight is trainable"):
        _model(lora=None, weight_storage_dtype="float8_e4m3fn")
    with pytest.raises(ConfigError, match="cannot be combined with lora.quantize_base=true"):
        _model(lora={**LORA, "quantize_base": True}, weight_storage_dtype="float8_e5m2")


def _loss_and_grads(model, batch, context=None):
    return loss_and_grads(model, batch["tokens"], batch["labels"], context, seed=1)


def test_checkpointing_selective_op_and_offloading_change_nothing_on_an_fp8_base(batch):
    # LoRA (with dropout) on an fp8 base, then block checkpointing on even blocks ... and selective_op on all blocks
    # with host offloading of what they keep: the same bits as the fp8 base alone.
    lora = {**LORA, "dropout": 0.1}
    batch = {k: v[:4] for k, v in batch.items() if k in ("tokens", "labels")}
    plain = _model(lora=lora, weight_storage_dtype="float8_e4m3fn")
    expected = _loss_and_grads(plain, batch)
    block = copy.deepcopy(plain)
    apply_memory_techniques(block, MemoryConfig(enable_activation_checkpointing=True,
                                                activation_checkpointing_every_n_layers=2))
    selective = copy.deepcopy(plain)
    apply_memory_techniques(selective, MemoryConfig(enable_activation_checkpointing=True,
                                                    activation_checkpointing_policy="selective_op"))
    offload = OffloadActivations(use_streams=False, min_offload_bytes=0, params=selective.parameters(),
                                 placement=Placement("cpu", distinct=True))
    for got in (_loss_and_grads(block, batch), _loss_and_grads(selective, batch, offload)):
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(got[1][k], expected[1][k]) for k in expected[1])
    assert offload.offloaded_bytes > 0


def test_dora_on_an_fp8_base_and_the_merge_without_a_base_checkpoint():
    model = _model(lora={**LORA, "use_dora": True}, weight_storage_dtype="float8_e4m3fn")
    q = model.layers[0].self_attn.q_proj
    torch.testing.assert_close(q.magnitude, torch.linalg.norm(stored_weight(q).float(), dim=1))
    with torch.no_grad():
        q.lora_b.weight.normal_(0, 0.02)
    # Without a base checkpoint to merge into, the merged state dict folds the adapter into the stored (fp8-rounded)
    # base: plain tensors in the model dtype, no fp8 codes.
    merged = merge_lora_weights(model)
    assert all(v.dtype == torch.float32 for v in merged.values())
    torch.testing.assert_close(merged["layers.0.self_attn.q_proj.weight"], q.merged_weight())
    k = model.layers[0].self_attn.k_proj
    assert isinstance(k, FrozenFp8Linear) and torch.equal(merged["layers.0.self_attn.k_proj.weight"], stored_weight(k))


@pytest.mark.slow
def test_compile_per_block_on_an_fp8_base_matches_eager(batch):
    eager = _model(weight_storage_dtype="float8_e4m3fn")
    compiled = copy.deepcopy(eager)
    compiled.layers[0].compile()  # one block: compile on CPU is slow
    assert_close(_loss_and_grads(eager, batch), _loss_and_grads(compiled, batch))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_base_on_cuda_in_bf16(batch):
    cuda = torch.device("cuda")
    batch = {k: v.to(cuda) for k, v in batch.items()}
    reference = setup_model(SOURCE, device=cuda, dtype=torch.bfloat16, lora=LORA)[0]
    model = setup_model(SOURCE, device=cuda, dtype=torch.bfloat16, lora=LORA,
                        memory=MemoryConfig(weight_storage_dtype="float8_e4m3fn"))[0]
    assert all(is_fp8_stored(m) and m.weight.is_cuda for m in _block_linears(model).values())
    (ref_logits, ref_loss), (logits, loss) = _logits_and_loss(reference, batch), _logits_and_loss(model, batch)
    assert (logits - ref_logits).norm() / ref_logits.norm() < 0.02 and abs(loss - ref_loss) < 0.005 * ref_loss
    loss_sum, n = CrossEntropyLoss()(model(batch["tokens"]), batch["labels"])
    (loss_sum / n).backward()
    adapters = [p for p in model.parameters() if p.requires_grad]  # state_dict() values are detached: no .grad
    assert adapters and all(p.grad is not None and p.grad.isfinite().all() for p in adapters)


def test_fp8_base_with_weight_offloading_and_selective_op_is_exact():
    # Weight offloading moves the fp8 codes (1 byte a value) and the blocks' frozen fp32 norms; the row scales (a
    # buffer) stay on the device.
    from mtune.training.memory.techniques.weight_offloading import WeightOffloading
    from tests._helpers.offloading import offloaded_loss_and_grads, offloaded_pair

    memory = MemoryConfig(weight_storage_dtype="float8_e4m3fn", enable_activation_checkpointing=True,
                          activation_checkpointing_policy="selective_op",
                          weight_offloading=WeightOffloading(type="block_level", blocks_per_group=1, use_streams=False))
    plain, twin, offloader, _ = offloaded_pair(memory)
    stored = [m for m in twin.layers.modules() if is_fp8_stored(m)]
    assert len(stored) == 4 * 7
    moved = sum(slot.nbytes for slots in offloader._slots for slot in slots)
    norms = sum(p.numel() * 4 for n, p in twin.layers.named_parameters() if "layernorm" in n)
    assert moved == sum(m.weight.numel() for m in stored) + norms
    assert_identical(offloaded_loss_and_grads(plain), offloaded_loss_and_grads(twin))
    # every block in forward, then every block but the last (still resident) for recomputation and backward
    assert offloader.copies_to_compute == moved + moved * 3 // 4
