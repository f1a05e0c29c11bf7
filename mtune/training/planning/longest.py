"""``mtune plan --fit --maximize seq_len``: the longest context (``tokenizer.max_seq_len``) that fits a device and
its host, with the fastest memory techniques that make it fit.

The question is asked of packed rows (``dataset.packed: true``, documents side by side without padding, attention
per document), one row per micro-batch, the config's samples per optimizer step kept as accumulation. A plan's
peak grows linearly in the row length once the attention kernel keeps no ``s x s`` tensor (the segments kernel, or
``auto`` above 256 tokens; tests/recipes/test_plan_long_context.py checks it from 4K to 32K), so:

1. the candidates are `mtune.training.planning.candidates.candidates_of` the registry's knobs at micro-batch 1,
   lossless first (as ``--fit``: lossy ones only when no lossless candidate fits even :data:`SHORTEST` tokens);
2. only the candidates that no other candidate out-saves on every knob (the maxima of the search space; the recipe's
   rules exclude some combinations, so there may be several) can reach the longest context: each is planned at
   two lengths and the line through the two peaks solved for the budget (device, and host where its peak grows
   too), rounded down to :data:`STEP` tokens, then planned there and stepped down until it fits; after the first,
   a candidate is first planned one step beyond the longest length found so far, and searched only if it fits
   there (the bracket: the peak grows with the length, so one that does not fit there cannot be longer), its line
   drawn through that plan instead of the second probe's;
3. the longest of them, capped at the model's trained context (``max_position_embeddings``: Llama 3.1 131,072), is
   the answer's length; at that length the ``--fit`` search's answer (the fastest candidate that fits) is found
   from the most saving candidates down (few fit there: each maximum judged rules out what it out-saves);
4. the curve (the answer's device total at every power of two from the first probe's 8,192 tokens up to the
   length: the first and the last planned, the others on the line between them; at the low end its settings made
   to hold at every length, as the reach planned them) and the category that grew most along it (what limits the
   length) are printed, and the config is written as ``--fit`` writes it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mtune.config.keys import samples_per_step
from mtune.training.memory.technique import FitChoice
from mtune.training.model_setup import resolve_model_source
from mtune.training.planning.candidates import (Candidate, Knob, candidates_of, changed_keys, describe, floor_reason,
                                                registry_knobs, with_overrides)
from mtune.training.planning.cost import device_floor, model_facts, one_search
from mtune.training.planning.estimate import Estimator, interpolate
from mtune.training.planning.fit import FitError, best_of, close_answer, fit_header, search_phases, speed_key
from mtune.training.planning.judge import Judge, dominates
from mtune.training.planning.host import host_figures
from mtune.training.planning.memory_plan import CUDA_CONTEXT_BYTES, MemoryPlan
from mtune.training.planning.reach import PROBES, SHORTEST, STEP, Fitter, at_length, length_overrides
from mtune.units import format_bytes

__all__ = ["LongestContext", "longest_context", "longest_command", "long_context_base", "trained_context", "MAXIMIZE",
           "STEP", "SHORTEST"]

MAXIMIZE = ("seq_len",)
"""What ``--maximize`` can maximize."""


@dataclass
class LongestContext:
    """The answer: ``seq_len`` tokens per row with ``candidate``'s techniques (``None`` when nothing fits
    :data:`SHORTEST` tokens). ``capped``: stopped at the model's trained context, not by a budget."""

    seq_len: int
    candidate: Candidate | None
    trained_context: int
    capped: bool = False
    curve: list[tuple[int, MemoryPlan]] = field(default_factory=list)
    limiting: str = ""
    reach: list[tuple[Candidate, int]] = field(default_factory=list)
    """Each maximal candidate (every saving the rules allow together) searched, with the longest length it fits."""
    bounded: list[tuple[Candidate, int]] = field(default_factory=list)
    """Each maximal candidate not searched: it does not fit the length beside it, one step beyond the longest
    found before it (or the trained context was reached already)."""


def trained_context(cfg) -> int:
    """The model's trained context: its ``max_position_embeddings`` (a checkpoint's config.json; rope scaling there
    raises it), else the family's own."""
    return int(resolve_model_source(cfg.model).args.max_seq_len)


