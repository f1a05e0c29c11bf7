"""The host budget of ``--fit``: the default is this machine's total memory less max(4 GiB, 10%), read again the same;
the answer's host figure is the share held within the budget (paged states resident on the device are not host
memory: the Llama 3.2 3B full fine-tune at 24 GiB's figures); a CUDA target without a GPU here asks for
``--host-memory``."""

import pytest
import torch
from omegaconf import OmegaConf

from mtune._cli.errors import UsageError
from mtune._cli.plan import refuse_a_host_not_here
from mtune.training.planning import fit
from mtune.training.planning.host import default_host_memory, host_figures
from mtune.training.planning.memory_plan import MemoryPlan
from mtune.units import GIB


def test_the_default_host_is_the_total_less_the_reserve_every_time():
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    budget, words = default_host_memory()
    assert budget == total - max(4 * GIB, int(0.1 * total)) and default_host_memory()[0] == budget
    assert "less a reserve of" in words and "--host-memory" in words


def test_the_answer_prints_the_host_share_held_within_the_budget():
    """Mutation checked: `host_figures` printing ``host_peak_bytes`` gives 'host 23.94 GiB of 22.92 GiB'."""
    managed = int(23.94 * GIB)
    plan = MemoryPlan(target="cuda", world_size=1, device_peak_bytes=int(14.17 * GIB), host_peak_bytes=managed,
                      device={}, host={}, at_peak={}, batch={}, parameters={}, predicts="",
                      cuda_context_bytes=512 << 20, managed_bytes=managed)
    budget = int(22.92 * GIB)
    assert fit.fits_budgets(plan, 24 * GIB, budget, int(1.2 * GIB))
    resident = 24 * GIB - plan.device_total_bytes  # what fits beside the allocator's peak: 9.33 GiB
    assert plan.host_need_bytes == managed - resident
    assert host_figures(plan, budget).startswith("host 14.61 GiB of 22.92 GiB, managed 23.94 GiB (14.61 GiB paged")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here: the default host is this machine's")
def test_a_gpu_not_here_asks_for_the_host():
    with pytest.raises(UsageError, match="give --host-memory SIZE, the memory of the machine that holds the GPU"):
        refuse_a_host_not_here(OmegaConf.create({"device": "cuda"}))
    refuse_a_host_not_here(OmegaConf.create({"device": "cpu"}))  # the CPU is here: its host is this machine's


def test_the_reserve_is_4_gib_or_10_percent_of_the_machine():
    """Mutation checked: the 10% taken as 1% (this machine's total is under 40 GiB, so the default test above only
    sees the 4 GiB floor)."""
    from mtune.training.planning.host import host_reserve

    assert host_reserve(16 * GIB) == 4 * GIB  # 10% = 1.6 GiB < 4 GiB
    assert host_reserve(40 * GIB) == 4 * GIB  # 10% = exactly 4 GiB
    assert host_reserve(256 * GIB) == int(25.6 * GIB)


def test_the_host_line_asks_for_every_ranks_share_rounded_up_to_a_gib():
    """Four ranks on one machine each needing 3.5 GiB ask for 14 GiB; 2.2 GiB alone asks for 3 GiB.
    Mutation checked: the plan's host share not multiplied by the ranks."""
    from types import SimpleNamespace

    from mtune.training.planning.host import host_line

    answer = SimpleNamespace(plan=SimpleNamespace(host_need_bytes=int(3.5 * GIB)), changes={"batch_size": 1})
    assert host_line(answer, 4, "the answer") == ("the answer fits with --host-memory 14GiB or more (its plan's host "
                                                  "share 14.00 GiB, 4 ranks): batch_size=1")
    answer.plan.host_need_bytes = int(2.2 * GIB)
    assert host_line(answer, 1, "x").startswith("x fits with --host-memory 3GiB or more (its plan's host share 2.20")


def test_fewer_offloaded_blocks_reads_the_count_off_the_line_rounded_down(monkeypatch):
    """8 blocks; the host has 500 bytes spare with none offloaded and -400 with all: the line crosses zero at
    8 * 500 / 900 = 4.44 blocks, so 4 offload (5 would be over the host). Mutation checked: the count rounded up."""
    from types import SimpleNamespace

    from mtune.training.planning import host
    from mtune.training.memory.footprint import BlockOffload

    monkeypatch.setattr(host, "block_offload", lambda cfg: BlockOffload(blocks=8, n_layers=8, key="offloaded"))
    spare = {None: -400, 0: 500}  # bytes spare on the host, by the count offloaded (None: every block)

    class Estimator:
        def estimate(self, cfg):
            return SimpleNamespace(count=cfg.offloaded, lower_bound=False)

    every = SimpleNamespace(count=None, lower_bound=False)
    changes, plan = host.fewer_offloaded_blocks(OmegaConf.create({"offloaded": None}), every, Estimator(),
                                                lambda p: spare.get(p.count, 0))
    assert changes == {"offloaded": 4} and plan.count == 4
    # a lower-bound plan (spare -100 here) has no slope to read: the line is read off a whole plan of every block
    # (-400) instead, still 4 (reading it off the bound would give 8 * 500 / 600 = 6.67, so 6)
    spare["bound"] = -100
    bound = SimpleNamespace(count="bound", lower_bound=True)
    changes, _ = host.fewer_offloaded_blocks(OmegaConf.create({"offloaded": None}), bound, Estimator(),
                                             lambda p: spare.get(p.count, 0))
    assert changes == {"offloaded": 4}
