"""The host's side of ``--fit``: the default host budget (stable, stated), the host's share of a plan as an answer
prints it, how many blocks' saved inputs a host holds (`fewer_offloaded_blocks`), and the line that names the host
memory a larger answer needs."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from mtune.training.memory import phases
from mtune.training.memory.footprint import BlockOffload
from mtune.training.memory.registry import MemoryConfig
from mtune.training.planning.candidates import Candidate, describe, with_overrides
from mtune.training.planning.cost import model_facts
from mtune.training.planning.memory_plan import MemoryPlan
from mtune.units import GIB, format_bytes

__all__ = ["available_host_memory", "host_reserve", "default_host_memory", "host_figures", "host_line",
           "block_offload", "offload_ends", "fewer_offloaded_blocks"]


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_host_memory() -> int:
    """This machine's memory available this second (``MemAvailable``): what a run may take now, not a budget to
    plan with (it moves with whatever else runs; `default_host_memory` is the stable one)."""
    found = _meminfo("MemAvailable")
    return found if found is not None else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_reserve(total: int) -> int:
    """What the default host budget leaves to everything but the run's offloaded tensors: max(4 GiB, 10% of the
    machine's memory), for the operating system, the run's own process (torch's and CUDA's libraries, the data
    loader's rows) and whatever else the machine runs. Stated, not measured: a run's resident set beside its
    offloaded tensors is ``peak_memory_gib`` less ``peak_host_tensor_gib`` in its metrics.jsonl."""
    return int(max(4 * GIB, 0.10 * total))


def default_host_memory() -> tuple[int, str]:
    """The host budget when none is given, and the words that say where it came from: this machine's total memory
    (``MemTotal``) less `host_reserve`, the same figure every time (the memory available this second moved one
    question's answer from 28K to 131K tokens on one day)."""
    total = _meminfo("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    reserve = host_reserve(total)
    return total - reserve, (f"this machine's {format_bytes(total)} less a reserve of {format_bytes(reserve)}, "
                             "max(4 GiB, 10%); --host-memory to change")


def host_figures(plan: MemoryPlan, host_memory: int | None) -> str:
    """``host X of Y``: the host's share of ``plan`` (`MemoryPlan.host_need_bytes`, the figure held within the
    budget) and the budget, with the managed (paged) states' split where there are some."""
    budget = f" of {format_bytes(host_memory)}" if host_memory is not None else ""
    managed = (f", managed {format_bytes(plan.managed_bytes)} ({format_bytes(plan.paged_bytes())} paged to the "
               f"host, {format_bytes(plan.managed_resident_bytes())} resident on the device)"
               if plan.managed_bytes else "")
    return f"host {format_bytes(plan.host_need_bytes)}{budget}{managed}"


def host_line(answer: Candidate, world_size: int, what: str) -> str:
    """One line: the host memory at which ``answer`` (``what`` it is) fits, from its own plan (every rank's share
    where ``world_size`` ranks share the machine), rounded up to a GiB for the option."""
    need = answer.plan.host_need_bytes * world_size
    ranks = f", {world_size} ranks" if world_size > 1 else ""
    return (f"{what} fits with --host-memory {math.ceil(need / GIB)}GiB or more (its plan's host share "
            f"{format_bytes(need)}{ranks}): {describe(answer.changes)}")


def block_offload(cfg) -> BlockOffload | None:
    """Which of ``cfg``'s blocks save to the host (`phases.block_offload`), or None."""
    return phases.block_offload(MemoryConfig.from_config(cfg), model_facts(cfg))


def offload_ends(cfg) -> tuple[float, Any, Any] | None:
    """For a config that offloads the first N of its L blocks' saved inputs (0 < N < L): ``(N / L, cfg with 0
    blocks offloaded, cfg with all)``; None otherwise. Such a plan lies on the line between the two: each offloaded
    block moves its input (the same bytes) from the device to the host (what is saved outside the blocks, the
    loss's tensors, is offloaded in both), and the device peak at the start of backward holds the inputs not
    offloaded; where a peak lies elsewhere (the device's, in a step's temporaries) it is the larger of a line and a
    constant, and the line between the ends lies above it: the estimate is conservative."""
    offload = block_offload(cfg)
    if offload is None or not 0 < offload.blocks < offload.n_layers:
        return None
    return (offload.blocks / offload.n_layers, with_overrides(cfg, {offload.key: 0}),
            with_overrides(cfg, {offload.key: None}))


def fewer_offloaded_blocks(cfg, plan: MemoryPlan, estimator: Any,
                           host_spare: Callable[[MemoryPlan], int | None]) -> tuple[dict, MemoryPlan] | None:
    """For ``cfg`` offloading every block's saved input (its ``plan``) where the host cannot hold them all
    (``host_spare(plan)`` < 0): the most blocks whose inputs it holds, as ``({key: N}, the plan with N)``, the
    rest kept on the device. The host's share is a line in N (`offload_ends`), so N is read off the line between
    0 blocks and all, rounded down. None where that does not apply (not every block offloaded, the host holds
    them, or even 0 blocks is over it). ``estimator``: the search's `Estimator`."""
    offload = block_offload(cfg)
    spare = host_spare(plan)
    if offload is None or offload.blocks < offload.n_layers or spare is None or spare >= 0:
        return None
    every = estimator.estimate(cfg) if plan.lower_bound else plan  # a lower bound has no slope to read
    zero = estimator.estimate(with_overrides(cfg, {offload.key: 0}))
    spare_every, spare_zero = host_spare(every), host_spare(zero)
    if spare_every >= 0:
        return {}, every
    if spare_zero < 0:
        return None
    blocks = min(offload.n_layers - 1, int(offload.n_layers * spare_zero / (spare_zero - spare_every)))
    return {offload.key: blocks}, estimator.estimate(with_overrides(cfg, {offload.key: blocks}))
