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
