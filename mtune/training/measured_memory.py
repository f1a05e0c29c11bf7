"""What a run measures of its own memory: live tensor bytes by category, device and host (``memory_breakdown``:
``peak_tensor_gib``, ``memory_breakdown.json``), and with ``plan_check`` at the end of the run, ``mtune plan``'s
prediction for its config (fake tensors) beside the peak it measured."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from mtune.errors import MtuneError
from mtune.training.context import RunContext
from mtune.training.optimizers import inner_optimizers
from mtune.training.memory.registry import MemoryConfig
from mtune.training.planning.breakdown import MemoryBreakdown
from mtune.training.planning.plan import plan_memory
from mtune.training.planning.tracker import StepMemory
from mtune.units import format_bytes, parse_budget

__all__ = ["memory_breakdown", "plan_check", "plan_check_line", "tracked_device_limit", "tracks_tensor_bytes"]

log = logging.getLogger(__name__)


def tracks_tensor_bytes(cfg: Mapping[str, Any]) -> bool:
    """Whether a run tracks live tensor bytes: with ``memory_breakdown`` or ``plan_check``, and not with
    ``compile`` (a dispatch mode over compiled blocks would run them eagerly, changing what is measured)."""
    return bool(cfg.get("memory_breakdown") or cfg.get("plan_check")) and not MemoryConfig.from_config(cfg).compile


def memory_breakdown(cfg, run: RunContext, model: nn.Module, optimizer: torch.optim.Optimizer,
                     frozen=()) -> MemoryBreakdown:
    """The run's tracker of live tensor bytes. They cost a Python call per op: tracked only when
    ``memory_breakdown`` or ``plan_check`` asks, and for ``plan_check`` alone only over the first steps (see
    docs/plan.md for the measured overhead). ``frozen``: weights outside the model counted as parameters (a
    preference run's reference copy). With ``device_memory_limit`` on a device other than CUDA (whose allocator
    enforces it), every step is tracked and one over the limit raises torch.OutOfMemoryError."""
    limit = tracked_device_limit(cfg, run.device)
    breakdown = MemoryBreakdown(model, inner_optimizers(optimizer), run.output_dir,
                                enabled=tracks_tensor_bytes(cfg) or limit is not None, rank=run.rank,
                                write=bool(cfg.get("memory_breakdown")), placement=run.placement,
                                track_all_steps=bool(cfg.get("memory_breakdown")), device_limit=limit)
    for tensor in frozen if breakdown.tracker is not None else ():
        breakdown.tracker.track(tensor, "parameters")
    return breakdown


def tracked_device_limit(cfg: Mapping[str, Any], device: torch.device) -> int | None:
    """``device_memory_limit`` in bytes where the byte tracker enforces it (not CUDA, whose caching allocator
    does: `mtune.training.context.setup_run`), else None. Not with ``compile``: a dispatch mode over compiled blocks
    would run them eagerly, so the limit is not enforced then (a warning says so)."""
    limit = cfg.get("device_memory_limit")
    if limit is None or device.type == "cuda":
        return None
    if MemoryConfig.from_config(cfg).compile:
        log.warning("device_memory_limit=%s is not enforced on %s with compile (the byte tracker would run the "
                    "compiled blocks eagerly); set compile=false to enforce it", limit, device)
        return None
    log.info("device_memory_limit: the run's live tensor bytes on %s are held to %s", device, limit)
    return parse_budget(limit, "device_memory_limit")


def plan_check_line(planned: int, measured: int, planned_host: int, measured_host: int, plan_tokens: int,
                    longest_tokens: int | None) -> str:
    """The end-of-run line comparing ``mtune plan``'s peak of live tensor bytes with the run's. The plan is for
    batches padded to ``plan_tokens`` (the most the config allows); a run whose batches were all shorter measures
    less, which the line says instead of showing the gap as an error."""
    host = (f"; host planned {format_bytes(planned_host)}, measured {format_bytes(measured_host)}"
            if planned_host or measured_host else "")
    head = f"plan_check: mtune plan predicted {format_bytes(planned)} of device tensors, this run peaked at " \
           f"{format_bytes(measured)}{host}"
    if measured > planned * 1.05:
        return head + f" ({measured / planned - 1:+.0%} above the plan: please report it with the config)"
    if longest_tokens is not None and longest_tokens < plan_tokens and measured < planned * 0.95:
        return head + (f": the plan is for batches of {plan_tokens} tokens (tokenizer.max_seq_len) and this run's "
                       f"longest was {longest_tokens}, so it held less; the plan is the bound for full-length batches")
    return head + f" ({planned / measured - 1:+.0%} planned vs measured)" if measured else head


# What torchrun tells its workers: a helper process must not take itself for one of them.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _plan(cfg, world_size: int):
    """``mtune plan``'s prediction for ``cfg``. In a process with a process group (a distributed run), the planner's
    own fake group of ``world_size`` ranks cannot stand beside the run's: it plans in a helper process (this module
    run as a script), which gets the resolved config on stdin and answers with the plan's peaks as JSON."""
    if not dist.is_initialized():
        return plan_memory(cfg, world_size=world_size)  # quiet: its fake model's setup lines are not this run's
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC")}
    done = subprocess.run([sys.executable, "-m", __spec__.name, str(world_size)], env=env, capture_output=True,
                          text=True, input=json.dumps(OmegaConf.to_container(cfg, resolve=True)), timeout=1800)
    answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else {
        "error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1], "mtune_error": False}
    if "error" in answer:
        raise (MtuneError if answer["mtune_error"] else RuntimeError)(answer["error"])
    return SimpleNamespace(**answer)


def _per_rank_peaks(measured: StepMemory) -> list[dict[str, int]] | None:
    """Every rank's peaks (all ranks call it; None on ranks other than 0), or this process's alone."""
    if not dist.is_initialized():
        return [dict(measured.peak)]
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, dict(measured.peak))
    return peaks if dist.get_rank() == 0 else None


