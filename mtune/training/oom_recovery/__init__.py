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

Preference (DPO) runs recover alike: their micro-batches are split by pairs (a pair's chosen and rejected rows stay
in one micro-batch; the loss is a mean over the step's pairs), and the planner plans their reference model as
configured. Not retried: an error once the optimizer step began (optimizer-in-backward steps inside backward), a
step whose micro-batches are neither token nor preference batches, and ``oom_recovery: false``.
"""

from mtune.training.oom_recovery.recovery import OomRecovery
from mtune.training.oom_recovery.replan import (MAX_RECOVERIES, RUN_CONFIG_NAME, adoptable_knobs, halve_micro_batches,
                                                replan)

__all__ = ["OomRecovery", "replan", "adoptable_knobs", "halve_micro_batches", "RUN_CONFIG_NAME", "MAX_RECOVERIES"]
