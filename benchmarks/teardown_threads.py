#!/usr/bin/env python
"""Which threads of a gloo rank outlive ``destroy_process_group()`` (issue 37's teardown aborts). Each rank counts its
threads by name (``/proc/self/task/*/comm``) after the group is destroyed, and again after DTensor's caches are
cleared and everything is collected, for a bare all-reduce and for a fully sharded tiny model after two AdamW steps.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/teardown_threads.py bare
    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/teardown_threads.py fsdp
"""
import collections
import gc
import os
import sys

import torch
import torch.distributed as dist


def threads() -> dict[str, int]:
    return dict(collections.Counter(open(f"/proc/self/task/{t}/comm").read().strip()
                                    for t in os.listdir("/proc/self/task")))


def clear_dtensor_caches() -> int:
    """Every ``cache_clear`` of torch.distributed's modules, their classes and DTensor's sharding propagator."""
    cleared = 0
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            for owner in [value] + (list(vars(value).values()) if isinstance(value, type) else []):
                clear = getattr(owner, "cache_clear", None) or getattr(getattr(owner, "__func__", None), "cache_clear",
                                                                      None)
                if callable(clear):
                    try:
                        clear()
                        cleared += 1
                    except Exception:
                        pass
    return cleared


dist.init_process_group("gloo")
rank, case = dist.get_rank(), sys.argv[1]
if case == "bare":
    dist.all_reduce(torch.ones(4))
else:
    from mtune.models import build_model_from_args, model_args
    from mtune.training.distributed import shard_model

    model = build_model_from_args(model_args("llama3_1", "tiny"), device="cpu")
    shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randint(3, 200, (2, 16))).float().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer
gc.collect()
dist.barrier()
dist.destroy_process_group()
gc.collect()
after_destroy = threads()
cleared = clear_dtensor_caches()
gc.collect()
print(f"rank {rank} {case}: after destroy_process_group {after_destroy}; after clearing {cleared} caches and "
      f"collecting {threads()}", file=sys.stderr)
