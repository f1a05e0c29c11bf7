"""QLoRA's NF4 experts under FSDP2 (2 CPU ranks, gloo): each rank's NF4 shard of every expert projection equals,
bit for bit, its experts' rows of the single-device NF4 weight, for every checkpoint layout (per-expert keys spread
over several files, whole and transposed, gpt-oss's MXFP4 blocks, gate and up side by side) and for random weights.

Each rank reads only its own experts, yet torchao centres a weight's 64-value scales on the mean of *all* of them
before quantizing them to 8 bits, so a rank quantizing its experts alone would get other scales
(`test_quantizing_a_ranks_experts_alone_gives_other_scales`): the ranks all-gather their first-level scales for that
mean (`quantize_nf4_expert_shard`). Random weights are drawn whole on every rank (the RNG stream of one device) and
quantized whole."""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from mtune.models import model_args
from mtune.modules.expert_linear import ExpertLinear
from mtune.modules.nf4_linear import is_nf4, quantize_nf4
from mtune.modules.loss import CrossEntropyLoss
from mtune.training.checkpointing.dcp import (
    gathered_state_dict_items, load_distributed_state, save_distributed_state,
)
from mtune.training.loop import train_step
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.model_setup import ModelSource, resolve_model_source, setup_model, setup_sharded_model
from tests._helpers.distributed import run_on_ranks
from tests._helpers.models import write_tiny_hf_model

CPU = torch.device("cpu")
LORA = dict(modules=["q_proj", "gate_proj"], rank=4, alpha=8, quantize_base=True)  # experts adapted too


def lora_of(source: ModelSource) -> dict:
    """LORA with the family's name for an expert projection: gpt-oss fuses gate and up (``gate_up_proj``)."""
    return {**LORA, "modules": ["q_proj", "gate_up_proj"]} if source.family == "gpt_oss" else LORA
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
                         "n_blocks": weight.n_blocks, "stride": weight.stride(), "nf4": weight.nf4.clone(),
                         **{part: getattr(weight, part).clone() for part in PARTS}}
    return out


