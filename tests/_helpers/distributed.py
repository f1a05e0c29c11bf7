"""Run a function on N CPU processes joined by a gloo process group (``torch.multiprocessing.spawn``).

The function must be importable at module level (spawned processes import it by name). Each test file should
launch few groups: starting Python + torch + torchao in two processes costs a few seconds each time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world_size: int, store: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
        dist.barrier()  # no rank closes its connections while a peer may still be using them
    finally:
        dist.destroy_process_group()
    # Leave without tearing the interpreter down: objects still holding the process group (device meshes,
    # DTensors) would otherwise free gloo's worker threads during finalization, which now and then aborts the
    # process (`terminate called without an active exception`, heap corruption) after the work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn, tmp_dir: str | os.PathLike, *args, world_size: int = 2) -> None:
    """Call ``fn(rank, *args)`` on ``world_size`` spawned processes in one gloo group; re-raises a rank's error."""
    store = Path(tmp_dir) / "gloo_store"
    store.unlink(missing_ok=True)
    mp.spawn(_entry, args=(fn, world_size, str(store), args), nprocs=world_size)
