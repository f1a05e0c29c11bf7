"""``oom_recovery``: a step that runs out of device memory is re-planned under the limit with what the run measured,
the fastest lossless config that keeps the samples per step is taken on by the running model, and the same step
runs again with the same samples in the same order.

On an out-of-memory error in forward or backward (before the optimizer step began: parameters are untouched):

1. **Measure.** The longest row the run has met (the failing step's included); the device bytes held when the
   error came (the byte tracker's live bytes at the refused op off CUDA, ``torch.cuda.max_memory_allocated()`` on
   CUDA); on CUDA the allocator's reserved-but-unallocated bytes (its cached, fragmented blocks).
2. **Re-plan** (:func:`replan`): the run's config, planned for rows of that length, through ``mtune plan --fit``'s
   own search and ranking (`mtune.training.planning.fit.search`, lossless only) over the choices a running model can
   take on (:func:`adoptable_knobs`): the micro-batch (each step's micro-batches split into smaller ones: the same
   samples per step through more accumulation), activation checkpointing of more blocks, and activation
   offloading; every other technique stays as configured. The device budget is ``device_memory_limit``, lowered by
   the ratio of the plan to the measured bytes when the run held more than planned (the plan under-counts this
   run), with the measured reserved-minus-allocated bytes as the allocator margin.
3. **Adopt** the answer: the micro-batches of this and every later step are split to its size, the techniques it
   turns on are applied to the model in place (their ``on_model``), and the config the run now runs is written to
   ``${output_dir}/mtune_fit.yaml`` (:data:`RUN_CONFIG_NAME`) and into every later checkpoint, so a resume with
   ``--config ${output_dir}/mtune_fit.yaml resume_from_checkpoint=true`` runs it. One line in the log says what
   changed and why.
4. **Bounded:** at most :data:`MAX_RECOVERIES` re-plans in a run. When nothing fits as planned, the leanest
   adoptable config is tried once anyway (the plan is an estimate; the run's own measurement decides), unless its
   floor (weights, states) alone is over the budget. When that fails too (or the bound is reached) the run saves a checkpoint of its last whole step (intact: the failed step changed no parameter) and ends with one
   line saying so and what would fit, from the plan of the leanest adoptable config.

Distributed runs take one decision: the byte tracker only notes a rank that went over the limit, the ranks agree at
the optimizer step (an all-reduced flag, before any parameter changes), every rank raises the error, the measured
figures are all-reduced (max), rank 0 re-plans (in a helper process: the planner's fake process group cannot stand
beside the run's) and broadcasts the answer. On CUDA a rank that truly runs out inside forward or backward cannot
join that agreement (its peers wait in a collective), so there the error ends the run as before.

Not retried: an error once the optimizer step began (optimizer-in-backward steps inside backward), a step whose
micro-batches are not token batches (a preference run's pairs: their chosen and rejected rows must stay together),
and ``oom_recovery: false``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.optim.optimizer import register_optimizer_step_pre_hook

from mtune.config.keys import samples_per_step
from mtune.units import format_bytes, parse_bytes

__all__ = ["OomRecovery", "replan", "adoptable_knobs", "halve_micro_batches", "RUN_CONFIG_NAME", "MAX_RECOVERIES"]

log = logging.getLogger(__name__)

RUN_CONFIG_NAME = "mtune_fit.yaml"
"""The config a run runs, in ``output_dir``, when a plan chose it (``mtune run --fit``, or a recovery): a resume
reads it with ``--config``."""

MAX_RECOVERIES = 3
"""Re-plans in one run; the next out-of-memory error ends the run (with a checkpoint) as when nothing fits."""

# The techniques a running model can take on: their ``on_model`` works in place on a materialized model (and on
# FSDP2's sharded blocks), and they change no number a step computes.
_ADOPTABLE_KNOB = "activation_checkpointing"  # its levels include activation offloading
_AC_KEYS = ("enable_activation_checkpointing", "activation_checkpointing_every_n_layers",
            "activation_checkpointing_policy")

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


# ------------------------------------------------------------------------------------------------- re-planning
def _ac_settings(cfg) -> tuple:
    return tuple(cfg.get(key) for key in _AC_KEYS) + (bool(cfg.get("enable_activation_offloading")),)


def _reachable(cfg, overrides: dict) -> bool:
    """Whether the running model can take on ``overrides`` of the checkpointing knob: checkpointing is only added
    (a checkpointed block stays so, with its policy), offloading only turned on."""
    now = _ac_settings(cfg)
    after = _ac_settings({**{k: cfg.get(k) for k in (*_AC_KEYS, "enable_activation_offloading")}, **overrides})
    if now[3] and not after[3]:
        return False
    return not now[0] or now[:3] == after[:3]


def adoptable_knobs(cfg, rows: int) -> list:
    """``mtune plan --fit``'s knobs (`registry_knobs`) cut to what a running model can take on: the micro-batch
    (sizes that divide ``rows``, the rows of the micro-batches the loader makes), activation checkpointing and
    offloading where :func:`_reachable`; every other knob keeps the config's choice (one choice, no change)."""
    from mtune.training.memory.technique import FitChoice
    from mtune.training.planning.candidates import Knob, registry_knobs

    def as_configured(_cfg):
        return [FitChoice(0, {})]

    def micro_batch(knob):
        return lambda c: [ch for ch in knob.choices(c) if rows % int(ch.overrides["batch_size"]) == 0]

    def checkpointing(knob):
        def choices(c):
            kept = [ch for ch in knob.choices(c) if _reachable(c, ch.overrides)]
            same = [ch for ch in kept if not ch.overrides or all(c.get(k) == v for k, v in ch.overrides.items())]
            return kept if same else [FitChoice(0, {}), *(ch for ch in kept if ch.level > 0)]
        return choices

    knobs = []
    for knob in registry_knobs():
        if knob.name == "micro_batch":
            knobs.append(Knob(knob.name, micro_batch(knob)))
        elif knob.name == _ADOPTABLE_KNOB:
            knobs.append(Knob(knob.name, checkpointing(knob), knob.floor_only))
        else:
            knobs.append(Knob(knob.name, as_configured, knob.floor_only))
    return knobs


