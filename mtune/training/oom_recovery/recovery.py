"""oom_recovery in a run: :class:`OomRecovery` measures a step's out-of-memory error, has it re-planned
(`replan`), takes the answer on, or saves and ends the run. See the package docstring."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mtune.config.keys import samples_per_step
from mtune.training.memory import phases, registry
from mtune.training.memory.oom import OutOfMemory, device_memory_budget
from mtune.training.memory.registry import MemoryConfig
from mtune.training.oom_recovery.replan import (MAX_RECOVERIES, PAIR_BATCH_FIELDS, RUN_CONFIG_NAME, batch_samples,
                                                halve_micro_batches, replan, replan_in_helper)
from mtune.training.planning.candidates import describe, with_overrides
from mtune.units import format_bytes

__all__ = ["OomRecovery"]

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------- the run
@dataclass
class _Failure:
    reason: str  # the error's first line
    longest_tokens: int
    held_bytes: int
    fragmentation: int


class OomRecovery:
    """``oom_recovery`` for a :class:`~mtune.training.session.TrainingSession` (see the module docstring). It reads
    and changes the session's ``cfg``, ``model``, ``activation_context`` and ``checkpointer.config``, and calls its
    ``save()`` before ending a run that nothing fits.

    Use (the session's step)::

        result = recovery.run(step_fn, micro_batches, step)   # step_fn(micro_batches) -> StepResult
    """

    def __init__(self, session, *, enabled: bool):
        self.session = session
        self.run_ctx = session.run
        self.distributed = self.run_ctx.world_size > 1 and dist.is_initialized()
        # Ranks agree at the optimizer step; a technique that steps inside backward (optimizer_in_bwd) leaves no
        # point before the parameters change where they could.
        steps_in_backward = any(f.frees_gradients for f in phases.footprints(MemoryConfig.from_config(session.cfg)))
        self.enabled = enabled and not (self.distributed and steps_in_backward)
        self.limit = device_memory_budget(session.cfg.get("device_memory_limit"), self.run_ctx.device)
        self.rows: int | None = None  # rows per micro-batch since the last recovery (None: as the loader makes them)
        self.recoveries = 0
        self.changed: dict[str, Any] = {}  # every change the recoveries made to the run's config, in order
        self._stepped = False
        self.longest = 0  # the longest row of the run so far, in tokens (plan_check reads it too)
        tracker = getattr(session.breakdown, "tracker", None)
        self._tracker = tracker if tracker is not None and tracker.device_limit is not None else None
        if self.distributed and self._tracker is not None and enabled:
            self._tracker.defer_limit = True  # the ranks agree at the optimizer step (see _agree)

    # ---------------------------------------------------------------------------------------------- a step
    def split(self, micro_batches: list[dict]) -> list[dict]:
        """The step's micro-batches cut to the rows the last recovery chose (halved, in order)."""
        while self.rows is not None and batch_samples(micro_batches[0]) > self.rows:
            halves = halve_micro_batches(micro_batches)
            if halves is None:
                break
            micro_batches = halves
        return micro_batches

    @contextlib.contextmanager
    def _watch(self):
        """Notes whether the optimizer step began; a distributed run's ranks agree there on a rank over the limit."""
        self._stepped = False
        agreed = [False]

        def began(optimizer, args, kwargs):
            if not agreed[0]:
                agreed[0] = True
                self._agree()
            self._stepped = True

        handle = register_optimizer_step_pre_hook(began)
        try:
            yield
        finally:
            handle.remove()

    def _agree(self) -> None:
        """All ranks: raise torch.OutOfMemoryError on every rank when the byte tracker noted one over the limit."""
        if not (self.distributed and self._tracker is not None and self._tracker.defer_limit):
            return
        said: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(said, self._tracker.take_over_limit())
        over = [(rank, line) for rank, line in enumerate(said) if line]
        if over:  # every rank raises, with the same words: the first rank over the limit's
            raise torch.OutOfMemoryError(f"{over[0][1]} on rank {over[0][0]}")

    def run(self, step_fn: Callable[[list[dict]], Any], micro_batches: list[dict], step: int) -> Any:
        """``step_fn`` on the step's micro-batches; after an out-of-memory error that :meth:`_retryable` allows,
        re-planned and run again (see the module docstring)."""
        self.longest = max(self.longest, *(int(b["tokens"].shape[-1]) for b in micro_batches))
        while True:
            try:
                with self._watch():
                    return step_fn(self.split(micro_batches))
            except torch.OutOfMemoryError as err:
                if not self._retryable(micro_batches):
                    raise
                failure = self._measure(err)
            # outside the except block: the failed attempt's frames, and so its tensors, are freed
            self._forget()
            self._recover(failure, micro_batches, step)

    def _retryable(self, micro_batches: list[dict]) -> bool:
        if not self.enabled:
            return False
        if self._stepped:  # say why this one is not re-planned, before the out-of-memory error
            log.warning("oom_recovery: not re-planned: the optimizer had begun its step (optimizer_in_bwd steps "
                        "during backward), so this step cannot run again")
            return False
        if set(micro_batches[0]) - PAIR_BATCH_FIELDS:
            return False  # neither a token nor a preference batch: its micro-batches cannot be cut
        if self.distributed and (self._tracker is None or not self._tracker.defer_limit):
            return False  # a real device error on one rank: its peers wait in a collective it cannot join
        return True

    def _measure(self, err: BaseException) -> _Failure:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        if torch.cuda.is_available() and self.run_ctx.device.type == "cuda":
            held = torch.cuda.max_memory_allocated(self.run_ctx.device)
            fragmentation = torch.cuda.memory_reserved(self.run_ctx.device) - torch.cuda.memory_allocated(
                self.run_ctx.device)
        else:
            held = self._tracker.refused_bytes if self._tracker is not None else 0
            fragmentation = 0  # no caching allocator: freed bytes are free
        return _Failure(reason, self.longest, int(held), int(max(fragmentation, 0)))

    def _forget(self) -> None:
        self.session.optimizer.zero_grad(set_to_none=True)
        self.session.breakdown.discard_step()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------ the decision
    def _agreed_failure(self, failure: _Failure) -> _Failure:
        """Every rank's measured figures, the largest of each (all ranks re-plan for the worst one)."""
        if not self.distributed:
            return failure
        figures = torch.tensor([failure.longest_tokens, failure.held_bytes, failure.fragmentation],
                               dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        longest, held, fragmentation = (int(v) for v in figures.tolist())
        return _Failure(failure.reason, longest, held, fragmentation)

    def _decide(self, failure: _Failure, rows: int) -> dict[str, Any]:
        cfg = self.session.cfg
        measured = dict(limit=self.limit or _cuda_total(self.run_ctx.device), longest_tokens=failure.longest_tokens,
                        held_bytes=failure.held_bytes, fragmentation=failure.fragmentation,
                        world_size=self.run_ctx.world_size, rows=rows)
        if not self.distributed:
            try:
                return _quietly(lambda: replan(cfg, **measured))
            except Exception as err:  # the run ends in one line, with a checkpoint (_give_up), not a traceback
                return {"error": f"the re-plan failed: {str(err).splitlines()[0] if str(err) else type(err).__name__}"}
        answer = [replan_in_helper(cfg, **measured) if self.run_ctx.rank == 0 else None]
        dist.broadcast_object_list(answer, src=0)  # one decision, taken by every rank
        return answer[0]

    def _recover(self, failure: _Failure, micro_batches: list[dict], step: int) -> None:
        failure = self._agreed_failure(failure)
        rows = batch_samples(micro_batches[0])
        if self.recoveries >= MAX_RECOVERIES:
            self._give_up(failure, step, f"{MAX_RECOVERIES} re-plans already (oom_recovery's bound)", None)
        self.recoveries += 1
        answer = self._decide(failure, rows)
        if "error" in answer:
            self._give_up(failure, step, answer["error"], None)
        verdict = "planned at"
        if answer["changes"] is None:
            if not answer.get("leanest") or answer.get("floor"):  # already the leanest, or its weights alone over
                self._give_up(failure, step, "nothing that keeps the samples per step fits", answer)
            # The plan is an estimate: before giving up, the run measures the leanest config itself, once.
            answer = {**answer, "changes": answer["leanest"], "planned": answer["leanest_bytes"]}
            verdict = "nothing fits as planned, so the leanest config, planned at"
        self._adopt(answer["changes"], step)

        cfg = self.session.cfg
        if not self.run_ctx.is_main:  # one decision, said once
            return
        log.warning(
            "oom_recovery: step %d ran out of memory (%s); re-planned for %s of device memory (%s; rows of %d "
            "tokens, the longest so far): %s, %s %s; running step %d again, and the steps after it, with "
            "the same %d samples per step in the same order; the run's config is now %s",
            step, failure.reason, format_bytes(answer["budget"]), _budget_why(failure, answer, self.limit),
            answer["seq_len"], describe(answer["changes"]), verdict, format_bytes(answer["planned"]), step,
            samples_per_step(cfg) * self.run_ctx.world_size, self.run_ctx.output_dir / RUN_CONFIG_NAME)

    def _adopt(self, changes: dict, step: int) -> None:
        """Take ``changes`` on: the session's config, the micro-batch size, the techniques turned on (applied to the
        model in place), the config file a resume reads and the config every later checkpoint records."""

        session = self.session
        before = MemoryConfig.from_config(session.cfg)
        cfg = with_overrides(session.cfg, changes)
        after = MemoryConfig.from_config(cfg)
        for technique in registry.TECHNIQUES:
            if before[technique] == after[technique] or not technique.enabled(after[technique], after):
                continue
            context = technique.on_model(session.model, after[technique], after, self.run_ctx.placement)
            if context is not None:
                session.activation_context = context
        if "batch_size" in changes:
            self.rows = int(changes["batch_size"])
        self.changed.update(changes)
        session.cfg = cfg
        session.checkpointer.config = OmegaConf.to_container(cfg, resolve=True)
        if self.run_ctx.is_main:
            path = self.run_ctx.output_dir / RUN_CONFIG_NAME
            path.write_text(f"# Written by oom_recovery at step {step}: changed {describe(changes)}; resume with "
                            f"--config {path} resume_from_checkpoint=true\n" + OmegaConf.to_yaml(cfg))

    def _give_up(self, failure: _Failure, step: int, why: str, answer: dict | None):
        """Save the last whole step (the failed one changed no parameter) and end with one line."""

        path = self.session.save()
        saved = (f"saved the last whole step, {step - 1}, to {path} (resume_from_checkpoint=true)" if path is not None
                 else f"saved the last whole step, {step - 1}")

        fits = ""
        if answer is not None and answer.get("leanest_bytes"):
            leanest = describe({**self.changed, **answer["leanest"]})  # from the config the run started with
            fits = (f"; the leanest config a running model can take on ({leanest}) is planned at "
                    f"{format_bytes(answer['leanest_bytes'])} for rows of {answer['seq_len']} tokens, so a "
                    f"device_memory_limit of about {format_bytes(_needed(answer, failure))} would fit it")
        raise OutOfMemory(f"out of memory in step {step} ({failure.reason}) and oom_recovery cannot go on: {why}"
                          f"{fits}; {saved}") from None


def _needed(answer: dict, failure: _Failure) -> int:
    """The limit the leanest plan needs, corrected as the budget was (the run held more than its plan)."""
    scale = failure.held_bytes / answer["current"] if failure.held_bytes > answer["current"] else 1.0
    return int(answer["leanest_bytes"] * scale) + failure.fragmentation


def _budget_why(failure: _Failure, answer: dict, limit: int | None) -> str:
    source = "device_memory_limit" if limit is not None else "the device"
    if answer["budget"] < (limit or answer["budget"]):
        return (f"{source} scaled by the plan of the config as it ran, {format_bytes(answer['current'])}, over the "
                f"{format_bytes(failure.held_bytes)} it held")
    return f"{source}" + (f" less {format_bytes(failure.fragmentation)} reserved and unallocated"
                          if failure.fragmentation else "")


def _cuda_total(device) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def _quietly(fn: Callable[[], Any]) -> Any:
    """``fn()`` with the planner's INFO lines (its fake model's setup) kept out of the run's log."""
    logger = logging.getLogger("mtune")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        return fn()
    finally:
        logger.setLevel(level)
