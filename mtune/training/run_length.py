"""A resumed run whose length changed (``epochs`` or ``max_steps_per_epoch``): where its steps fall and what its
learning-rate schedule does.

A step's epoch and its place in that epoch follow from its number under the run's length (``step //
steps_per_epoch``): a run resumed at step 30 with 20 steps per epoch continues in the second epoch, 10 steps in,
and stops at its total, never past it. The schedule stays continuous: it is built for the length it was first laid
out over (``schedule_steps``) and the steps left are stretched or squeezed onto the rest of it, so the learning rate
of the first resumed step is the one the saved run would have used and the schedule ends on the run's last step::

    position(step) = position_at_resume + (step - resumed_at) * (schedule_steps - position_at_resume)
                                                               / (total_steps - resumed_at)

The layout (those four numbers) goes into each checkpoint's ``mtune_state.json`` under ``run_length``, so a second
change composes with the first. A checkpoint past the new total is refused in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from mtune.training.checkpointing.recipe_state import ResumeError
from mtune.training.data_setup import StepPlan

__all__ = ["RunLength", "STATE_KEY"]

log = logging.getLogger(__name__)

STATE_KEY = "run_length"
"""The key of ``mtune_state.json`` that holds a checkpoint's :class:`RunLength`."""


@dataclass(frozen=True)
class RunLength:
    """How the run's steps map onto its LR schedule: the schedule was built for ``schedule_steps``; from step
    ``resumed_at`` (where it stood at ``position``) it is laid over the steps up to ``total_steps``."""

    schedule_steps: int
    total_steps: int
    resumed_at: int = 0
    position: float = 0.0

    @classmethod
    def fresh(cls, plan: StepPlan) -> "RunLength":
        return cls(plan.total_steps, plan.total_steps)

    @property
    def stretched(self) -> bool:
        return (self.resumed_at, self.position, self.total_steps) != (0, 0.0, self.schedule_steps)

    def at(self, step: float) -> float:
        """The schedule's own step for the run's ``step`` (at or after ``resumed_at``)."""
        if self.total_steps <= self.resumed_at:
            return self.position
        return self.position + (step - self.resumed_at) * (self.schedule_steps - self.position) / (
            self.total_steps - self.resumed_at)

    @classmethod
    def resumed(cls, plan: StepPlan, checkpoint_state: Mapping[str, Any], checkpoint, *, cfg, batches_per_epoch: int,
                world_size: int) -> "RunLength":
        """The layout of a run of ``plan`` resuming from a checkpoint (its ``mtune_state.json`` dict). Raises
        :class:`ResumeError` when the checkpoint is past this run's last step."""
        step = int(checkpoint_state["step"])
        saved = checkpoint_state.get(STATE_KEY)
        if saved is not None:
            before = cls(**saved)
        else:  # saved before layouts were recorded: the saved run's length, from its config and this data
            saved_cfg = checkpoint_state["config"]
            lengths = {key: saved_cfg.get(key) for key in ("epochs", "max_steps_per_epoch")}
            before = cls.fresh(StepPlan.from_config({**cfg, **lengths}, batches_per_epoch, world_size))
        if step > plan.total_steps:
            raise ResumeError(
                f"Cannot resume from checkpoint {checkpoint}: it is at step {step}, past this run's "
                f"{plan.total_steps} steps ({plan.steps_per_epoch} per epoch x {plan.epochs} epochs). Raise epochs or "
                "max_steps_per_epoch to continue it, or use the checkpoint as it is.")
        if plan.total_steps == before.total_steps:
            return before
        after = cls(before.schedule_steps, plan.total_steps, step, before.at(step))
        log.info("resuming at step %d of %d (it was %d): the rest of the learning-rate schedule is laid over the %d "
                 "steps left", step, plan.total_steps, before.total_steps, plan.total_steps - step)
        if after.position >= after.schedule_steps and plan.total_steps > step:
            log.warning("the learning-rate schedule ended at step %d: the %d added steps keep its final learning rate",
                        step, plan.total_steps - step)
        return after

    def apply(self, scheduler, checkpoint) -> None:
        """Lay ``scheduler`` (built for ``schedule_steps``) over the run's steps. Only a ``LambdaLR`` (every mtune
        schedule) can be stretched; another schedule with a changed length is refused in one line."""
        if not self.stretched or scheduler is None:
            return
        if not isinstance(scheduler, LambdaLR):
            raise ResumeError(
                f"Cannot resume from checkpoint {checkpoint} with another run length ({self.schedule_steps} -> "
                f"{self.total_steps} steps): lr_scheduler {type(scheduler).__name__} is not a LambdaLR, which mtune "
                "cannot stretch over the steps left. Set epochs and max_steps_per_epoch back.")
        scheduler.lr_lambdas = [self._laid_over(factor) for factor in scheduler.lr_lambdas]

    def _laid_over(self, factor):
        def laid_over(step: int) -> float:  # a plain function: LambdaLR's state_dict leaves it out
            return factor(self.at(step))

        return laid_over

    def state(self) -> dict[str, Any]:
        return {STATE_KEY: asdict(self)}

    @staticmethod
    def place(loader, plan: StepPlan, step: int) -> None:
        """Move ``loader`` to where ``step`` ends under ``plan`` when its saved position says otherwise (another
        ``max_steps_per_epoch``): the next step is in epoch ``step // steps_per_epoch``, at its place there."""
        done = loader.consumed // plan.samples_per_step
        if done <= plan.steps_per_epoch and loader.epoch * plan.steps_per_epoch + done == step:
            return
        epoch, done = divmod(step, plan.steps_per_epoch)
        loader.epoch, loader.consumed = epoch, done * plan.samples_per_step
        log.info("step %d ends step %d of epoch %d at %d steps per epoch: the data continues from there", step, done,
                 epoch + 1, plan.steps_per_epoch)
