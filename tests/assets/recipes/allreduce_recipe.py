"""Test recipe for `mtune run --nproc_per_node N`: every rank all-reduces its rank + 1 over gloo and writes a file.
With TEST_KILL_RANK=r in the environment rank r then kills itself (SIGKILL) while the others all-reduce again; with
TEST_TEARDOWN_MARKS=1 each rank marks its atexit callbacks (atexit_<r>) and the interpreter's teardown
(finalized_<r>)."""

import json
import os
from pathlib import Path

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.keys import RUN_KEYS

SUPPORTS_DISTRIBUTED = True
SCHEMA = RecipeSchema([RUN_KEYS])


class _Finalized:
    """Writes ``finalized_<rank>`` when the interpreter's teardown frees it."""

    def __init__(self, path):
        self.path, self.os = str(path), os  # late in the teardown module globals are gone: keep what __del__ needs

    def __del__(self):
        self.os.close(self.os.open(self.path, self.os.O_CREAT | self.os.O_WRONLY))


def main(cfg: DictConfig) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "world_size": world_size, "sum": total.item(), "local_rank": int(os.environ["LOCAL_RANK"])}
    (out / f"rank_{rank}.json").write_text(json.dumps(record))
    if os.environ.get("TEST_TEARDOWN_MARKS"):  # what runs after main: atexit callbacks, the interpreter's teardown
        import atexit
        import sys

        atexit.register(lambda: (out / f"atexit_{rank}").touch())
        sys.modules["__main__"].__dict__["_finalized_sentinel"] = _Finalized(out / f"finalized_{rank}")
    if os.environ.get("TEST_KILL_RANK") is not None:  # a rank dies (kill -9) while the others wait for it
        if rank == int(os.environ["TEST_KILL_RANK"]):
            os.kill(os.getpid(), 9)
        dist.all_reduce(total)
    dist.destroy_process_group()
