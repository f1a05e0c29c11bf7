"""The ``profiler`` config node: ``torch.profiler`` traces of chosen steps, off by default.

::

    profiler:
      enabled: true
      wait_steps: 5       # steps skipped first
      warmup_steps: 2     # steps profiled but discarded (profiler start-up cost)
      active_steps: 3     # steps recorded
      num_cycles: 1       # repetitions of wait/warmup/active
      cpu: true
      cuda: true          # used only when CUDA is available
      profile_memory: false
      with_stack: false
      record_shapes: true
      output_dir: null    # default ${output_dir}/profiler

Each recorded cycle writes ``<dir>/rank<r>_step<N>.pt.trace.json`` (open it in https://ui.perfetto.dev or
``chrome://tracing``) and ``<dir>/rank<r>_step<N>.txt`` (the top operators by time). The recipe enters the
profiler around its training loop and calls ``profiler.step()`` after every optimizer step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["setup_torch_profiler", "build_profiler", "NullProfiler"]

log = logging.getLogger(__name__)


class NullProfiler:
    """What a disabled profiler is: a context manager whose ``step()`` does nothing."""

    enabled = False

    def __enter__(self) -> "NullProfiler":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def step(self) -> None:
        pass


def setup_torch_profiler(enabled: bool = False, *, output_dir: str | os.PathLike, rank: int = 0,
                         wait_steps: int = 5, warmup_steps: int = 2, active_steps: int = 3, num_cycles: int = 1,
                         cpu: bool = True, cuda: bool = True, profile_memory: bool = False,
                         with_stack: bool = False, record_shapes: bool = True,
                         with_flops: bool = False) -> torch.profiler.profile | NullProfiler:
    """A ``torch.profiler.profile`` following the schedule above, or a :class:`NullProfiler` when not enabled.

    ``output_dir`` is where traces go (the recipe passes ``${output_dir}/profiler`` unless the node sets one).
    """
    if not enabled:
        return NullProfiler()
    for name, value in (("wait_steps", wait_steps), ("warmup_steps", warmup_steps), ("num_cycles", num_cycles)):
        if value < 0:
            raise ValueError(f"profiler.{name} must be >= 0, got {value}")
    if active_steps < 1:
        raise ValueError(f"profiler.active_steps must be >= 1, got {active_steps}")
    activities = []
    if cpu:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    if cuda and torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if not activities:
        raise ValueError("profiler: no activity to record; set profiler.cpu=true (or cuda=true on a GPU machine)")
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sort_key = "self_cuda_time_total" if torch.profiler.ProfilerActivity.CUDA in activities else "self_cpu_time_total"

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        stem = out / f"rank{rank}_step{prof.step_num}"
        prof.export_chrome_trace(f"{stem}.pt.trace.json")
        (Path(f"{stem}.txt")).write_text(prof.key_averages().table(sort_by=sort_key, row_limit=30))
        if rank == 0:
            log.info("Profiler trace written to %s.pt.trace.json", stem)

    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait_steps, warmup=warmup_steps, active=active_steps,
                                         repeat=num_cycles),
        on_trace_ready=on_trace_ready,
        profile_memory=profile_memory,
        with_stack=with_stack,
        record_shapes=record_shapes,
        with_flops=with_flops,
    )


def build_profiler(node: Mapping[str, Any] | None, *, output_dir: str | os.PathLike,
                   rank: int = 0) -> torch.profiler.profile | NullProfiler:
    """The profiler for the ``profiler`` config node (a dict or DictConfig; None or ``enabled: false`` -> off).

    A ``_component_`` key is accepted and must be this module's :func:`setup_torch_profiler`. The node's
    ``output_dir`` (if set) overrides ``${output_dir}/profiler``.
    """
    if node is None:
        return NullProfiler()
    kwargs = {str(k): v for k, v in dict(node).items()}
    component = kwargs.pop("_component_", None)
    if component not in (None, "mtune.training.observe.profiler.setup_torch_profiler", setup_torch_profiler):
        raise ValueError(f"profiler._component_ must be mtune.training.observe.profiler.setup_torch_profiler, got {component}")
    trace_dir = kwargs.pop("output_dir", None) or Path(output_dir) / "profiler"
    return setup_torch_profiler(output_dir=trace_dir, rank=rank, **kwargs)
