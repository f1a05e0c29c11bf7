"""``mtune plan --fit``: search the memory techniques' choices for the configs that fit a device and its host, order
them lossless first and by one cost model, and write the best as a ready-to-run YAML.

The search space is `mtune.training.planning.candidates.KNOBS`: one per technique that declares a ``fit_knob``
(`mtune.training.memory.registry.TECHNIQUES`, in registry order), then the micro-batch (the config's samples per
optimizer step, split into micro-batches of every power-of-two size: every candidate keeps them). Each knob lists
its choices for the user's config (a level: higher saves more; a choice whose value is a node replaces that node
whole). Every candidate (one choice per knob) that the recipe's rules accept is ordered by
:func:`~mtune.training.planning.cost.step_cost`; ties go to the larger micro-batch, then the fewer techniques, then
the fewer bytes moved to and from the host, then the lower levels.

Order: lossless candidates (the same numbers as the user's config) first. Only when none fits are lossy ones
considered, the cheapest loss of quality first (each `FitChoice` ranks what it gives up), unless ``lossy="compete"``
(``--allow-lossy``: every candidate competes on speed) or ``lossy="never"`` (``--lossless-only``: refuse instead).

Per candidate, cheapest first:

1. the floor (:func:`~mtune.training.planning.cost.device_floor`: weights, optimizer states, gradients where
   nothing frees them) against each budget: over budget is rejected at once, with its reason, without planning;
2. dominance: a candidate that saves no more than one that did not fit on any knob is never planned;
3. the plan: :class:`Estimator` (two and four blocks planned and extrapolated per layer, the four-block plan skipped
   when the two-block one is over a budget already, micro-batch variants derived from the per-token slope of two
   planned micro-batches of the same structure, each shortcut checked against a whole plan by the tests; cached
   per variant). A candidate fits when its device total plus the allocator margin
   (:func:`allocator_margin`) is within the device budget and its host peak within the host budget.

The search stops after ``max_fits`` fitting candidates of the phase (or ``max_plans`` plans); the answer is the
fitting candidate of lowest cost, re-priced with its plan (paged optimizer state the device cannot keep resident).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

from mtune.config.errors import ConfigError
from mtune.config.keys import accumulation_steps, samples_per_step
from mtune.errors import MtuneError
from mtune.training.planning.cost import one_search
from mtune.training.planning.candidates import Candidate, Knob, candidates_of, describe, registry_knobs
from mtune.training.planning.host import (available_host_memory, default_host_memory, host_figures, host_line,
                                          host_reserve)
from mtune.training.planning.judge import Judge, fits_budgets
from mtune.training.planning.answer import close_answer, numerics_line, write_config
from mtune.training.planning.estimate import Estimator
from mtune.units import GIB, format_bytes

__all__ = ["search", "search_phases", "speed_key", "best_of", "fit_command", "fit_header", "fits_budgets",
           "numerics_line", "write_config", "close_answer", "FitError", "allocator_margin", "available_host_memory",
           "default_host_memory", "host_reserve", "host_that_fits", "host_line",
           "host_figures", "LOSSY_POLICIES"]

log = logging.getLogger(__name__)

LOSSY_POLICIES = ("fallback", "never", "compete")
"""``fallback`` (default): lossy candidates only when nothing lossless fits; ``never`` (``--lossless-only``);
``compete`` (``--allow-lossy``): lossy candidates compete on speed."""


class FitError(MtuneError, ValueError):
    """``--fit`` was asked something it cannot answer (it names the option to change)."""


def allocator_margin(device_memory: int) -> int:
    """Headroom a fit leaves for the caching allocator's reserved-but-free blocks: max(1 GiB, 5% of the budget).
    Stated: PyTorch's CUDA semantics notes ("Memory management") explain that reserved memory exceeds allocated
    memory by the cached, partly fragmented blocks, but give no size. The GPU suite's rows measure it without a
    limit (``max_reserved_gib`` minus ``max_allocated_gib``), and ``benchmarks/allocator_margin.py`` models it from
    a plan's allocations, also held to the smallest budget that serves them: what a fit needs, as the allocator
    under a limit waits for side streams and returns free segments before it fails. Held, the model fits within this
    rule on 15 of the 16 measured rows' plans (0.17 to 1.07 GiB over them), and needs 1.66 GiB for 8B QLoRA where
    torchao's eager dequantization runs (the fallback of the compiled kernel); the GPU suite's part 16 holds runs to
    this rule to test both (docs/benchmarks.md), so the rule stays until it has."""
    return int(max(GIB, 0.05 * device_memory))


def speed_key(c: Candidate):
    """Cost to 3 significant digits; ties to the larger micro-batch, the fewer techniques, the fewer bytes moved
    to and from the host (to 3 significant digits: the cost model hides transfers under compute, on a host link
    whose bandwidth is cited, not measured), the lower levels."""
    return (float(f"{c.cost:.3g}"), -c.micro_batch, c.techniques, float(f"{c.transfer:.3g}"), sum(c.levels[:-1]))


def search_phases(candidates: list[Candidate], lossy: str) -> list[list[Candidate]]:
    """``candidates`` in the phases a search considers them in, each in its order: lossless by speed, then lossy
    by what they give up (``fallback``); lossless only (``never``); all by speed (``compete``)."""
    if lossy not in LOSSY_POLICIES:
        raise FitError(f"lossy={lossy!r}: one of {LOSSY_POLICIES}")
    lossless = sorted((c for c in candidates if not c.lossy), key=speed_key)
    if lossy == "compete":
        return [sorted(candidates, key=speed_key)]
    if lossy == "never":
        return [lossless]
    return [lossless, sorted((c for c in candidates if c.lossy), key=lambda c: (c.quality_cost, *speed_key(c)))]


@one_search()
def search(cfg, schema, *, device_memory: int, host_memory: int | None = None, knobs: list[Knob] | None = None,
           max_fits: int = 10, max_plans: int = 40, progress: Callable[[str], None] | None = None,
           world_size: int = 1, lossy: str = "fallback", margin: int | None = None,
           estimator: Estimator | None = None) -> list[Candidate]:
    """Every candidate of ``knobs`` over ``cfg`` that ``schema``'s rules accept, in the order searched, each
    rejected by its floor, pruned, planned or left (``fits`` None), as the module docstring says."""
    margin = allocator_margin(device_memory) if margin is None else margin
    estimator = estimator or Estimator(device_memory=device_memory, host_memory=host_memory, world_size=world_size)
    knobs = registry_knobs() if knobs is None else knobs
    phases = search_phases(candidates_of(cfg, schema, knobs, device_memory=device_memory, world_size=world_size),
                           lossy)
    judge = Judge(cfg, estimator, knobs=knobs, device_memory=device_memory, host_memory=host_memory, margin=margin,
                  world_size=world_size, progress=progress)
    ordered: list[Candidate] = []
    planned_before = estimator.planned  # a shared estimator (--maximize's) has planned for others already
    for number, phase in enumerate(phases):
        fits, best = 0, None
        # Candidates of equal cost and micro-batch form a tier, considered from the most saving (highest levels)
        # down: a member that does not fit prunes every member it dominates without a plan; one that fits leaves
        # only the members that rank before it (fewer techniques, fewer bytes moved, lower levels: the ties rule) to
        # consider. A candidate's cost before planning is a lower bound of its cost after (planning can only add
        # paging traffic), so the search of a phase ends when the next candidate cannot beat the best fit found.
        for _, tier in itertools.groupby(phase, key=lambda c: (speed_key(c)[0], c.levels[-1])):
            tier = list(tier)
            ordered.extend(tier)
            for candidate in sorted(tier, key=lambda c: -sum(c.levels)):
                if fits >= max_fits or estimator.planned - planned_before >= max_plans or candidate.fits is not None:
                    continue
                if best is not None and speed_key(candidate) >= speed_key(best):
                    continue
                judge.consider(candidate)
                if candidate.fits:
                    fits += 1
                    best = candidate if best is None or speed_key(candidate) < speed_key(best) else best
        if fits and lossy != "compete":
            ordered += [c for p in phases[number + 1:] for c in p]
            break
    return ordered


def host_that_fits(cfg, schema, *, device_memory: int, host_memory: int, margin: int, world_size: int,
                   lossy: str, estimator: Estimator, knobs: list[Knob] | None = None) -> Candidate | None:
    """The answer ``--fit`` would give with no bound on the host (``lossy`` as the search takes it), or None: what a
    larger host would make fit; its plan's `MemoryPlan.host_need_bytes` is the host memory it needs (a rank's)."""
    found = best_of(search(cfg, schema, device_memory=device_memory, host_memory=None, knobs=knobs,
                           world_size=world_size, lossy=lossy, margin=margin, estimator=estimator))
    return found if found is not None and found.plan.host_need_bytes > host_memory else None


def _host_stopped(candidates: list[Candidate], margin: int) -> bool:
    """Whether the host budget rejected any candidate (its floor, or its plan within the device but not the
    host)."""
    return any((c.reason or "").startswith("host:") or (
        c.plan is not None and c.fits is False and c.plan.fits()["device"] - margin >= 0) for c in candidates)


def best_of(candidates: list[Candidate]) -> Candidate | None:
    """The fitting candidate of lowest cost (lossless before lossy unless they competed: the search stopped at the
    first phase with a fit)."""
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=speed_key) if fitting else None


def _rejections(candidates: list[Candidate]) -> list[str]:
    """One line per distinct reason a family of candidates was rejected without a plan."""
    seen: dict[str, int] = {}
    for c in candidates:
        if c.reason:
            seen[c.reason] = seen.get(c.reason, 0) + 1
    return [f"  {reason} ({n} candidate{'s' if n > 1 else ''})" for reason, n in seen.items()]


def fit_header(recipe: str, config_path: Path, device_memory: int | None, host_memory: int | None,
               world_size: int, asked: str = "") -> tuple[int, int]:
    """Print what ``--fit`` is asked (budgets, margin, where the host budget came from); a rank's host budget and
    the allocator margin. The ``world_size`` ranks of ``--nproc_per_node`` run on this one machine, so they share
    its host memory: each is planned against its share."""
    if device_memory is None:
        raise ConfigError("--fit needs --device-memory SIZE (the memory of the device to fit, e.g. 24GiB)")
    host_stated = ""
    if host_memory is None:
        host_memory, where = default_host_memory()
        host_stated = f" ({where})"
    margin = allocator_margin(device_memory)
    ranks = (f", {world_size} ranks on this machine ({format_bytes(host_memory // world_size)} of host memory each)"
             if world_size > 1 else "")
    print(f"mtune plan --fit{asked}: {recipe} with {config_path} into {format_bytes(device_memory)} "
          f"(allocator margin {format_bytes(margin)}: max(1 GiB, 5%)), host {format_bytes(host_memory)}{host_stated}"
          + ranks)
    return host_memory // world_size, margin


def fit_command(cfg, *, recipe: str, config_path: Path, overrides: list[str], schema, device_memory: int | None,
                host_memory: int | None, world_size: int, output: Path, lossy: str = "fallback") -> int:
    """``mtune plan --fit``: the fastest config that fits, its planned figures, what was given up, why the rest
    was rejected; the best written to ``output``."""
    start = time.process_time()
    host_memory, margin = fit_header(recipe, config_path, device_memory, host_memory, world_size)
    estimator = Estimator(device_memory=device_memory, host_memory=host_memory, world_size=world_size)
    candidates = search(cfg, schema, device_memory=device_memory, host_memory=host_memory, progress=print,
                        world_size=world_size, lossy=lossy, margin=margin, estimator=estimator)
    best = best_of(candidates)
    rejected = _rejections(candidates)
    seconds = time.process_time() - start
    print(f"{len(candidates)} candidates: {estimator.planned} plans run, {estimator.derived} derived, "
          f"{sum(1 for c in candidates if c.reason)} rejected by their floor, "
          f"{sum(1 for c in candidates if c.pruned and not c.reason)} pruned; {seconds:.0f} CPU-s")
    if rejected:
        print("rejected without planning:")
        print("\n".join(rejected))
    # Where the host is what stops the lossless answer (nothing fits, or only a lossy one), the search again with no
    # bound on the host says which answer more host memory would give, and how much, from that answer's own plan.
    larger_host = None
    if (best is None or (best.lossy and lossy == "fallback")) and _host_stopped(candidates, margin):
        larger_host = host_that_fits(cfg, schema, device_memory=device_memory, host_memory=host_memory,
                                     margin=margin, world_size=world_size,
                                     lossy="never" if best is not None else lossy, estimator=estimator)
    if best is None:
        what = "nothing lossless fits" if lossy == "never" else "nothing fits"
        print(f"{what} in {format_bytes(device_memory)} (host {format_bytes(host_memory)}): "
              + ("--allow-lossy or without --lossless-only, lossy choices could; " if lossy == "never" else "")
              + ("the host is what stops it" if larger_host is not None else
                 "a smaller model, a shorter tokenizer.max_seq_len, a LoRA recipe, or a larger device"))
        if larger_host is not None:
            print("  " + host_line(larger_host, world_size, "the answer"))
        return 1
    plan = best.plan
    print(f"\nanswer: {describe(best.changes)}")
    print(f"  device {format_bytes(plan.device_total_bytes)} of {format_bytes(device_memory)} (allocator peak "
          f"{format_bytes(plan.device_peak_bytes)} + context; margin {format_bytes(margin)} kept), "
          + host_figures(plan, host_memory))
    if larger_host is not None:
        print("  " + host_line(larger_host, world_size, "lossless, with more host memory: the answer"))
    if plan.estimated:
        print(f"  ({plan.estimated}; `mtune plan` on the written config gives the whole plan)")
    print(f"  micro-batch {best.cfg.batch_size} x {accumulation_steps(best.cfg)} "
          f"accumulation = {samples_per_step(best.cfg)} samples per step, as configured")
    lossy_head = (f"lossy: nothing lossless fits in {format_bytes(device_memory)}; " if lossy != "compete"
                  else "lossy (--allow-lossy): ")
    return close_answer(cfg, best, best.changes, lossy_head, recipe=recipe, config_path=config_path,
                        overrides=overrides, output=output)
