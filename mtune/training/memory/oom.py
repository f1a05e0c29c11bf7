"""Turn an out-of-memory error into advice (``oom_recovery``, which re-plans a step that ran out, is
`mtune.training.oom_recovery`): which phase ran out, which flags of this config would lower the peak
(only those not already set), and the exact ``mtune plan --fit`` command that finds the fastest config that fits
this device."""

from __future__ import annotations

import contextlib
import logging
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mtune.errors import MtuneError
from mtune.training.memory import registry
from mtune.training.memory.technique import advice as tier_advice
from mtune.units import GIB, MIB, parse_budget

log = logging.getLogger(__name__)

__all__ = ["OutOfMemory", "oom_guard", "memory_advice", "set_invocation", "fit_command_line", "device_memory_budget"]

# How this process was started (`mtune run`'s recipe, config and overrides), for the fit command in the message.
_invocation: dict = {}


def set_invocation(recipe: str, config: str, overrides: Sequence[str]) -> None:
    """Remember ``mtune run RECIPE --config CONFIG overrides`` (``mtune run`` calls this before the recipe)."""
    _invocation.update(recipe=recipe, config=str(config), overrides=list(overrides))


def fit_command_line(cfg: Mapping[str, Any], device_memory: int | None = None) -> str:
    """``mtune plan --fit --device-memory SIZE RECIPE --config CONFIG overrides`` for this run and device."""
    recipe = _invocation.get("recipe") or str(cfg.get("recipe") or "RECIPE")
    config = _invocation.get("config") or "CONFIG"
    size = ("SIZE" if not device_memory else f"{device_memory / GIB:.0f}GiB" if device_memory >= 8 * GIB
            else f"{device_memory // MIB}MiB")
    words = ["mtune", "plan", "--fit", "--device-memory", size, recipe, "--config", config,
             *_invocation.get("overrides", [])]
    return " ".join(shlex.quote(w) for w in words)


class OutOfMemory(MtuneError, RuntimeError):
    """Raised instead of torch's OutOfMemoryError, with the phase and what to change."""


def memory_advice(cfg: Mapping[str, Any]) -> list[str]:
    """Settings that would lower peak memory and are not set in ``cfg`` yet, most effective first: every
    technique's own advice (`MemoryTechnique.oom_advice`) and the run's (batch, dtype, sequence length), in the
    order of `ADVICE_TIERS`."""
    memory = registry.MemoryConfig.from_config(cfg)
    advice = [item for t in registry.TECHNIQUES for item in t.oom_advice(memory[t], memory)]
    if memory.run.batch_size > 1:
        refused = _accumulation_refused(cfg, memory.kind)
        advice.append(tier_advice("micro_batch", "a smaller batch_size" + (
            f" (not a larger gradient_accumulation_steps: {refused.split(': ')[0]})" if refused
            else " with a larger gradient_accumulation_steps")))
    if memory.run.dtype in ("fp32", "fp16"):
        advice.append(tier_advice("dtype", "dtype=bf16 (on GPUs that have it)"))
    if memory.run.max_seq_len:
        advice.append(tier_advice("seq_len", "a smaller tokenizer.max_seq_len"))
    return [text for _, text in sorted(advice, key=lambda item: item[0])]


def _accumulation_refused(cfg: Mapping[str, Any], kind: str) -> str | None:
    """The first problem the techniques' rules find with ``cfg`` accumulating gradients (optimizer_in_bwd steps in
    each backward), or None when it could."""
    rules = registry.DISTRIBUTED_MEMORY_RULES if kind == "distributed" else registry.MEMORY_RULES
    before = {problem for rule in rules for problem in rule(cfg)}
    after = [problem for rule in rules for problem in rule({**cfg, "gradient_accumulation_steps": 2})]
    return next((problem for problem in after if problem not in before), None)


def device_memory_budget(limit, device: torch.device | str) -> int | None:
    """``device_memory_limit`` in bytes as it binds on ``device``: on CUDA no more than the device holds (a larger
    limit leaves the whole device); None without a limit."""
    if limit is None:
        return None
    size = parse_budget(limit, "device_memory_limit")
    if torch.device(device).type == "cuda":
        size = min(size, torch.cuda.get_device_properties(device).total_memory)
    return size


@contextlib.contextmanager
def oom_guard(phase: str, cfg: Mapping[str, Any]):
    """Re-raise an out-of-memory error inside the block as :class:`OutOfMemory` naming ``phase`` and the advice."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        stats = ""
        if torch.cuda.is_available():
            stats = (f" (allocated {torch.cuda.memory_allocated() / GIB:.1f} GiB, peak "
                     f"{torch.cuda.max_memory_allocated() / GIB:.1f} GiB, reserved {torch.cuda.memory_reserved() / GIB:.1f} GiB)")
        elif str(err).startswith("device_memory_limit"):  # the byte tracker's, off CUDA
            stats = f" ({err})"
        advice = ", ".join(memory_advice(cfg)) or "a smaller model or a larger GPU"
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        total = device_memory_budget(cfg.get("device_memory_limit"), device)  # a limit over the card: the card
        if total is None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
        raise OutOfMemory(f"out of memory during {phase}{stats}; to lower the peak try: {advice}; or let the "
                          f"planner find the fastest config that fits: {fit_command_line(cfg, total)}") from err
