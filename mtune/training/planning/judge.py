"""How a ``--fit`` search decides one candidate (`Judge.consider`): rejected by its floor, pruned by dominance, or
planned and judged against the device and host budgets. The order candidates are put to it is the search's own
(`mtune.training.planning.fit.search`, cheapest first; the reached length of ``--maximize``, most saving first)."""

from __future__ import annotations

from collections.abc import Callable

from mtune.training.planning.candidates import Candidate, Knob, describe, floor_reason
from mtune.training.planning.cost import model_facts, step_cost
from mtune.training.planning.estimate import Estimator
from mtune.training.planning.host import fewer_offloaded_blocks
from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES, MemoryPlan
from mtune.units import format_bytes

__all__ = ["Judge", "fits_budgets", "dominates"]


def fits_budgets(plan: MemoryPlan, device_memory: int, host_memory: int | None, margin: int) -> bool:
    """Whether ``plan`` fits as ``--fit`` judges it: the device total plus ``margin`` within ``device_memory``, the
    host's share (`MemoryPlan.host_need_bytes`) within ``host_memory`` (None: unbounded). Records the budgets on the
    plan."""
    plan.device_memory, plan.host_memory = device_memory, host_memory
    spare = plan.fits()
    return spare["device"] - margin >= 0 and (spare["host"] is None or spare["host"] >= 0)


def dominates(high: tuple[int, ...], low: tuple[int, ...]) -> bool:
    """Whether the knob levels ``high`` save at least as much as ``low`` on every knob (levels: higher saves more)."""
    return all(a <= b for a, b in zip(low, high))


class Judge:
    """Decides candidates against a device budget (less ``margin``, the allocator's headroom) and a host budget
    (None: unbounded), remembering the knob levels of those over the device for pruning.

    Per candidate: its floor over a budget rejects it unplanned (``reason``); a candidate that saves no more than
    one over the device on any knob is pruned unplanned (memory grows as a knob saves less); else it is planned
    (``estimator``; the four-block plan skipped where the two-block one is over a budget already), with as many
    blocks' inputs offloaded as the host holds where it cannot hold them all, and priced where it fits."""

    def __init__(self, cfg, estimator: Estimator, *, knobs: list[Knob], device_memory: int, host_memory: int | None,
                 margin: int, world_size: int, progress: Callable[[str], None] | None = None):
        self.estimator, self.device_memory, self.host_memory = estimator, device_memory, host_memory
        self.offloading = [i for i, knob in enumerate(knobs) if knob.offloads]  # the candidates' levels' places
        self.margin, self.world_size, self.progress = margin, world_size, progress
        self.context = CUDA_CONTEXT_BYTES if model_facts(cfg).cuda else 0
        self.failed: list[tuple[int, ...]] = []
        """Knob levels of the candidates over the device: whatever saves no more on any knob is over it too."""
        self.failed_kept: list[tuple[int, ...]] = []
        """Knob levels of the candidates over the device with blocks' inputs kept on it because the host could not
        hold them all: whatever saves no more on any knob and offloads as much (`Knob.offloads`) is over it too."""

    def within_budget(self, plan: MemoryPlan) -> bool:
        return fits_budgets(plan, self.device_memory, self.host_memory, self.margin)

    def _within_device(self, plan: MemoryPlan) -> bool:
        return fits_budgets(plan, self.device_memory, None, self.margin)

    def _host_spare(self, plan: MemoryPlan) -> int | None:
        plan.device_memory, plan.host_memory = self.device_memory, self.host_memory
        return plan.fits()["host"]

    def dominated(self, levels: tuple[int, ...]) -> bool:
        """Whether a candidate of ``levels`` saves no more than one already over the device, on every knob; where
        that one was over it with blocks' inputs kept there for the host's room, only if it offloads as much on
        every knob that moves bytes to the host: then the host has no more room for its inputs (a lesser saving
        elsewhere, e.g. a larger frozen base, only takes room), so it offloads no more of them, and each input kept
        and each knob's lesser saving adds to the device. (Offloading the weights by block instead of by leaf
        leaves the host room for more inputs, though their floors are the same: Llama 3.1 8B QLoRA ``--maximize``
        at 40 GiB with a 23 GiB host holds 20 blocks' inputs beside block-level's weights, 18 beside leaf-level's.)"""
        if any(dominates(fail, levels) for fail in self.failed):
            return True
        return any(dominates(fail, levels) and all(levels[i] == fail[i] for i in self.offloading)
                   for fail in self.failed_kept)

    def consider(self, candidate: Candidate) -> None:
        """Sets ``candidate.fits`` (and its plan, cost, ``pruned`` and ``reason``) as the class docstring says."""
        reason = floor_reason(candidate.cfg, self.device_memory - self.margin, self.host_memory, self.context,
                              self.world_size)
        if reason is not None:
            candidate.reason, candidate.pruned, candidate.fits = reason, True, False
            if not reason.startswith("host:"):  # a candidate that saves less puts less on the host: no pruning
                self.failed.append(candidate.levels)
            return
        if self.dominated(candidate.levels):
            candidate.pruned, candidate.fits = True, False
            return
        candidate.plan = plan = self.estimator.estimate(candidate.cfg, over=lambda p: not self.within_budget(p))
        # a lower bound over the device with every block's input offloaded is over it with fewer offloaded too
        # (each input kept adds to the device): the host's rule is not asked, which would plan the candidate whole
        fewer = (None if plan.lower_bound and not self._within_device(plan)
                 else fewer_offloaded_blocks(candidate.cfg, plan, self.estimator, self._host_spare))
        host_kept = False  # whether the host's room decided how many blocks' inputs stay on the device
        if fewer is not None:  # every block's input is more than the host holds: as many as it holds
            overrides, candidate.plan = fewer
            plan, host_kept = candidate.plan, bool(overrides)
            candidate.overrides, candidate._cfg = {**candidate.overrides, **overrides}, None
        candidate.fits = self.within_budget(plan)
        if self.progress is not None:
            over_host = plan.fits()["device"] - self.margin >= 0
            self.progress(f"  plan {self.estimator.planned:>2}: {describe(candidate.changes)}: "
                          f"{'at least ' if plan.lower_bound else ''}{format_bytes(plan.device_total_bytes)} "
                          + ("fits" if candidate.fits else "does not fit"
                             + (f" the host ({format_bytes(plan.host_need_bytes)})" if over_host else "")))
        if candidate.fits:
            candidate.cost = step_cost(candidate.cfg, plan.paged_bytes(), self.world_size)
        elif plan.fits()["device"] - self.margin < 0:
            # over the device: whatever saves no more on any knob is over it too. Over the host only, it prunes
            # nothing: a candidate that offloads less holds less there. Where the host's room kept blocks' inputs
            # on the device, only those that offload as much elsewhere: one that offloads less (weights) leaves
            # the host room for more of the inputs.
            if host_kept:
                self.failed_kept.append(candidate.levels)
            else:
                self.failed.append(candidate.levels)
