"""FSDP2 machinery on 2 CPU processes (gloo) against single-process oracles.

One spawned group runs every distributed check (`_worker`) and saves what it saw; the tests compare that with the
same operations done in this process without any process group: loading, QLoRA/DoRA adapter init, one training step,
DCP resume (2 ranks -> 2 ranks and 2 ranks -> 1 process), gathered export and the writing rank's memory.
"""

import dataclasses
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from mtune.models import build_model_from_args, model_args
from mtune.modules.loss import CrossEntropyLoss
from mtune.modules.lora import is_adapter_param
from mtune.modules.lora_state import peft_adapter_state_dict
from mtune.modules.nf4_linear import dequantize, is_nf4
from mtune.training.checkpointing.hf import hf_key
from mtune.training.checkpointing.sharded import load_hf_checkpoint_sharded
from mtune.training.checkpointing.dcp import (
    gathered_peft_adapter_items, gathered_state_dict_items, load_distributed_state, save_distributed_state,
    save_gathered_hf_checkpoint,
)
from mtune.training.distributed import shard_model
from mtune.training.loop import train_step
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.tensor_bytes import tensor_bytes
from mtune.training.model_setup import (
    ModelSource, init_weights_sharded, resolve_model_source, setup_model, setup_sharded_model,
)
from mtune.training.memory.techniques.lora.adapters import reset_adapters_sharded
from tests._helpers.distributed import run_on_ranks
from tests._helpers.models import write_tiny_hf_model

CPU = torch.device("cpu")
QDORA = dict(modules=["q_proj", "v_proj"], rank=8, alpha=16, use_dora=True, quantize_base=True)
# ~250 MB in fp32, no tensor over 8 MB: big enough to tell "one tensor at a time" from "the whole model".
BIG = dataclasses.replace(model_args("llama3_1", "tiny"), vocab_size=1024, dim=1024, n_layers=6, n_heads=8,
                          n_kv_heads=8, head_dim=128, intermediate_dim=2048)


def _batch(lo: int, hi: int) -> dict:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 512, (4, 24), generator=g)
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[1, 10:] = -100  # the ranks see different numbers of trained tokens
    return {"tokens": tokens[lo:hi], "labels": labels[lo:hi]}


def _sharded(ckpt, dtype, lora=None, seed=0):
    model, _ = setup_model(resolve_model_source({"checkpoint_dir": ckpt}), device=CPU, dtype=dtype, lora=lora,
                           materialize=False)
    shard_model(model)
    load_hf_checkpoint_sharded(model, ckpt, dtype=dtype, device=CPU, not_in_checkpoint=is_adapter_param,
                               arrives_whole=phases.arrives_whole(MemoryConfig(lora=lora)))
    if lora is not None:
        torch.manual_seed(seed)
        reset_adapters_sharded(model)
    return model


def _full_optim_state(model, optimizer):
    # The optimizer's state only: get_state_dict would also gather the whole model, NF4 bases included, through
    # torchao's NF4 all-gather, which now and then corrupts the heap on gloo (malloc(): unaligned tcache chunk,
    # SIGABRT in wait_tensor; 3 runs of 40 here). mtune's own gathers dequantize an NF4 shard first (dcp._gather).
    optim = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optim.get("state", {})  # full_state_dict + cpu_offload: only rank 0 gets the state


class _PeakRSS:
    """Samples this process's resident set size every millisecond."""

    def __enter__(self):
        self.page, self.peak, self.stop = os.sysconf("SC_PAGE_SIZE"), 0, False
        self.start = self._rss()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _rss(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self):
        while not self.stop:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join()


def _storage_bytes(nf4) -> int:
    """The memory an NF4 tensor keeps alive: its parts' whole storages (a view keeps the tensor it views)."""
    return sum(getattr(nf4, name).untyped_storage().nbytes()
               for name in ("quantized_scalers", "quantization_factor", "quantized_data"))