def _schema(cfg, world_size: int):
    """The technique rules a candidate must keep (the run's own keys were checked at launch)."""
    from mtune.training.memory.registry import DISTRIBUTED_MEMORY_RULES, MEMORY_RULES

    sharded = world_size > 1 or "fsdp_reshard_after_forward" in cfg
    return SimpleNamespace(rules=DISTRIBUTED_MEMORY_RULES if sharded else MEMORY_RULES)


def replan(cfg, *, limit: int, longest_tokens: int, held_bytes: int, fragmentation: int = 0, world_size: int = 1,
           rows: int | None = None) -> dict[str, Any]:
    """The fastest lossless config that keeps ``cfg``'s samples per step and fits ``limit`` bytes of device memory,
    planned for rows of ``longest_tokens`` tokens, among :func:`adoptable_knobs` (``rows``: the loader's rows per
    micro-batch; default ``cfg.batch_size``). ``held_bytes``: what the run held on the device when it ran out;
    when the plan of ``cfg`` is below it, the budget is ``limit`` scaled by plan / held (the plan under-counts this
    run by that much). ``fragmentation``: the allocator's reserved-minus-allocated bytes, kept free.

    Returns a JSON-able dict: ``changes`` (the keys to change, with their values; None when nothing fits),
    ``planned`` (the answer's planned device bytes), ``budget`` (the bytes searched), ``current`` (``cfg``'s own
    plan), ``leanest`` and ``leanest_bytes`` (the most saving adoptable config and its plan, to say what would
    fit), ``floor`` (why the leanest's floor alone is over the budget, or None)."""
    from mtune.training.planning.candidates import describe, with_overrides
    from mtune.training.planning.cost import model_facts
    from mtune.training.planning.estimate import Estimator
    from mtune.training.planning.fit import best_of, search
    from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES

    rows = int(cfg.batch_size) if rows is None else rows
    plan_cfg = with_overrides(cfg, {"tokenizer.max_seq_len": int(longest_tokens)})
    context = CUDA_CONTEXT_BYTES if model_facts(cfg).cuda else 0  # in the plan's total, outside the allocator's limit
    estimator = Estimator(device_memory=limit + context, host_memory=None, world_size=world_size)
    current = estimator.estimate(plan_cfg).device_peak_bytes
    budget = limit if current >= held_bytes or not held_bytes else int(limit * current / held_bytes)
    candidates = search(plan_cfg, _schema(cfg, world_size), device_memory=budget + context, host_memory=None,
                        knobs=adoptable_knobs(cfg, rows), world_size=world_size, lossy="never",
                        margin=fragmentation, estimator=estimator)
    best = best_of(candidates)
    answer: dict[str, Any] = {"budget": budget, "current": current, "seq_len": int(longest_tokens)}
    if best is not None:
        return {**answer, "changes": best.changes, "planned": best.plan.device_total_bytes - context,
                "described": describe(best.changes)}
    leanest = max(candidates, key=lambda c: sum(c.levels)) if candidates else None
    if leanest is None:
        return {**answer, "changes": None, "leanest": {}, "leanest_bytes": None, "described": "(as configured)"}
    plan = leanest.plan if leanest.plan is not None and not leanest.plan.lower_bound else \
        estimator.whole(with_overrides(plan_cfg, leanest.overrides))
    return {**answer, "changes": None, "leanest": leanest.changes, "leanest_bytes": plan.device_total_bytes - context,
            "described": describe(leanest.changes), "floor": leanest.reason}