def _step_save_and_resume(model, tmp: str, ckpt: str) -> dict:
    """One AdamW step on ``model`` (adapters on the experts too), its adapter-only DCP state saved and loaded into a
    fresh sharded model (other adapter draws, the NF4 bases re-read): what a resumed run starts from."""
    tokens = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
    trained = [p for p in model.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(trained, lr=1e-2)
    train_step(model, [{"tokens": tokens, "labels": tokens.roll(-1, 1)}], CrossEntropyLoss(), adamw, device=CPU,
               world_size=2)
    save_distributed_state(f"{tmp}/dcp", model, adamw, adapter_only=True)
    source = resolve_model_source({"checkpoint_dir": ckpt})
    fresh, _ = setup_sharded_model(source, device=CPU, dtype=torch.bfloat16, seed=1, lora=lora_of(source),
                                   fsdp_reshard_after_forward=True)
    fresh_adamw = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_distributed_state(f"{tmp}/dcp", fresh, fresh_adamw, adapter_only=True)

    def local(m, opt):
        return ({n: p.to_local().clone() for n, p in m.named_parameters() if p.requires_grad},
                [s["exp_avg"].to_local().clone() for s in opt.state.values()])

    return {"saved": local(model, adamw), "resumed": local(fresh, fresh_adamw), "nf4": _nf4_experts(fresh)}


def _worker(rank: int, tmp: str, checkpoints: dict) -> None:
    out = {}
    for label, ckpt in checkpoints.items():
        source = resolve_model_source({"checkpoint_dir": ckpt})
        model, _ = setup_sharded_model(source, device=CPU, dtype=torch.bfloat16, seed=0, lora=lora_of(source),
                                       fsdp_reshard_after_forward=True)
        out[label] = _nf4_experts(model)
        if label == "per_expert":
            out["resume"] = _step_save_and_resume(model, tmp, ckpt)
        if label == "side_by_side":  # a gathered save dequantizes each rank's NF4 rows: whole [E, out, in] experts
            plain = phases.plain_form(MemoryConfig(lora=lora_of(source)))
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
    # per-expert keys over several files, experts of 32 x 256 (scaler block 128, not torchao's 256)
    checkpoints = {"per_expert": write_tiny_hf_model(tmp, "qwen3_moe", sharded=True, shard_size="200KB",
                                                     moe_intermediate_size=32),
                   "whole_transposed": oss, "mxfp4": _mxfp4(oss, tmp / "mxfp4"),
                   "side_by_side": write_tiny_hf_model(tmp, "gemma4_moe")}
    run_on_ranks(_worker, tmp, str(tmp), {k: str(v) for k, v in checkpoints.items()})
    ranks = [torch.load(tmp / f"rank{r}.pt") for r in range(2)]
    return checkpoints, ranks, tmp / "dcp"


def _single_device(label, ckpt):
    torch.manual_seed(5)
    source = RANDOM if ckpt is None else resolve_model_source({"checkpoint_dir": ckpt})
    return setup_model(source, device=CPU, dtype=torch.bfloat16, lora=lora_of(source))[0]


@pytest.mark.parametrize("label", ["per_expert", "whole_transposed", "mxfp4", "side_by_side", "random"])
def test_each_ranks_nf4_experts_are_its_rows_of_one_devices(shards, label):
    """Mutations seen failing: every rank reading (or keeping) the first experts (rank 1 differs, every layout);
    each rank's scales centred on the mean of its own (the scales differ); the shard's own block count; torchao's
    scaler block of 256 instead of the experts' 128 (per_expert on the rows path; random weights on the whole
    path, quantized as its 2-D rows)."""
    checkpoints, ranks, _ = shards
    single = _nf4_experts(_single_device(label, checkpoints.get(label)))
    assert single and all(set(rank[label]) == set(single) for rank in ranks)
    for name, whole in single.items():
        for r, rank in enumerate(ranks):
            got = rank[label][name]
            rows = whole["shape"][0] // 2
            assert got["shape"] == (rows, whole["shape"][1]) and got["stride"] == whole["stride"], name
            # a chunk keeps the whole weight's block count (FSDP2's all-gather passes the shard's on)
            assert (got["scaler_block"], got["n_blocks"]) == (whole["scaler_block"], whole["n_blocks"]), name
            assert torch.equal(got["nf4"], whole["nf4"]), name
            assert label not in ("random", "per_expert") or got["scaler_block"] == 128
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
    checkpoints, ranks, _ = shards
    single = _single_device("side_by_side", checkpoints["side_by_side"])
    gathered = ranks[0]["gathered"]
    experts = {f"{name}.weight": m for name, m in single.named_modules() if isinstance(m, ExpertLinear)}
    assert set(experts) <= set(gathered)
    for name, module in experts.items():
        assert torch.equal(gathered[name], module.plain_weight()), name


@pytest.mark.parametrize("world, n_experts, message", [
    (4, 6, r"^layers\.0\.mlp\.experts\.gate_proj\.weight: its 6 experts do not split evenly over 4 ranks, "),
    (3, 8, r"^layers\.0\.self_attn\.q_proj\.weight: an NF4 weight \[512, 256\]: its 512 rows do not split "
           r"evenly over 3 ranks: "),
], ids=["experts", "dense"])
def test_nf4_weights_the_ranks_cannot_split_are_refused_in_one_line(world, n_experts, message):
    """4 ranks cannot each hold whole experts of 6 (an expert's NF4 scales are a block of their own), nor 3 ranks
    whole rows of a dense weight of 512 (smaller second-level blocks, `test_nf4_dense_sharded`, cannot help there):
    shard_model says so, naming the weight and the key, before anything is read. Mutation seen failing: either
    check skipped."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from mtune.config.errors import ConfigError
    from mtune.training.distributed import shard_model

    source = dataclasses.replace(RANDOM, args=dataclasses.replace(RANDOM.args, n_experts=n_experts))
    model, _ = setup_model(source, device=CPU, dtype=torch.bfloat16, lora=LORA, materialize=False)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with pytest.raises(ConfigError, match=message + r".*lora\.quantize_base=false$"):
            shard_model(model)
    finally:
        dist.destroy_process_group()


def test_a_resumed_run_gets_its_adapters_and_optimizer_back_over_re_read_nf4_experts(shards):
    """After a step, the adapter-only DCP state (no NF4 base in it) loaded into a fresh sharded model: each rank's
    adapters (the experts' too) and AdamW moments equal the saved ones, and its NF4 experts are again its rows of one
    device's. Mutation seen failing: every rank keeping the first experts' NF4 rows."""
    checkpoints, ranks, dcp = shards
    single = _nf4_experts(_single_device("per_expert", checkpoints["per_expert"]))
    for r, rank in enumerate(ranks):
        (saved, saved_moments), (resumed, resumed_moments) = rank["resume"]["saved"], rank["resume"]["resumed"]
        assert saved.keys() == resumed.keys() and any(".experts.gate_proj.lora_a." in n for n in saved)
        assert all(torch.equal(resumed[n], saved[n]) for n in saved)
        assert len(saved_moments) == len(saved) and all(map(torch.equal, resumed_moments, saved_moments))
        for name, whole in single.items():
            for part in PARTS:
                expected = whole[part] if part == "scaler_mean" else whole[part].view(2, -1)[r]
                assert torch.equal(rank["resume"]["nf4"][name][part], expected), (name, r, part)
    saved = FileSystemReader(dcp).read_metadata().state_dict_metadata
    assert not [key for key in saved if key.startswith("model.") and ".lora_" not in key]  # no NF4 base in it
