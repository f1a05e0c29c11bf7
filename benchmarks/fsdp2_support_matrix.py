"""Which memory techniques and optimizers work with FSDP2 here: run under torchrun with 2 processes, e.g.

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp2_support_matrix.py

Each check builds the tiny model from a Hugging Face directory mtune wrote (random weights), shards it with
`shard_model`, runs one `train_step` on half of a global batch per rank and compares the gathered parameters with a
single-process step on the whole batch (rank 0 computes the reference). Prints one line per combination; the
results are recorded in docs/distributed.md.
"""

import faulthandler
import sys
import tempfile
import traceback
from unittest import mock
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtune.models import build_model  # noqa: E402
from mtune.training.memory.registry import MemoryConfig  # noqa: E402
from mtune.modules.loss import CrossEntropyLoss  # noqa: E402
from mtune.modules.nf4_linear import dequantize  # noqa: E402
from mtune.modules.lora import is_adapter_param  # noqa: E402
from mtune.training.checkpointing.hf import save_hf_checkpoint  # noqa: E402
from mtune.training.checkpointing.sharded import load_hf_checkpoint_sharded  # noqa: E402
from mtune.training.distributed import init_distributed, shard_model  # noqa: E402
from mtune.training.checkpointing.dcp import gathered_state_dict_items  # noqa: E402
from mtune.training.loop import train_step  # noqa: E402
from mtune.training.memory import phases  # noqa: E402
from mtune.training.memory.techniques.lora.adapters import reset_adapters_sharded  # noqa: E402
from mtune.training.model_setup import resolve_model_source, setup_model  # noqa: E402
from mtune.training.placement import Placement  # noqa: E402
from mtune.training.optimizers import build_optimizer  # noqa: E402

LORA = dict(modules=["q_proj", "v_proj", "o_proj"], rank=8, alpha=16)


def _batch(lo, hi):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 512, (4, 24), generator=g)
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[1, 10:] = -100  # unequal token counts across ranks
    return {"tokens": tokens[lo:hi], "labels": labels[lo:hi]}


def _build(ckpt, lora, sharded, ac=False, cpu_offload=False):
    source = resolve_model_source({"checkpoint_dir": ckpt})
    device = torch.device("cpu")
    torch.manual_seed(0)
    if not sharded:
        model, _ = setup_model(source, device=device, dtype=torch.float32, lora=lora,
                               memory=MemoryConfig(enable_activation_checkpointing=ac))
        return model
    model, _ = setup_model(source, device=device, dtype=torch.float32, lora=lora,
                           memory=MemoryConfig(enable_activation_checkpointing=ac), materialize=False)
    memory = MemoryConfig("distributed", lora=lora, fsdp_cpu_offload=cpu_offload)
    shard_model(model, **phases.sharding_options(memory, Placement(device)))
    load_hf_checkpoint_sharded(model, ckpt, dtype=torch.float32, device=device, not_in_checkpoint=is_adapter_param,
                               arrives_whole=phases.arrives_whole(memory))
    if lora is not None:
        reset_adapters_sharded(model)
    return model


def check(name, ckpt, lora=None, optimizer="torch.optim.AdamW", in_bwd=False, ac=False, cpu_offload=False,
          compare=True):
    rank, world = dist.get_rank(), dist.get_world_size()
    opt_cfg = {"_component_": optimizer, "lr": 1e-3}
    try:
        model = _build(ckpt, lora, sharded=True, ac=ac, cpu_offload=cpu_offload)
        opt = build_optimizer(opt_cfg, model, MemoryConfig(optimizer_in_bwd=in_bwd))
        per = 4 // world
        res = train_step(model, [_batch(rank * per, (rank + 1) * per)], CrossEntropyLoss(), opt,
                         device=torch.device("cpu"), world_size=world)
        after = dict(gathered_state_dict_items(
            model, plain=phases.plain_form(MemoryConfig("distributed", lora=lora, fsdp_cpu_offload=cpu_offload))))
        detail = ""
        if rank == 0 and compare:
            ref = _build(ckpt, lora, sharded=False, ac=ac)
            ref_opt = build_optimizer(opt_cfg, ref, MemoryConfig(optimizer_in_bwd=in_bwd))
            with mock.patch("mtune.training.loop.all_reduce", lambda v, op=None: v):  # a single-process step
                ref_res = train_step(ref, [_batch(0, 4)], CrossEntropyLoss(), ref_opt, device=torch.device("cpu"))
            diff = max((after[k] - dequantize(v)).abs().max().item() for k, v in ref.state_dict().items())
            moved = max((after[k] - dequantize(v)).abs().max().item() for k, v in
                        _build(ckpt, lora, sharded=False).state_dict().items())
            detail = (f"loss {res.loss:.6f} vs {ref_res.loss:.6f}, max |param - single-process| {diff:.2e}, "
                      f"max update {moved:.2e}")
        if rank == 0:
            print(f"OK    {name}: {detail}", flush=True)
    except Exception as e:  # report and continue with the next combination
        if rank == 0:
            print(f"FAIL  {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            traceback.print_exc(limit=-3, file=sys.stdout)
    dist.barrier()


def main():
    faulthandler.dump_traceback_later(550, exit=True)  # a rank stuck in a collective prints where, then exits
    init_distributed()
    root = Path(tempfile.mkdtemp()) if dist.get_rank() == 0 else None
    holder = [str(root) if root else None]
    dist.broadcast_object_list(holder)
    ckpt = Path(holder[0]) / "llama3_1"
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        save_hf_checkpoint(build_model("llama3_1", "tiny", device="cpu"), ckpt)
    dist.barrier()
    only = sys.argv[1:]
    checks = {
        "full fine-tune, AdamW": dict(),
        "LoRA, AdamW": dict(lora=LORA),
        "QLoRA (NF4 base), AdamW": dict(lora={**LORA, "quantize_base": True}),
        "DoRA, AdamW": dict(lora={**LORA, "use_dora": True}),
        "QDoRA (NF4 base), AdamW": dict(lora={**LORA, "use_dora": True, "quantize_base": True}),
        "full + activation checkpointing": dict(ac=True),
        "full + optimizer_in_bwd": dict(in_bwd=True),
        "LoRA + optimizer_in_bwd": dict(lora=LORA, in_bwd=True),
        "full + CPU offload (FSDP2 CPUOffloadPolicy)": dict(cpu_offload=True),
        "full + bitsandbytes AdamW8bit": dict(optimizer="bitsandbytes.optim.AdamW8bit", compare=False),
        "full + torchao AdamW8bit": dict(optimizer="torchao.optim.AdamW8bit", compare=False),
        "full + torchao AdamW4bit": dict(optimizer="torchao.optim.AdamW4bit", compare=False),
    }
    for name, kwargs in checks.items():
        if not only or any(o in name for o in only):
            check(name, ckpt, **kwargs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
