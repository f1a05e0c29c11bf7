"""Fast plans for the ``--fit`` search (:class:`Estimator`): a deep model planned with two and four blocks (more
where a technique repeats over more blocks) and extrapolated per layer, micro-batch sizes derived from two planned
ones, each variant cached. Every shortcut is checked against a whole plan by ``tests/recipes/test_fit.py``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from omegaconf import OmegaConf

from mtune.config.keys import accumulation_steps
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.planning.cost import model_facts
from mtune.training.planning.host import offload_ends
from mtune.training.planning.memory_plan import MemoryPlan
from mtune.models import layer_period
from mtune.training.model_setup import resolve_model_source
from mtune.training.planning.plan import plan_memory

__all__ = ["Estimator", "planned_layers", "interpolate"]


def planned_layers(cfg) -> tuple[int, int]:
    """The two block counts planned to extrapolate ``cfg``'s model per layer: a unit of blocks and twice it. The
    unit is a multiple of two, of every technique's `Footprint.repeat_blocks` (every 2nd block checkpointed, weight
    offloading's group and the one it prefetches) and of the model's repeating pattern of layer kinds
    (`layer_period`: Qwen3.5's 4, Gemma 3's 6), so that both plans hold whole repetitions in their steady state
    and every figure grows by the same bytes per unit: two and four blocks for the choices ``--fit`` searches on a
    model of one kind."""
    period = layer_period(resolve_model_source(cfg.model).args)
    unit = math.lcm(2, period, *phases.repeat_blocks(MemoryConfig.from_config(cfg)))
    return unit, 2 * unit


def _lerp(a, b, t: float):
    """``a + (b - a) * t``, recursively over the plan's dicts, never below 0."""
    if isinstance(a, dict):
        return {k: _lerp(a[k], b[k], t) for k in a}
    return max(0, int(round(a + (b - a) * t)))


def _combine(p: MemoryPlan, q: MemoryPlan, t: float, **changes) -> MemoryPlan:
    fields_ = ("device_peak_bytes", "host_peak_bytes", "device", "host", "at_peak", "parameters", "managed_bytes")
    return replace(p, **{name: _lerp(getattr(p, name), getattr(q, name), t) for name in fields_}, **changes)


def interpolate(p: MemoryPlan, q: MemoryPlan, t: float, **changes) -> MemoryPlan:
    """The plan ``t`` of the way from ``p`` to ``q`` (every figure on the line; 0 is ``p``, 1 ``q``), with
    ``changes`` to its other fields (``estimated``: how it was obtained)."""
    return _combine(p, q, t, **changes)


def _structure_key(cfg, *, batch: bool = False) -> str:
    """``cfg`` as a key, without its micro-batch and accumulation (``batch``: with them)."""
    node = OmegaConf.to_container(cfg, resolve=True)
    if not batch:
        node.pop("batch_size", None)
        node.pop("gradient_accumulation_steps", None)
    return repr(sorted(node.items(), key=lambda kv: kv[0]))


