#!/usr/bin/env python
"""How often gathering NF4 shards aborts a 2-rank gloo group, by the route the gather takes.

A tiny Llama with QLoRA (NF4 base weights) is set up sharded (FSDP2) on two CPU processes; each rank then gathers
every NF4 base weight ``--gathers`` times, by one of two routes:

- ``torchao``: ``DTensor.full_tensor()`` on the NF4 shard itself, which goes through torchao's NF4 all-gather
  (the route of ``get_state_dict(..., full_state_dict=True)``);
- ``mtune``: each shard dequantized first, then the plain shard gathered (``mtune.training.checkpointing.dcp._gather``,
  the route of every gathered export).

Each group is one trial; a trial fails when a rank dies (by signal: heap corruption ends in SIGABRT). Prints a table
and writes JSON (``--out``)::

    OMP_NUM_THREADS=1 python benchmarks/nf4_gather_gloo.py --trials 20 --out benchmarks/results/nf4_gather_gloo.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
QLORA = dict(modules=["q_proj", "v_proj"], rank=8, alpha=16, quantize_base=True)


def _trial(rank: int, route: str, gathers: int, store: str) -> None:
    from mtune.models import model_args
    from mtune.modules.nf4_linear import is_nf4
    from mtune.training.checkpointing.dcp import _gather
    from mtune.training.memory import phases
    from mtune.training.memory.registry import MemoryConfig
    from mtune.training.model_setup import ModelSource, setup_sharded_model

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model, _ = setup_sharded_model(ModelSource("llama3_1", model_args("llama3_1", "tiny"), None),
                                   device=torch.device("cpu"), dtype=torch.bfloat16, seed=0, lora=QLORA,
                                   fsdp_reshard_after_forward=True)
    nf4 = [p for p in model.parameters() if is_nf4(p.to_local())]
    plain = phases.plain_form(MemoryConfig(lora=QLORA))
    for _ in range(gathers):
        for p in nf4:
            if route == "torchao":
                p.full_tensor()
            else:
                _gather(p, plain)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: see docs/distributed.md, "Teardown"


def run(route: str, trials: int, gathers: int) -> dict:
    failures, signals = 0, []
    start = time.perf_counter()
    for i in range(trials):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.spawn(_trial, args=(route, gathers, str(Path(tmp) / "store")), nprocs=2)
            except mp.ProcessExitedException as e:
                failures += 1
                signals.append(e.signal_name)
        print(f"  {route} trial {i + 1}/{trials}: {failures} failed so far", file=sys.stderr, flush=True)
    return {"route": route, "trials": trials, "gathers_per_weight": gathers, "failed_trials": failures,
            "signals": sorted(set(signals)), "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--gathers", type=int, default=200, help="gathers of each NF4 weight per trial")
    parser.add_argument("--routes", nargs="+", default=["torchao", "mtune"], choices=["torchao", "mtune"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torchao

    rows = [run(route, args.trials, args.gathers) for route in args.routes]
    print(f"{'route':<8} {'trials':>6} {'gathers':>8} {'failed':>6}  signals")
    for r in rows:
        print(f"{r['route']:<8} {r['trials']:>6} {r['gathers_per_weight']:>8} {r['failed_trials']:>6}  "
              f"{','.join(r['signals']) or '-'}")
    if args.out:
        meta = {"torch": torch.__version__, "torchao": torchao.__version__, "python": platform.python_version(),
                "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "date": time.strftime("%Y-%m-%d")}
        args.out.write_text(json.dumps({"machine": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