def long_context_base(cfg) -> tuple[object, dict]:
    """``cfg`` asked about long rows: packed, one row per micro-batch (the samples per step kept as accumulation),
    the dense mask replaced by the segments kernel. Returns the config and the overrides that made it."""
    samples = samples_per_step(cfg)
    overrides = {"dataset.packed": True, "batch_size": 1, "gradient_accumulation_steps": samples,
                 **_for_any_length(cfg)}
    return with_overrides(cfg, overrides), overrides


def _for_any_length(cfg) -> dict:
    """Every technique's `MemoryTechnique.length_overrides` for ``cfg`` at any length."""
    return length_overrides(cfg, any_length=True)


def _one_row_knobs() -> list[Knob]:
    """The registry's knobs with the micro-batch held at the base's one row."""
    return registry_knobs()[:-1] + [Knob("micro_batch", lambda cfg: [FitChoice(0, {})])]


def _maxima(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates no other candidate out-saves on every knob (levels: higher saves more)."""

    return [c for c in candidates if not any(d.levels != c.levels and dominates(d.levels, c.levels)
                                             for d in candidates)]


def _reaching(candidates: list[Candidate], device_budget: int, host_memory: int | None,
              world_size: int) -> list[Candidate]:
    """The candidates whose reach is searched: the maxima of those whose floor fits both budgets, and the maxima of
    those that hold nothing on the host whatever the length (no weights or states there), which every host admits:
    where the host cannot hold what a maximum offloads (its frozen weights), a candidate that keeps it on the
    device may reach further, and with the second set a larger host only adds candidates to search."""
    context = CUDA_CONTEXT_BYTES if candidates and model_facts(candidates[0].cfg).cuda else 0
    admitted = [c for c in candidates
                if floor_reason(c.cfg, device_budget, host_memory, context, world_size) is None]
    hostless = [c for c in admitted if not any(device_floor(c.cfg, world_size)[1].values())]
    first = _maxima(admitted)
    return first + [c for c in _maxima(hostless) if c not in first]


def _any_length(cfg):
    """``cfg`` with settings written for one length made to hold at every length planned."""
    overrides = _for_any_length(cfg)
    return with_overrides(cfg, overrides) if overrides else cfg


def _limiting(curve: list[tuple[int, MemoryPlan]]) -> str:
    """The device category that grew most along the curve: what the length is spent on."""
    if len(curve) < 2:
        return ""
    (s0, first), (s1, last) = curve[0], curve[-1]
    growth = {k: v - first.at_peak["device"].get(k, 0) for k, v in last.at_peak["device"].items()}
    name, grew = max(growth.items(), key=lambda kv: kv[1])
    return (f"{name} (+{format_bytes(grew)} from {s0:,} to {s1:,} tokens; {format_bytes(last.at_peak['device'][name])}"
            f" of the device peak {format_bytes(last.device_peak_bytes)})")


def _over_device(fitter: Fitter, variant, length: int) -> bool:
    """Whether ``variant``'s plan at ``length`` (planned already: a cache hit, else False without planning) is over
    the device: a failure over the host alone says nothing of a candidate that offloads less."""
    planned = fitter.estimator.planned
    plan = fitter.fitting_plan(variant, length)
    return fitter.estimator.planned == planned and not fitter.within_device(plan)


def _search_maxima_first(cfg, schema, *, knobs: list[Knob], estimator: Estimator, device_memory: int,
                         host_memory: int | None, margin: int, lossy: str, world_size: int,
                         first: tuple[int, ...] | None = None,
                         over: list[tuple[int, ...]] = ()) -> list[Candidate]:
    """The ``--fit`` search's answer at the reached length, found from the most saving candidates down: the
    cheapest of the open candidates that no other open one out-saves is judged first (after the candidate of knob
    levels ``first``, where given: the one whose reach found the length, which fits there). One that fits closes
    every candidate not cheaper than it; one over the device prunes every candidate it out-saves. At the reached
    length few candidates fit, so judging the maxima first rules out the cheaper ones with a plan per maximum,
    where the cheapest-first order planned most of them (Llama 3.1 8B LoRA at 40 GiB: 36 plans). Returns the
    candidates, each judged or left (``fits`` None); the answer is the same cheapest fit as ``search`` finds
    whatever the order (pruning rests on the same rule: memory grows as a knob saves less). ``over``: the knob
    levels of candidates the reach planned over the device at this length or a shorter one (the peak grows with
    the length), each pruning as a failure for which the host's room may have kept inputs on the device
    (`Judge.failed_kept`: what it out-saves at its levels of the offloading knobs)."""
    judge = Judge(cfg, estimator, knobs=knobs, device_memory=device_memory, host_memory=host_memory, margin=margin,
                  world_size=world_size)
    judge.failed_kept += over
    phases = search_phases(candidates_of(cfg, schema, knobs, device_memory=device_memory, world_size=world_size),
                           lossy)
    for number, phase in enumerate(phases):
        best = None
        seed = [c for c in phase if c.levels == first]
        while True:
            open_ = [c for c in phase if c.fits is None and (best is None or speed_key(c) < speed_key(best))]
            tops = _maxima(open_)
            if not tops:
                break
            candidate = seed.pop() if seed else min(tops, key=speed_key)
            judge.consider(candidate)
            if candidate.fits and (best is None or speed_key(candidate) < speed_key(best)):
                best = candidate
        if best is not None and lossy != "compete":
            return [c for p in phases[:number + 1] for c in p]
    return [c for p in phases for c in p]


@one_search()
def longest_context(cfg, schema, *, device_memory: int, host_memory: int | None, margin: int,
                    estimator: Estimator, lossy: str = "fallback", world_size: int = 1,
                    progress: Callable[[str], None] = lambda line: None) -> LongestContext:
    """The longest context that fits (the module docstring's steps)."""
    trained = trained_context(cfg)
    if trained < SHORTEST:
        raise FitError(f"the model's trained context is {trained:,} tokens (max_position_embeddings), shorter than "
                       f"the {SHORTEST:,} a long-context answer starts at: plan tokenizer.max_seq_len={trained} "
                       "without --maximize")
    base, _ = long_context_base(cfg)
    fitter = Fitter(estimator, device_memory, host_memory, margin)
    knobs = _one_row_knobs()
    # the choices at a long row (tiling the MLP is offered only where a row is wider than the model)
    probe = at_length(base, min(PROBES[-1], trained))
    candidates = candidates_of(probe, schema, knobs, device_memory=device_memory, world_size=world_size)
    lossless = [c for c in candidates if not c.lossy]
    phases = {"never": [lossless], "compete": [candidates]}.get(lossy, [lossless, [c for c in candidates if c.lossy]])
    best_len, reach, bounded = 0, [], []
    too_long: list[tuple[tuple[int, ...], int]] = []  # (a candidate's knob levels, a length it was planned over)
    for phase in phases:
        for candidate in sorted(_reaching(phase, device_memory - margin, host_memory, world_size),
                                key=lambda c: c.cost):
            progress(f"longest context with {describe(candidate.changes)}:")
            variant = _any_length(candidate.cfg)
            # the bracket: a candidate that does not fit one step beyond the longest found cannot beat it (the
            # peak grows with the length), so one plan answers it instead of a search
            beyond = min(best_len + STEP, trained)
            bracket = fitter.fitting_plan(variant, beyond) if 0 < best_len < trained else None
            if best_len and (bracket is None or not fitter.fits(bracket)):
                bounded.append((candidate, beyond))
                too_long += [(candidate.levels, beyond)] if bracket is not None and not fitter.within_device(
                    bracket) else []
                progress(f"  does not fit {beyond:,} tokens: no longer than {best_len:,}"
                         if best_len < trained else "  the trained context is reached already")
                continue
            length = fitter.longest(variant, trained, progress, planned=beyond if best_len else None)
            reach.append((candidate, length))
            over_at = length + STEP if length else SHORTEST  # the edge planned it
            too_long += [(candidate.levels, over_at)] if over_at <= trained and _over_device(fitter, variant,
                                                                                             over_at) else []
            progress(f"  fits {length:,} tokens" if length else f"  does not fit {SHORTEST:,} tokens")
            best_len = max(best_len, length)
        if best_len:
            break
    if not best_len:
        return LongestContext(0, None, trained, reach=reach)
    at_best = at_length(base, best_len)
    reached = min((c for c, length in reach if length == best_len), key=speed_key)
    found = _search_maxima_first(at_best, schema, knobs=knobs, estimator=estimator, device_memory=device_memory,
                                 host_memory=host_memory, margin=margin, lossy=lossy, world_size=world_size,
                                 first=reached.levels,
                                 over=[levels for levels, length in too_long if length <= best_len])
    answer = best_of(found)
    if answer is None:  # a candidate reached best_len, so the search must find one: say so rather than guess
        raise FitError(f"--maximize: a candidate fits {best_len:,} tokens but the --fit search there found none "
                       f"within its {len(found)} candidates (a planner fault: please report it)")
    low = PROBES[0] if best_len > PROBES[0] else 4096
    lengths = [2 ** k for k in range(int(math.log2(low)), int(math.log2(best_len)) + 1) if 2 ** k < best_len]
    lengths.append(best_len)
    # the ends planned, the powers of two between them on the line through the two (the peak is linear in the
    # row length: tests/recipes/test_plan_long_context.py): each plan of a long row costs seconds. The low end
    # has the answer's settings made to hold at every length (`auto`'s tiles), as the reach planned its
    # candidates: where the answer is the reach's own candidate, its first probe, planned already
    last = fitter.plan(answer.cfg, best_len)
    first = fitter.plan(_any_length(answer.cfg), lengths[0]) if len(lengths) > 1 else last
    curve = [(s, first if s == lengths[0] else last if s == best_len else
              interpolate(first, last, (s - lengths[0]) / (best_len - lengths[0]), estimated="on the line between "
                          f"the plans at {lengths[0]:,} and {best_len:,} tokens")) for s in lengths]
    return LongestContext(best_len, answer, trained, capped=best_len == trained, curve=curve,
                          limiting=_limiting(curve), reach=reach, bounded=bounded)


def longest_command(cfg, *, recipe: str, config_path: Path, overrides: list[str], schema, maximize: str,
                    device_memory: int | None, host_memory: int | None, world_size: int, output: Path,
                    lossy: str = "fallback") -> int:
    """``mtune plan --fit --maximize seq_len``: print the search, the curve, the answer and what limits it; write
    the answer's config to ``output``. The exit status: 1 when nothing fits :data:`SHORTEST` tokens."""
    if maximize not in MAXIMIZE:
        raise FitError(f"--maximize {maximize}: one of {', '.join(MAXIMIZE)}")
    start = time.process_time()
    host_memory, margin = fit_header(recipe, config_path, device_memory, host_memory, world_size,
                                     asked=f" --maximize {maximize}")
    estimator = Estimator(device_memory=device_memory, host_memory=host_memory, world_size=world_size)
    result = longest_context(cfg, schema, device_memory=device_memory, host_memory=host_memory, margin=margin,
                             estimator=estimator, lossy=lossy, world_size=world_size, progress=print)
    seconds = time.process_time() - start
    if result.candidate is None:
        print(f"nothing fits {SHORTEST:,}-token packed rows in {format_bytes(device_memory)} "
              f"(host {format_bytes(host_memory)}) with any technique; {seconds:.0f} CPU-s")
        return 1
    answer = result.candidate
    _, base_overrides = long_context_base(cfg)
    changes = changed_keys(cfg, answer.cfg, sorted({*base_overrides, *answer.overrides, "tokenizer.max_seq_len"}))
    print("\ncontext -> planned device total (allocator peak + context) with the answer's techniques:")
    for seq_len, plan in result.curve:
        print(f"  {seq_len:>9,} tokens  {format_bytes(plan.device_total_bytes):>10}   host "
              f"{format_bytes(plan.host_need_bytes)}" + ("   (on the line)" if "on the line" in plan.estimated else ""))
    plan = result.curve[-1][1]
    print(f"\nanswer: {result.seq_len:,} tokens per row ({estimator.planned} plans, {seconds:.0f} CPU-s)")
    print(f"  with {describe(changes)}")
    print(f"  device {format_bytes(plan.device_total_bytes)} of {format_bytes(device_memory)} (margin "
          f"{format_bytes(margin)} kept), {host_figures(plan, host_memory)}")
    if result.capped:
        print(f"  stopped at the model's trained context, {result.trained_context:,} tokens "
              "(max_position_embeddings; a checkpoint whose config.json sets rope scaling and a larger "
              "max_position_embeddings raises it)")
    elif result.limiting:
        print(f"  limited by {result.limiting}")
    return close_answer(cfg, answer, changes, "lossy: ", recipe=recipe, config_path=config_path,
                        overrides=overrides, output=output)
