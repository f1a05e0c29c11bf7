"""QLoRA's NF4 experts under FSDP2 (2 CPU ranks, gloo): each rank's NF4 shard of every expert projection equals,
bit for bit, its experts' rows of the single-device NF4 weight, for every checkpoint layout (per-expert keys spread
over several files, whole and transposed, gpt-oss's MXFP4 blocks, gate and up side by side) and for random weights.

Why every rank reads every expert: torchao centres a weight's 64-value scales on the mean of *all* of them before
quantizing them to 8 bits, so one rank quantizing only its experts gets other scales
(`test_quantizing_a_ranks_experts_alone_gives_other_scales`)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtune.models import model_args
from mtune.modules.expert_linear import ExpertLinear
from mtune.modules.nf4_linear import is_nf4, quantize_nf4
from mtune.training.checkpointing.dcp import gathered_state_dict_items
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.model_setup import ModelSource, resolve_model_source, setup_model, setup_sharded_model
from tests._helpers.distributed import run_on_ranks
from tests._helpers.models import write_tiny_hf_model

CPU = torch.device("cpu")
LORA = dict(modules=["q_proj", "v_proj"], rank=4, alpha=8, quantize_base=True)
PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
# random weights with experts of 32 x 256: 128 scales each, so a scaler block of 128 (the 2-D rows' would be 256)
RANDOM = ModelSource("qwen3_moe", dataclasses.replace(model_args("qwen3_moe", "tiny"), moe_intermediate_dim=32), None)


def _nf4_experts(model) -> dict[str, dict]:
    """Every NF4 expert weight's local tensor (a rank's shard, or the whole weight) as its inner tensors."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ExpertLinear) and module.nf4:
            weight = module.weight.to_local() if hasattr(module.weight, "to_local") else module.weight
            assert is_nf4(weight), name
            out[name] = {"shape": tuple(weight.shape), "scaler_block": weight.scaler_block_size,
                         **{part: getattr(weight, part).clone() for part in PARTS}}
    return out


def _worker(rank: int, tmp: str, checkpoints: dict) -> None:
    out = {}
    for label, ckpt in checkpoints.items():
        model, _ = setup_sharded_model(resolve_model_source({"checkpoint_dir": ckpt}), device=CPU,
                                       dtype=torch.bfloat16, seed=0, lora=LORA, fsdp_reshard_after_forward=True)
        out[label] = _nf4_experts(model)
        if label == "side_by_side":  # a gathered save dequantizes each rank's NF4 rows: whole [E, out, in] experts
            plain = phases.plain_form(MemoryConfig(lora=LORA))
            out["gathered"] = {name: tensor for name, tensor in gathered_state_dict_items(model, plain=plain)
                               if ".experts." in name}
    model, _ = setup_sharded_model(RANDOM, device=CPU, dtype=torch.bfloat16, seed=5, lora=LORA,
                                   fsdp_reshard_after_forward=True)
    out["random"] = _nf4_experts(model)
    torch.save(out, f"{tmp}/rank{rank}.pt")


