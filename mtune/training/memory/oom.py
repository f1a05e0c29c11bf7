"""Turn an out-of-memory error into advice: which phase ran out, which flags of this config would lower the peak
(only those not already set), and the exact ``mtune plan --fit`` command that finds the fastest config that fits
this device."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mtune.errors import MtuneError

__all__ = ["OutOfMemory", "oom_guard", "memory_advice", "set_invocation", "fit_command_line"]

# How this process was started (`mtune run`'s recipe, config and overrides), for the fit command in the message.
_invocation: dict = {}


def set_invocation(recipe: str, config: str, overrides: Sequence[str]) -> None:
    """Remember ``mtune run RECIPE --config CONFIG overrides`` (``mtune run`` calls this before the recipe)."""
    _invocation.update(recipe=recipe, config=str(config), overrides=list(overrides))


def fit_command_line(cfg: Mapping[str, Any], device_memory: int | None = None) -> str:
    """``mtune plan --fit --device-memory SIZE RECIPE --config CONFIG overrides`` for this run and device."""
    recipe = _invocation.get("recipe") or str(cfg.get("recipe") or "RECIPE")
    config = _invocation.get("config") or "CONFIG"
    size = f"{device_memory / 1024**3:.0f}GiB" if device_memory else "SIZE"
    words = ["mtune", "plan", "--fit", "--device-memory", size, recipe, "--config", config,
             *_invocation.get("overrides", [])]
    return " ".join(shlex.quote(w) for w in words)


class OutOfMemory(MtuneError, RuntimeError):
    """Raised instead of torch's OutOfMemoryError, with the phase and what to change."""


def memory_advice(cfg: Mapping[str, Any]) -> list[str]:
    """Flags that would lower peak memory and are not set in ``cfg`` yet, most effective first."""
    advice = []
    if not cfg.get("enable_activation_checkpointing"):
        advice.append("enable_activation_checkpointing=true")
    if cfg.get("enable_activation_checkpointing") and not cfg.get("enable_activation_offloading"):
        advice.append("enable_activation_offloading=true")
    if int(cfg.get("batch_size") or 1) > 1:
        advice.append("a smaller batch_size with a larger gradient_accumulation_steps")
    lora = cfg.get("lora")
    if lora is None:
        advice.append("a LoRA recipe (lora_single_device) instead of a full fine-tune")
    elif not lora.get("quantize_base"):
        advice.append("lora.quantize_base=true (QLoRA)")
    optimizer = str((cfg.get("optimizer") or {}).get("_component_", ""))
    if "8bit" not in optimizer.lower() and "4bit" not in optimizer.lower() and lora is None:
        advice.append("optimizer=bitsandbytes.optim.PagedAdamW8bit")
    if not cfg.get("optimizer_in_bwd") and lora is None and int(cfg.get("gradient_accumulation_steps") or 1) == 1:
        advice.append("optimizer_in_bwd=true")
    single_device = "fsdp_cpu_offload" not in cfg  # the distributed recipes offload with fsdp_cpu_offload instead
    if (single_device and optimizer == "torch.optim.AdamW" and not cfg.get("optimizer_offload")
            and not cfg.get("optimizer_in_bwd") and cfg.get("dtype") != "fp16"):
        advice.append("optimizer_offload=cpu")
    if single_device and lora is not None and cfg.get("weight_offloading") is None and not cfg.get("compile"):
        advice.append("weight_offloading={type: block_level, blocks_per_group: 1}")
    loss = str((cfg.get("loss") or {}).get("_component_", ""))
    if "Chunked" not in loss:
        advice.append("loss._component_=mtune.modules.loss.ChunkedCrossEntropyLoss")
    if cfg.get("dtype") in ("fp32", "fp16"):
        advice.append("dtype=bf16 (on GPUs that have it)")
    if (cfg.get("tokenizer") or {}).get("max_seq_len"):
        advice.append("a smaller tokenizer.max_seq_len")
    return advice


@contextlib.contextmanager
def oom_guard(phase: str, cfg: Mapping[str, Any]):
    """Re-raise an out-of-memory error inside the block as :class:`OutOfMemory` naming ``phase`` and the advice."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        stats = ""
        if torch.cuda.is_available():
            gib = 1024**3
            stats = (f" (allocated {torch.cuda.memory_allocated() / gib:.1f} GiB, peak "
                     f"{torch.cuda.max_memory_allocated() / gib:.1f} GiB, reserved {torch.cuda.memory_reserved() / gib:.1f} GiB)")
        advice = ", ".join(memory_advice(cfg)) or "a smaller model or a larger GPU"
        total = None
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        raise OutOfMemory(f"out of memory during {phase}{stats}; to lower the peak try: {advice}; or let the "
                          f"planner find the fastest config that fits: {fit_command_line(cfg, total)}") from err