def _worker(rank: int, tmp: str, full_ckpt: str, lora_ckpt: str) -> None:
    tmp, out = Path(tmp), {}
    # 1. full fine-tune (tied embeddings): load, one SGD step on half of the batch, export
    model = _sharded(full_ckpt, torch.float32)
    out["full_loaded"] = dict(gathered_state_dict_items(model))
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    result = train_step(model, [_batch(2 * rank, 2 * rank + 2)], CrossEntropyLoss(), sgd, device=CPU, world_size=2)
    out["full_step_loss"] = result.loss
    save_gathered_hf_checkpoint(model, tmp / "export", source_dir=full_ckpt)

    # 2. QLoRA + DoRA (bf16): NF4 shards, adapter init, a step, DCP save, reload on 2 ranks
    model = _sharded(lora_ckpt, torch.bfloat16, QDORA)
    out["nf4_local"] = {n: (is_nf4(p.to_local()), tensor_bytes(p.to_local()), _storage_bytes(p.to_local()))
                        for n, p in model.named_parameters() if n.endswith("proj.weight")}
    out["qdora_loaded"] = dict(gathered_state_dict_items(model, plain=phases.plain_form(MemoryConfig(lora=QDORA))))
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    train_step(model, [_batch(2 * rank, 2 * rank + 2)], CrossEntropyLoss(), adamw, device=CPU, world_size=2)
    out["adapter"] = dict(gathered_state_dict_items(model, adapter_only=True))
    out["optim"] = _full_optim_state(model, adamw)
    out["peft"] = dict(gathered_peft_adapter_items(model))
    save_distributed_state(tmp / "dcp", model, adamw, adapter_only=True)
    fresh = _sharded(lora_ckpt, torch.bfloat16, QDORA, seed=1)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_distributed_state(tmp / "dcp", fresh, fresh_opt, adapter_only=True)
    out["reloaded_adapter"] = dict(gathered_state_dict_items(fresh, adapter_only=True))
    out["reloaded_optim"] = _full_optim_state(fresh, fresh_opt)

    # 3. export of a ~250 MB model: the writing rank's resident memory while gathering and writing
    source = ModelSource("llama3_1", BIG, None)
    big, _ = setup_model(source, device=CPU, dtype=torch.float32, materialize=False)
    shard_model(big)
    torch.manual_seed(0)
    init_weights_sharded(big, CPU)
    with _PeakRSS() as rss:
        save_gathered_hf_checkpoint(big, tmp / "big", max_shard_size="16MB")
    out["big_rss"] = (rss.start, rss.peak)

    # 4. random weights (tied embeddings) with QDoRA adapters, set up sharded: the values of one device
    model, _ = setup_sharded_model(ModelSource("llama3_2", model_args("llama3_2", "tiny"), None), device=CPU,
                                   dtype=torch.float32, seed=5, lora=QDORA, fsdp_reshard_after_forward=True)
    out["random_qdora"] = dict(gathered_state_dict_items(model, plain=phases.plain_form(MemoryConfig(lora=QDORA))))
    if rank == 0:
        torch.save(out, tmp / "rank0.pt")
    torch.save({"nf4_local": out["nf4_local"]}, tmp / f"nf4_rank{rank}.pt")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    full_ckpt = write_tiny_hf_model(tmp / "full", "llama3_2")  # tied embeddings
    lora_ckpt = write_tiny_hf_model(tmp / "lora", "llama3_1")
    run_on_ranks(_worker, tmp, str(tmp), str(full_ckpt), str(lora_ckpt))
    return tmp, full_ckpt, lora_ckpt, torch.load(tmp / "rank0.pt", weights_only=False)


def _single(ckpt, dtype, lora=None, seed=0):
    torch.manual_seed(seed)
    model, _ = setup_model(resolve_model_source({"checkpoint_dir": ckpt}), device=CPU, dtype=dtype, lora=lora)
    return model


def test_sharded_load_equals_single_process_load(run):
    _, full_ckpt, lora_ckpt, out = run
    reference = _single(full_ckpt, torch.float32).state_dict()
    assert out["full_loaded"].keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(out["full_loaded"][name], tensor), name
    # QLoRA + DoRA: NF4 bases dequantize to the same values, A/B/magnitudes equal single-device init
    reference = _single(lora_ckpt, torch.bfloat16, QDORA).state_dict()
    assert out["qdora_loaded"].keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(out["qdora_loaded"][name], dequantize(tensor)), name