def _mxfp4(src, dst):
    """``src`` (a transformers-saved gpt-oss) with its expert weights as random MXFP4 blocks and scales, as the
    hub publishes them (the experts' ``[E, out, in / 32, 16]`` blocks, ``[E, out, in / 32]`` scales)."""
    state, gen = load_file(str(src / "model.safetensors")), torch.Generator().manual_seed(1)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, rows_in, rows_out = state.pop(key).shape
        state[f"{key}_blocks"] = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=gen,
                                               dtype=torch.uint8)
        state[f"{key}_scales"] = torch.randint(119, 124, (experts, rows_out, rows_in // 32), generator=gen,
                                               dtype=torch.uint8)
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    return dst


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nf4_experts")
    oss = write_tiny_hf_model(tmp, "gpt_oss")
    checkpoints = {"per_expert": write_tiny_hf_model(tmp, "qwen3_moe", sharded=True, shard_size="400KB"),
                   "whole_transposed": oss, "mxfp4": _mxfp4(oss, tmp / "mxfp4"),
                   "side_by_side": write_tiny_hf_model(tmp, "gemma4_moe")}
    run_on_ranks(_worker, tmp, str(tmp), {k: str(v) for k, v in checkpoints.items()})
    ranks = [torch.load(tmp / f"rank{r}.pt") for r in range(2)]
    return checkpoints, ranks


def _single_device(label, ckpt):
    torch.manual_seed(5)
    source = RANDOM if ckpt is None else resolve_model_source({"checkpoint_dir": ckpt})
    return setup_model(source, device=CPU, dtype=torch.bfloat16, lora=LORA)[0]


@pytest.mark.parametrize("label", ["per_expert", "whole_transposed", "mxfp4", "side_by_side", "random"])
def test_each_ranks_nf4_experts_are_its_rows_of_one_devices(shards, label):
    """Mutations seen failing: every rank keeping the first experts' rows (rank 1 differs, every layout); each
    rank quantizing its experts alone (the scales differ); the stack quantized as its 2-D rows (torchao's scaler
    block of 256 instead of the experts' 128: random weights)."""
    checkpoints, ranks = shards
    single = _nf4_experts(_single_device(label, checkpoints.get(label)))
    assert single and all(set(rank[label]) == set(single) for rank in ranks)
    for name, whole in single.items():
        for r, rank in enumerate(ranks):
            got = rank[label][name]
            rows = whole["shape"][0] // 2
            assert got["shape"] == (rows, whole["shape"][1]) and got["scaler_block"] == whole["scaler_block"], name
            assert label != "random" or got["scaler_block"] == 128
            for part in PARTS:
                expected = whole[part] if part == "scaler_mean" else whole[part].view(2, -1)[r]
                assert torch.equal(got[part], expected), (label, name, r, part)


def test_quantizing_a_ranks_experts_alone_gives_other_scales():
    """The fact the sharded load is built on: a rank's experts of a whole-stack NF4 weight have the codes and the
    second-level factors' layout of quantizing those experts alone, but not the same scales, since torchao centres
    every scale on the mean of the whole weight's (``scaler_mean``) before quantizing them."""
    experts = torch.randn(8, 128, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    experts[4:] *= 3  # the second rank's experts larger: their scales' mean is not the stack's
    whole, alone = quantize_nf4(experts).data, quantize_nf4(experts[4:]).data
    assert torch.equal(whole.quantized_data.view(2, -1)[1], alone.quantized_data)  # codes: per 64 values
    assert whole.scaler_mean != alone.scaler_mean
    assert not torch.equal(whole.quantized_scalers.view(2, -1)[1], alone.quantized_scalers)


def test_a_gathered_save_writes_whole_dequantized_experts(shards):
    """Rank 0's gathered tensors of the NF4 experts (dequantized rows, all-gathered) are one device's
    ``[E, out, in]`` dequantized weights exactly. Mutation seen failing: the gathered rows left 2-D."""
    checkpoints, ranks = shards
    single = _single_device("side_by_side", checkpoints["side_by_side"])
    gathered = ranks[0]["gathered"]
    experts = {f"{name}.weight": m for name, m in single.named_modules() if isinstance(m, ExpertLinear)}
    assert set(experts) <= set(gathered)
    for name, module in experts.items():
        assert torch.equal(gathered[name], module.plain_weight()), name


def test_ranks_that_do_not_divide_the_experts_are_refused_in_one_line():
    """3 ranks cannot each hold whole experts of 8 (an expert's NF4 scales are a block of their own): shard_model
    says so, naming the weight and the key, before anything is read."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from mtune.config.errors import ConfigError
    from mtune.training.distributed import shard_model

    model, _ = setup_model(RANDOM, device=CPU, dtype=torch.bfloat16, lora=LORA, materialize=False)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=3)
    try:
        with pytest.raises(ConfigError, match=r"^layers\.0\.mlp\.experts\.gate_proj\.weight: its 8 experts do not "
                                              r"split evenly over 3 ranks, .*lora\.quantize_base=false$"):
            shard_model(model)
    finally:
        dist.destroy_process_group()
