"""Turn an out-of-memory error into advice (and, with ``oom_recovery``, retry a step in smaller micro-batches:
:class:`StepRecovery`): which phase ran out, which flags of this config would lower the peak
(only those not already set), and the exact ``mtune plan --fit`` command that finds the fastest config that fits
this device."""

from __future__ import annotations

import contextlib
import logging
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mtune.errors import MtuneError
from mtune.training.memory import registry
from mtune.training.memory.technique import advice as tier_advice
from mtune.units import GIB, MIB, parse_bytes

log = logging.getLogger(__name__)

__all__ = ["OutOfMemory", "oom_guard", "memory_advice", "set_invocation", "fit_command_line", "halve_micro_batches",
           "StepRecovery"]

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
        advice.append(tier_advice("micro_batch", "a smaller batch_size with a larger gradient_accumulation_steps"))
    if memory.run.dtype in ("fp32", "fp16"):
        advice.append(tier_advice("dtype", "dtype=bf16 (on GPUs that have it)"))
    if memory.run.max_seq_len:
        advice.append(tier_advice("seq_len", "a smaller tokenizer.max_seq_len"))
    return [text for _, text in sorted(advice, key=lambda item: item[0])]


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
        total = None
        if cfg.get("device_memory_limit") is not None:
            total = parse_bytes(cfg.get("device_memory_limit"), "device_memory_limit")
        elif torch.cuda.is_available():
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        raise OutOfMemory(f"out of memory during {phase}{stats}; to lower the peak try: {advice}; or let the "
                          f"planner find the fastest config that fits: {fit_command_line(cfg, total)}") from err


# What a batch of token rows holds (mtune.data.collate); a batch with anything else is not split.
_TOKEN_BATCH_FIELDS = {"tokens", "labels", "input_pos", "document_ids", "num_tokens"}


def halve_micro_batches(micro_batches: Sequence[dict]) -> list[dict] | None:
    """Each micro-batch split into two of half its rows, in order: the step's samples, their order and its
    token-weighted loss unchanged (`mtune.training.loop.train_step` divides by the step's trained tokens), twice the
    accumulation. None when a micro-batch holds a single row, or fields other than a token batch's (a preference
    batch: its chosen rows first, its rejected rows second, and a loss that is not per token). ``num_tokens`` (a
    throughput count) is shared in proportion to the rows."""
    halves: list[dict] = []
    for batch in micro_batches:
        rows = int(batch["tokens"].shape[0])
        if rows < 2 or set(batch) - _TOKEN_BATCH_FIELDS:
            return None
        cut = rows // 2
        first, second = {}, {}
        for key, value in batch.items():
            if key == "num_tokens":
                first[key] = value * cut // rows
                second[key] = value - first[key]
            elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
                first[key], second[key] = value[:cut], value[cut:]
            else:
                first[key] = second[key] = value
        halves += [first, second]
    return halves


class StepRecovery:
    """``oom_recovery``: a step that runs out of memory in forward or backward is run again, the same step with the
    same samples, in micro-batches of half the rows (twice the accumulation), and every later step too; bounded by
    micro-batches of one row. An out-of-memory error once the optimizer step began (parameters may be half
    updated; optimizer-in-backward steps inside backward) is not retried, nor in a distributed run (every rank
    would have to take the same decision), nor without ``oom_recovery``.

    Use::

        with recovery.watch():                     # notes whether the optimizer step began
            result = step(recovery.split(micro_batches))
        ... except torch.OutOfMemoryError as err: recovery.retry(err, ...) -> True: run it again
    """

    def __init__(self, enabled: bool, optimizer, world_size: int = 1):
        self.enabled = enabled and world_size == 1
        self.optimizer = optimizer
        self.halvings = 0  # how many times every step's micro-batches are halved since the run began
        self._stepped = False

    def split(self, micro_batches: list[dict]) -> list[dict] | None:
        """The step's micro-batches as the recoveries so far cut them (down to one row each)."""
        for _ in range(self.halvings):
            micro_batches = halve_micro_batches(micro_batches) or micro_batches  # a step of single rows stays so
        return micro_batches

    @contextlib.contextmanager
    def watch(self):
        self._stepped = False

        def began(optimizer, args, kwargs):
            self._stepped = True

        handle = register_optimizer_step_pre_hook(began)
        try:
            yield
        finally:
            handle.remove()

    def run(self, step_fn: Callable[[list[dict]], Any], micro_batches: list[dict], step: int, *,
            forget: Callable[[], None]) -> Any:
        """``step_fn`` on the step's micro-batches, run again in smaller ones while :meth:`retry` allows; ``forget``
        drops a failed attempt's measurements (called once its tensors are gone)."""
        while True:
            try:
                with self.watch():
                    return step_fn(self.split(micro_batches))
            except torch.OutOfMemoryError as err:
                line = self.retry(err, micro_batches, step=step)
                if line is None:
                    raise
            forget()  # outside the except block: the failed attempt's frames, and so its tensors, are freed
            log.warning(line)

    def retry(self, err: BaseException, micro_batches: list[dict], *, step: int) -> str | None:
        """After an out-of-memory error in ``step``: the line to log when the step can run again in smaller
        micro-batches (gradients cleared, the allocator's cache emptied), else None (the error stands)."""
        if not self.enabled or self._stepped:
            return None
        if halve_micro_batches(self.split(micro_batches)) is None:
            return None
        self.halvings += 1
        self.optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        smaller = self.split(micro_batches)
        rows = int(smaller[0]["tokens"].shape[0])
        samples = sum(int(b["tokens"].shape[0]) for b in smaller)
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return (f"oom_recovery: step {step} ran out of memory ({reason}); running it again, and the steps after it, "
                f"in {len(smaller)} micro-batches of {rows} rows: the same {samples} samples per step, in the same "
                "order")
