"""The per-step machinery every training recipe shares, so that a recipe's own loop is four lines::

    session = TrainingSession.from_config(cfg, run, model=..., tokenizer=..., optimizer=..., data=..., loss_fn=...)
    for micro_batches in session.batches():     # from the resume point; honours epochs and max_steps_per_epoch
        result = session.train_step(micro_batches)
        session.end_step(result)                 # lr schedule, metrics, eval, checkpoints, stop signals
    session.finish()                             # final checkpoint, task metric after training

What happens in a step, in order: forward and backward of every micro-batch (token-weighted loss), unscale and clip,
optimizer step (or none with optimizer-in-backward), LR scheduler step, metrics, ``val_loss`` every
``eval_every_n_steps``, a checkpoint every ``save_every_n_steps`` or when SIGTERM/SIGINT asked to stop.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from mtune.config import instantiate
from mtune.config.keys import accumulation_steps
from mtune.modules.loss import ChunkedCrossEntropyLoss
from mtune.training.checkpointing.checkpoint_dir import read_checkpoint_state
from mtune.training.checkpointing.checkpointer import Checkpointer, DistributedCheckpointer
from mtune.training.context import RunContext
from mtune.training.data_setup import StepPlan
from mtune.training.loop import NonFiniteLossError, StepResult, evaluate, micro_batch_groups, train_step
from mtune.training.measured_memory import memory_breakdown, plan_check
from mtune.training.memory.oom import oom_guard
from mtune.training.memory.registry import LoraConfig, MemoryConfig
from mtune.training.observe.flops import StepFlops
from mtune.training.observe.monitor import TrainingMonitor
from mtune.training.observe.peak_flops import run_peak_flops
from mtune.training.observe.profiler import build_profiler
from mtune.training.oom_recovery import OomRecovery
from mtune.training.run_length import RunLength
from mtune.training.signals import GracefulStop, StopDuringEvaluation
from mtune.training.task_eval import results_before, run_task_eval

__all__ = ["TrainingSession"]

log = logging.getLogger(__name__)


class TrainingSession:
    """Runs the steps of a training recipe: see the module docstring. Built by the recipe from what it set up.

    Args:
        cfg: the run config (recipe-level keys are read from it).
        run: device, dtype and rank of this process.
        model, tokenizer, optimizer, lr_scheduler, loss_fn: built by the recipe.
        train_loader, val_loader: mtune resumable loaders (``val_loader`` may be None).
        plan: the step plan (``StepPlan.from_config``).
        checkpointer: writes and reads this run's checkpoints.
        activation_context: wraps forward and backward (activation offloading), or None.
        task_eval: a callable ``(model, tokenizer) -> {"exact_match": ..., ...}`` run before and after training.
    """

    def __init__(self, cfg, run: RunContext, *, model: nn.Module, tokenizer, optimizer, lr_scheduler, loss_fn,
                 train_loader, val_loader, plan: StepPlan, checkpointer: Checkpointer, activation_context=None,
                 task_eval=None):
        self.cfg, self.run, self.model, self.tokenizer = cfg, run, model, tokenizer
        self.optimizer, self.lr_scheduler, self.loss_fn = optimizer, lr_scheduler, loss_fn
        self.train_loader, self.val_loader, self.plan = train_loader, val_loader, plan
        self.checkpointer, self.activation_context, self.task_eval = checkpointer, activation_context, task_eval
        self.loss_scaler = run.loss_scaler()
        self.step, self.epoch, self.stopped = 0, 0, False
        self.results: dict[str, Any] = {}
        self._stop = GracefulStop(rank=run.rank, world_size=run.world_size)
        self.length = RunLength.fresh(plan)  # how the steps map onto the LR schedule (another on a resume)
        self._resumed_from: tuple[Any, int] | None = None  # (checkpoint, step) when this run resumed

    @classmethod
    def from_config(cls, cfg, run: RunContext, *, model: nn.Module, tokenizer, optimizer, data, loss_fn,
                    base_checkpoint_dir, activation_context=None, task_eval=None) -> "TrainingSession":
        """The session of a training recipe, from its config and the parts it set up: builds the LR schedule, the
        checkpointer (sharded DCP state when a process group is up, a LoRA adapter with a ``lora`` node) and the
        task metric, then resumes when ``resume_from_checkpoint`` asks.

        Args:
            data: ``(train_loader, val_loader, plan)`` from :func:`setup_data`.
            base_checkpoint_dir: the checkpoint the model started from (None for random weights).
            activation_context: from ``setup_model`` (activation offloading), or None.
            loss_fn: the recipe's loss (``build_loss(cfg.loss)``, or a preference recipe's objective).
            task_eval: built by the recipe instead of from ``task_eval`` (preference recipes: held-out rewards).
        """
        train_loader, val_loader, plan = data
        plan.check_warmup((cfg.get("lr_scheduler") or {}).get("num_warmup_steps"), warn=run.is_main)
        lora = LoraConfig.from_config(cfg)
        checkpointer_args = dict(
            output_dir=run.output_dir, config=OmegaConf.to_container(cfg, resolve=True),
            base_checkpoint_dir=base_checkpoint_dir, lora=lora,
            save_adapter_weights_only=bool(lora is not None and cfg.save_adapter_weights_only),
            keep_last_n_checkpoints=cfg.keep_last_n_checkpoints,
            verify_checksums=cfg.get("verify_checksums", True), memory=MemoryConfig.from_config(cfg),
        )
        checkpointer = (DistributedCheckpointer(rank=run.rank, world_size=run.world_size, **checkpointer_args)
                        if dist.is_initialized() else Checkpointer(**checkpointer_args))
        path = checkpointer.find(cfg.resume_from_checkpoint) if cfg.get("resume_from_checkpoint") else None
        length = RunLength.fresh(plan) if path is None else RunLength.resumed(
            plan, read_checkpoint_state(path), path, cfg=cfg, batches_per_epoch=len(train_loader),
            world_size=run.world_size)
        lr_scheduler = instantiate(cfg.lr_scheduler, optimizer, num_training_steps=length.schedule_steps)
        length.apply(lr_scheduler, path)
        task_eval = task_eval or instantiate(cfg.get("task_eval"))
        session = cls(cfg, run, model=model, tokenizer=tokenizer, optimizer=optimizer, lr_scheduler=lr_scheduler,
                      loss_fn=loss_fn, train_loader=train_loader, val_loader=val_loader, plan=plan,
                      checkpointer=checkpointer, activation_context=activation_context, task_eval=task_eval)
        session.length = length
        if path is not None:
            session.resume(path)
        return session

    # ---------------------------------------------------------------------------------------------- start
    def resume(self, path) -> None:
        """Continue from the checkpoint at ``path``: weights, optimizer, schedule, data position and RNGs."""
        state = self.checkpointer.resume(path, model=self.model, optimizer=self.optimizer,
                                         lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler,
                                         dataloader=self.train_loader)
        RunLength.place(self.train_loader, self.plan, state.step)
        self.step, self.epoch = state.step, self.train_loader.epoch
        self._resumed_from, self.results = (path, state.step), results_before(path)  # its scores before training

    def _setup_utilization(self):
        """FLOPs per step (``mfu``, ``hfu``) and the device's peak (:func:`run_peak_flops`), or None when unknown."""
        recomputes = isinstance(self.loss_fn, ChunkedCrossEntropyLoss) and self.loss_fn.recomputes_projection(
            self.model.lm_head, autocast=self.run.dtype_name == "fp16")
        self.step_flops = StepFlops(self.model, loss_recomputes_projection=recomputes,
                                    memory=MemoryConfig.from_config(self.cfg))
        self._step_flops_now: tuple[float, float] | None = None
        return run_peak_flops(self.run.device, self.run.dtype_name, announce=self.run.is_main)

    def _start(self) -> None:
        self.monitor = TrainingMonitor(
            output_dir=self.run.output_dir, device=self.run.device, total_steps=self.plan.total_steps,
            initial_step=self.step, log_every_n_steps=self.cfg.get("log_every_n_steps") or 1,
            metric_logger=self.cfg.get("metric_logger"), rank=self.run.rank, world_size=self.run.world_size,
            peak=self._setup_utilization(),
        )
        self.breakdown = memory_breakdown(self.cfg, self.run, self.model, self.optimizer,
                                          frozen=getattr(self.loss_fn, "frozen_tensors", ()))
        self.recovery = OomRecovery(self, enabled=bool(self.cfg.get("oom_recovery")))
        self.monitor.memory_metrics = self.breakdown.log_metrics
        self.profiler = build_profiler(self.cfg.get("profiler"), output_dir=self.run.output_dir, rank=self.run.rank)
        self.profiler.__enter__()
        self._stop.__enter__()
        if self.run.is_main:
            self.checkpointer.check_room(self.model, self.optimizer)
        if self.task_eval is not None and self._resumed_from is None:
            self._run_task_eval("before")
        log.info("training: %d steps (%d per epoch x %d epochs), %d samples per step", self.plan.total_steps,
                 self.plan.steps_per_epoch, self.plan.epochs, self.plan.samples_per_step)

    # ----------------------------------------------------------------------------------------------- loop
    def batches(self) -> Iterator[list[dict]]:
        """Micro-batch groups, one per optimizer step, from where the run stands to its last step."""
        self._start()
        if self._stop.requested_on_any_rank():  # in the evaluation before training: nothing trained, nothing saved
            self.stopped = True
            return
        accumulation = accumulation_steps(self.cfg)
        for epoch in range(self.epoch, self.plan.epochs):
            if self.step >= self.plan.total_steps:
                return
            self.epoch = epoch
            self.train_loader.set_epoch(epoch)
            done = self.train_loader.consumed // self.plan.samples_per_step
            if done >= self.plan.steps_per_epoch:
                continue
            for micro_batches in micro_batch_groups(self.train_loader, accumulation):
                yield micro_batches
                if self.stopped:
                    return
                done += 1
                if done >= self.plan.steps_per_epoch:
                    break

    # A non-finite loss this few steps after resuming points at the checkpoint before the learning rate.
    SUSPECT_CHECKPOINT_STEPS = 10

    def train_step(self, micro_batches: list[dict]) -> StepResult:
        try:
            return self._train_step(micro_batches)
        except NonFiniteLossError as err:
            if self._resumed_from is None or self.step - self._resumed_from[1] >= self.SUSPECT_CHECKPOINT_STEPS:
                raise
            path, resumed_at = self._resumed_from
            raise NonFiniteLossError(
                f"{str(err).split(';')[0]}, {self.step + 1 - resumed_at} step(s) after resuming from {path}: suspect "
                "that checkpoint (damaged, or saved from a run that was already diverging) before the learning rate",
                "resume from an earlier checkpoint (resume_from_checkpoint=<its directory>); with verify_checksums="
                "true mtune checks a checkpoint's files against their checksums when resuming") from None

    def _train_step(self, micro_batches: list[dict]) -> StepResult:
        self._step_flops_now = self.step_flops(micro_batches)
        self.monitor.step_started()
        with oom_guard("forward/backward and optimizer step", self.cfg):  # oom_recovery re-plans and retries first
            return self.recovery.run(self._step_once, micro_batches, self.step + 1)

    def _step_once(self, micro_batches: list[dict]) -> StepResult:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.breakdown.track_step())  # every op of the step (a dispatch mode, not a hook)
            if self.activation_context is not None:
                stack.enter_context(self.activation_context)
            return train_step(self.model, micro_batches, self.loss_fn, self.optimizer, device=self.run.device,
                              autocast=self.run.autocast, loss_scaler=self.loss_scaler,
                              clip_grad_norm=self.cfg.get("clip_grad_norm"), world_size=self.run.world_size,
                              step=self.step + 1, fp16=self.run.dtype_name == "fp16")

    def end_step(self, result: StepResult) -> None:
        self.step += 1
        lr = float(self.optimizer.param_groups[0]["lr"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.profiler.step()
        self.monitor.step(step=self.step, epoch=self.epoch, result=result, lr=lr, flops=self._step_flops_now)
        every_eval = self.cfg.get("eval_every_n_steps")
        if self.val_loader is not None and every_eval and self.step % every_eval == 0:
            try:  # a stop signal drops it: the step is saved below, without its val_loss
                with self._stop.interrupting("val_loss"):
                    self.monitor.log({"val_loss": self.val_loss()}, step=self.step)
            except StopDuringEvaluation:
                self.monitor.write(f"val_loss of step {self.step}: stopped by a signal, not logged")
        stop = self._stop.requested_on_any_rank()
        every_save = self.cfg.get("save_every_n_steps")
        if stop or (every_save and self.step % every_save == 0):
            self.save()
        if stop:
            self.stopped = True
            log.info("stopped by a signal after step %d; resume with resume_from_checkpoint=true", self.step)

    def val_loss(self) -> float:
        """Token-weighted mean loss over the whole held-out set (``dataset_val``), with its own progress (a
        short-lived bar counting batches, or a starting line) while it runs."""
        self.val_loader.set_epoch(0)  # every evaluation reads the whole held-out set from its start
        monitor = getattr(self, "monitor", None)  # None before the run starts: nothing to show progress on
        shown = monitor.activity("val_loss", total=len(self.val_loader), unit="batches") if monitor else None
        with shown or contextlib.nullcontext() as activity:
            batches = activity.count(self.val_loader) if activity else self.val_loader
            with oom_guard("evaluation", self.cfg):
                return evaluate(self.model, batches, self.loss_fn, device=self.run.device,
                                autocast=self.run.autocast)

    # ---------------------------------------------------------------------------------------------- end
    def save(self, final: bool = False):
        with oom_guard("checkpoint save", self.cfg):
            return self.checkpointer.save(
                step=self.step, epoch=self.epoch, model=self.model, optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler, loss_scaler=self.loss_scaler, dataloader=self.train_loader,
                final=final, state=self.length.state())

    def finish(self) -> dict[str, Any]:
        """Write ``final/`` (unless a signal stopped the run), compute the task metric after training, close the
        logs. Returns the results (also in ``${output_dir}/results.json``)."""
        try:
            if not self.stopped:
                self.save(final=True)
                if self.task_eval is not None:
                    self._run_task_eval("after")
                self._plan_check()
        finally:
            self.breakdown.close()
            self._stop.__exit__(None, None, None)
            self.profiler.__exit__(None, None, None)
            self.monitor.close()
        self.results.update(step=self.step, skipped_steps=self.monitor.skipped_steps,
                            attention_kernel="+".join(sorted(getattr(self.model, "attention_kernels_run", ()))) or None)
        throughput = self.monitor.summary()
        if throughput:
            self.results["throughput"] = {**throughput, **({"peak_flops": self.monitor.peak.flops,
                                                            "peak_flops_source": self.monitor.peak.source}
                                                           if self.monitor.peak else {})}
            if self.run.is_main:
                log.info(self.monitor.summary_line())
        if self.run.is_main and not (self.stopped and self.step == 0):  # trained nothing: leaves no run behind
            (self.run.output_dir / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")
        return self.results

    def _plan_check(self) -> None:
        """With ``plan_check``: the plan beside the measured peak of live tensor bytes (:func:`plan_check`), also
        into ``results.json`` under ``plan_check``."""
        measured = self.breakdown.overall
        if not self.cfg.get("plan_check") or measured is None:  # every rank: the check gathers their peaks
            return
        check = plan_check(self.cfg, measured, world_size=self.run.world_size,
                           longest_batch_tokens=self.recovery.longest or None, write=self.monitor.write)
        if check is not None:
            self.results["plan_check"] = check

    def _run_task_eval(self, when: str) -> None:
        scores = run_task_eval(self.task_eval, self.model, self.tokenizer, when=when, monitor=self.monitor,
                               cfg=self.cfg, stop=self._stop)
        if scores is not None:
            self.results[f"task_eval_{when}"] = scores