def plan_check(cfg, measured: StepMemory, *, world_size: int, longest_batch_tokens: int | None,
               write: Callable[[str], None]) -> dict[str, Any] | None:
    """Plans ``cfg`` for ``world_size`` ranks and writes the line comparing the plan with the largest of every
    rank's ``measured`` peaks (call it on every rank). Returns, on rank 0, what ``results.json`` keeps under
    ``plan_check``, or None when the planner could not plan (the run itself is complete: a planner failure is a
    warning, never the run's failure)."""
    per_rank = _per_rank_peaks(measured)
    if per_rank is None:
        return None
    rank = max(range(len(per_rank)), key=lambda r: per_rank[r]["device"])
    measured = StepMemory(peak={"device": per_rank[rank]["device"], "host": max(p["host"] for p in per_rank)})
    try:
        plan = _plan(cfg, world_size)
    except MtuneError as err:
        write(f"plan_check: skipped ({err})")
        return None
    except Exception as err:  # a diagnostic after the run is saved: a planner failure must not fail the run
        log.warning("plan_check: the planner failed (%s: %s); the run itself is complete and saved. Please "
                    "report it with the config", type(err).__name__, err)
        return None
    check = {"planned_device_bytes": plan.device_peak_bytes, "measured_device_bytes": measured.peak["device"],
             "planned_host_bytes": plan.host_peak_bytes, "measured_host_bytes": measured.peak["host"],
             "planned_for": plan.batch}
    error = plan.device_peak_bytes / measured.peak["device"] - 1 if measured.peak["device"] else 0.0
    check["device_error"] = error
    check["longest_batch_tokens"] = longest_batch_tokens
    if len(per_rank) > 1:  # the plan is one rank's: compared with the rank that held the most
        check.update(measured_rank=rank, measured_device_bytes_per_rank=[p["device"] for p in per_rank])
    line = plan_check_line(plan.device_peak_bytes, measured.peak["device"], plan.host_peak_bytes,
                           measured.peak["host"], plan.batch["seq_len"], longest_batch_tokens)
    write(line.replace("this run peaked at", f"rank {rank} (the largest of {len(per_rank)}) peaked at", 1)
          if len(per_rank) > 1 else line)
    return check


if __name__ == "__main__":  # the helper process of a distributed run's plan_check (see _plan)
    try:
        _answer = vars(plan_memory(OmegaConf.create(json.load(sys.stdin)), world_size=int(sys.argv[1])))
        _answer = {key: _answer[key] for key in ("device_peak_bytes", "host_peak_bytes", "batch")}
    except Exception as _err:  # the parent says it in its own words
        _answer = {"error": str(_err).splitlines()[0] if str(_err) else type(_err).__name__,
                   "mtune_error": isinstance(_err, MtuneError)}
    print(json.dumps(_answer))