def test_nf4_weights_stay_nf4_shards_of_half_the_bytes(run):
    tmp, _, lora_ckpt, _ = run
    reference = dict(_single(lora_ckpt, torch.bfloat16, QDORA).named_parameters())
    ranks = [torch.load(tmp / f"nf4_rank{r}.pt", weights_only=False)["nf4_local"] for r in range(2)]
    assert len(ranks[0]) == 14  # 7 projections x 2 blocks
    for name, full in reference.items():
        if not name.endswith("proj.weight"):
            continue
        assert is_nf4(full)
        full_bytes = tensor_bytes(full)
        for local in ranks:
            is_nf4_shard, local_bytes, kept_alive = local[name]
            assert is_nf4_shard, name
            # codes and scales split in half; the 16-entry NF4 table and scalar mean are on both ranks
            assert abs(local_bytes - full_bytes / 2) <= 0.01 * full_bytes, (name, local_bytes, full_bytes)
            # and the shard owns its memory: no view keeps the whole weight's codes alive on every rank
            assert kept_alive <= 0.51 * full_bytes, (name, kept_alive, full_bytes)


def test_two_rank_step_equals_single_process_step(run):
    tmp, full_ckpt, _, out = run
    initial = _single(full_ckpt, torch.float32).state_dict()
    model = _single(full_ckpt, torch.float32)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # lr 1: the update is the gradient itself
    result = train_step(model, [_batch(0, 4)], CrossEntropyLoss(), sgd, device=CPU)
    assert abs(out["full_step_loss"] - result.loss) < 1e-6
    exported = load_file(tmp / "export" / "model.safetensors")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: written once, as embed_tokens
            continue
        torch.testing.assert_close(exported[hf_key(name)], tensor, rtol=0, atol=1e-6)
    assert (model.embed_tokens.weight - initial["embed_tokens.weight"]).abs().max() > 1e-3  # the step moved it


def test_dcp_resume_on_two_ranks_restores_adapter_and_optimizer(run):
    *_, out = run
    assert out["reloaded_adapter"].keys() == out["adapter"].keys() and len(out["adapter"]) == 12
    for name, tensor in out["adapter"].items():
        assert torch.equal(out["reloaded_adapter"][name], tensor), name
    assert out["reloaded_optim"].keys() == out["optim"].keys()
    for name, state in out["optim"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(out["reloaded_optim"][name][key], state[key]), (name, key)


def test_dcp_resume_on_one_process_restores_adapter_and_optimizer(run):
    tmp, _, lora_ckpt, out = run
    model = _single(lora_ckpt, torch.bfloat16, QDORA, seed=1)
    adamw = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    load_distributed_state(tmp / "dcp", model, adamw, adapter_only=True)
    state = model.state_dict()
    for name, tensor in out["adapter"].items():
        assert torch.equal(state[name], tensor), name
    optim = _full_optim_state(model, adamw)
    for name, saved in out["optim"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optim[name][key], saved[key]), (name, key)
    # the gathered PEFT adapter equals the single-process PEFT export of the restored model
    peft = peft_adapter_state_dict(model)
    assert peft.keys() == out["peft"].keys()
    assert all(torch.equal(peft[k], out["peft"][k]) for k in peft)


def test_gathered_export_holds_one_tensor_at_a_time(run):
    tmp, *_, out = run
    model_bytes = sum(f.stat().st_size for f in (tmp / "big").glob("*.safetensors"))
    assert model_bytes > 200e6
    start, peak = out["big_rss"]
    # rank 0 gathers 8 MB tensors and writes 16 MB shards: measured +77 MB (safetensors serialises a shard in
    # memory; freed blocks stay resident); holding the whole model would add ~260 MB
    assert peak - start < 0.5 * model_bytes, (peak - start, model_bytes)
    # the export equals the model's own random init drawn in one process (TransformerDecoder.init_weights)
    torch.manual_seed(0)
    single = build_model_from_args(BIG, device=CPU, dtype=torch.float32)
    index_files = sorted((tmp / "big").glob("*.safetensors"))
    written = {}
    for path in index_files:
        written.update(load_file(path))
    for name, tensor in single.state_dict().items():
        assert torch.equal(written[hf_key(name)], tensor), name


def test_sharded_random_init_with_adapters_equals_one_device(run):
    # Base weights from TransformerDecoder.initializers and adapters from LoRALinear.adapter_initializers, drawn in
    # one device's order: a tied lm_head, adapter draws and NF4 quantization included.
    *_, out = run
    torch.manual_seed(5)
    single, _ = setup_model(ModelSource("llama3_2", model_args("llama3_2", "tiny"), None), device=CPU,
                            dtype=torch.float32, lora=QDORA)
    expected = {n: dequantize(t) for n, t in single.state_dict().items()}
    assert out["random_qdora"].keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(out["random_qdora"][name], tensor), name