class Estimator:
    """Plans candidates fast: a model deeper than `planned_layers` (two and four blocks for the choices ``--fit``
    searches) is planned at those two depths and extrapolated per layer (every figure is linear in the block count:
    weights, states, gradients and saved activations per block, weight offloading's resident groups constant);
    once two micro-batch sizes of one structure are planned in the same regime (one micro-batch per step, or
    several), the others are derived from the per-sample slope between them. ``exact`` plans every candidate whole.
    Plans are cached per variant."""

    def __init__(self, *, device_memory: int | None, host_memory: int | None, world_size: int = 1,
                 exact: bool = False):
        self.device_memory, self.host_memory, self.world_size, self.exact = (device_memory, host_memory,
                                                                            world_size, exact)
        self.planned = 0  # plans run (each small-model plan counts)
        self.derived = 0  # plans derived from others without running
        self._cache: dict[tuple, MemoryPlan] = {}
        self._points: dict[tuple, dict[int, MemoryPlan]] = {}
        self._planned: dict[tuple, MemoryPlan] = {}

    def _plan(self, cfg, n_layers: int | None = None) -> MemoryPlan:
        """One plan of ``cfg`` with ``n_layers`` blocks, run once per config and depth: a shortened plan that stood
        as a lower bound is the smaller of the two when the candidate is later planned in full (the host's
        fewer-blocks rule asks for it), and a copy is returned, so what a caller records on it stays its own."""
        key = (_structure_key(cfg, batch=True), n_layers)
        if key not in self._planned:
            self.planned += 1
            self._planned[key] = plan_memory(cfg, device_memory=self.device_memory, host_memory=self.host_memory,
                                             world_size=self.world_size, n_layers=n_layers)
        return replace(self._planned[key])

    def whole(self, cfg) -> MemoryPlan:
        """One plan of ``cfg`` as configured (no shortcut)."""
        return self._plan(cfg)

    def layered(self, cfg, n_layers: int | None = None, over: Callable[[MemoryPlan], bool] | None = None
                ) -> MemoryPlan:
        """``cfg`` planned with two and four blocks (`planned_layers`) and extrapolated to its own block count (or
        ``n_layers``); planned whole where that is no more blocks than the larger shortened plan. When ``over``
        says the smaller plan is over the budget already, that plan is returned as a lower bound (``lower_bound``:
        no figure shrinks as blocks are added), without the larger one."""
        n_layers = model_facts(cfg).n_layers if n_layers is None else n_layers
        layers = planned_layers(cfg)
        if self.exact or n_layers <= layers[-1]:
            return self._plan(cfg, n_layers if n_layers != model_facts(cfg).n_layers else None)
        small = self._plan(cfg, layers[0])
        if over is not None and over(small):
            return replace(small, lower_bound=True, estimated=f"planned with {layers[0]} blocks only: over the "
                                                              f"budget already, so {n_layers} blocks are")
        large = self._plan(cfg, layers[1])
        t = (n_layers - layers[0]) / (layers[1] - layers[0])
        return _combine(small, large, t, estimated=f"planned with {layers[0]} and {layers[1]} blocks, "
                                                  f"extrapolated to {n_layers}", seconds=small.seconds + large.seconds)

    def estimate(self, cfg, over: Callable[[MemoryPlan], bool] | None = None) -> MemoryPlan:
        """``cfg``'s plan by the cheapest shortcut (see the class docstring); ``over`` as :meth:`layered` takes it
        (a lower bound is never used to derive another micro-batch)."""
        structure = _structure_key(cfg)
        batch, accumulation = int(cfg.batch_size), accumulation_steps(cfg)
        key = (structure, batch, accumulation)
        if key in self._cache:
            cached = self._cache[key]
            # a lower bound stands only where it is over the budget asked now (an earlier search may have had a
            # smaller one); else the plan is made in full
            if not cached.lower_bound or (over is not None and over(cached)):
                return cached
            del self._cache[key]
        ends = None if self.exact else offload_ends(cfg)
        if ends is not None:  # between no block offloaded and every block (`offload_ends`), both planned in full
            t, none, every = ends
            p, q = self.estimate(none), self.estimate(every)
            plan = _combine(p, q, t, seconds=0.0, lower_bound=p.lower_bound or q.lower_bound,
                            estimated=(q.estimated + "; " if q.estimated else "")
                            + f"{round(t * model_facts(cfg).n_layers)} of {model_facts(cfg).n_layers} blocks "
                              "offloaded: between 0 and all")
            self.derived += 1
            self._cache[key] = plan
            return plan
        regime = (structure, accumulation > 1)
        points = self._points.setdefault(regime, {})
        if len(points) >= 2 and not self.exact:
            (b1, p1), (b2, p2) = sorted(points.items(), key=lambda kv: (abs(kv[0] - batch), kv[0]))[:2]
            plan = _combine(p1, p2, (batch - b1) / (b2 - b1), seconds=0.0,
                            batch={**p1.batch, "batch_size": batch, "accumulation": accumulation},
                            estimated=(p1.estimated + "; " if p1.estimated else "")
                            + f"micro-batch {batch} derived from {b1} and {b2} per sample")
            self.derived += 1
        else:
            plan = self.layered(cfg, over=over)
            if not plan.lower_bound:
                points[batch] = plan
        self._cache[key] = plan
        return plan