# What torchrun tells its workers: the helper process must not take itself for one of them.
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                       "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def _replan_in_helper(cfg, **measured) -> dict[str, Any]:
    """:func:`replan` in a helper process (this module as a script): in a distributed run the planner's fake
    process group cannot stand beside the run's."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC")}
    request = {"cfg": OmegaConf.to_container(cfg, resolve=True), "measured": measured}
    done = subprocess.run([sys.executable, "-m", "mtune.training.oom_recovery"], env=env, capture_output=True,
                          text=True, input=json.dumps(request), timeout=1800)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"the re-plan failed: {tail}"}
    return json.loads(lines[-1])


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
        self.enabled = enabled
        self.limit = (parse_bytes(session.cfg.device_memory_limit, "device_memory_limit")
                      if session.cfg.get("device_memory_limit") is not None else None)
        self.rows: int | None = None  # rows per micro-batch since the last recovery (None: as the loader makes them)
        self.recoveries = 0
        self.changed: dict[str, Any] = {}  # every change the recoveries made to the run's config, in order
        self._stepped = False
        self._longest = 0
        tracker = getattr(session.breakdown, "tracker", None)
        self._tracker = tracker if tracker is not None and tracker.device_limit is not None else None
        if self.distributed and self._tracker is not None and enabled:
            self._tracker.defer_limit = True  # the ranks agree at the optimizer step (see _agree)

    # ---------------------------------------------------------------------------------------------- a step
    def split(self, micro_batches: list[dict]) -> list[dict]:
        """The step's micro-batches cut to the rows the last recovery chose (halved, in order)."""
        while self.rows is not None and int(micro_batches[0]["tokens"].shape[0]) > self.rows:
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
        self._longest = max(self._longest, *(int(b["tokens"].shape[-1]) for b in micro_batches))
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
        if not self.enabled or self._stepped:
            return False
        if set(micro_batches[0]) - _TOKEN_BATCH_FIELDS:
            return False  # not a token batch (a preference pair): its micro-batches cannot be cut
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
        return _Failure(reason, self._longest, int(held), int(max(fragmentation, 0)))

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
            return _quietly(lambda: replan(cfg, **measured))
        answer = [_replan_in_helper(cfg, **measured) if self.run_ctx.rank == 0 else None]
        dist.broadcast_object_list(answer, src=0)  # one decision, taken by every rank
        return answer[0]

    def _recover(self, failure: _Failure, micro_batches: list[dict], step: int) -> None:
        failure = self._agreed_failure(failure)
        rows = int(micro_batches[0]["tokens"].shape[0])
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
        from mtune.training.planning.candidates import describe

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
        from mtune.training.memory import registry
        from mtune.training.memory.registry import MemoryConfig
        from mtune.training.planning.candidates import describe, with_overrides

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
        from mtune.training.memory.oom import OutOfMemory

        path = self.session.save()
        saved = (f"saved the last whole step, {step - 1}, to {path} (resume_from_checkpoint=true)" if path is not None
                 else f"saved the last whole step, {step - 1}")
        from mtune.training.planning.candidates import describe

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


if __name__ == "__main__":  # the helper process of a distributed run's re-plan (see _replan_in_helper)
    _request = json.load(sys.stdin)
    try:
        _answer = replan(OmegaConf.create(_request["cfg"]), **_request["measured"])
    except Exception as _err:  # the run says it in its own words
        _answer = {"error": f"the re-plan failed: {str(_err).splitlines()[0] if str(_err) else type(_err).__name__}"}
    print(json.dumps(_answer))
