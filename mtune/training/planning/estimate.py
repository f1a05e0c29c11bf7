"""Fast plans for the ``--fit`` search (:class:`Estimator`): a deep model planned with two and four blocks and
extrapolated per layer, micro-batch sizes derived from two planned ones, each variant cached. Every shortcut is
checked against a whole plan by ``tests/recipes/test_fit.py``."""

from __future__ import annotations

from dataclasses import replace

from omegaconf import OmegaConf

from mtune.training.memory import registry
from mtune.training.planning.cost import model_facts
from mtune.training.planning.memory_plan import MemoryPlan
from mtune.training.planning.plan import plan_memory

__all__ = ["Estimator"]

_LAYERS = (2, 4)
"""The block counts planned to extrapolate a deeper model per layer (two, so that every-2nd-block checkpointing and
the prefetch of weight offloading are in their steady state in both)."""


def _lerp(a, b, t: float):
    """``a + (b - a) * t``, recursively over the plan's dicts, never below 0."""
    if isinstance(a, dict):
        return {k: _lerp(a[k], b[k], t) for k in a}
    return max(0, int(round(a + (b - a) * t)))


def _combine(p: MemoryPlan, q: MemoryPlan, t: float, **changes) -> MemoryPlan:
    fields_ = ("device_peak_bytes", "host_peak_bytes", "device", "host", "at_peak", "parameters", "managed_bytes")
    return replace(p, **{name: _lerp(getattr(p, name), getattr(q, name), t) for name in fields_}, **changes)


def _structure_key(cfg) -> str:
    node = OmegaConf.to_container(cfg, resolve=True)
    node.pop("batch_size", None)
    node.pop("gradient_accumulation_steps", None)
    return repr(sorted(node.items(), key=lambda kv: kv[0]))


class Estimator:
    """Plans candidates fast: a model of more than four blocks is planned with two and with four blocks and
    extrapolated per layer (every figure is linear in the block count: weights, states, gradients and saved
    activations per block); once two micro-batch sizes of one structure are planned in the same regime (one
    micro-batch per step, or several), the others are derived from the per-sample slope between them. ``exact``
    plans every candidate whole. Plans are cached per variant."""

    def __init__(self, *, device_memory: int | None, host_memory: int | None, world_size: int = 1,
                 exact: bool = False):
        self.device_memory, self.host_memory, self.world_size, self.exact = (device_memory, host_memory,
                                                                            world_size, exact)
        self.planned = 0  # plans run (each small-model plan counts)
        self.derived = 0  # plans derived from others without running
        self._cache: dict[tuple, MemoryPlan] = {}
        self._points: dict[tuple, dict[int, MemoryPlan]] = {}

    def _plan(self, cfg, n_layers: int | None = None) -> MemoryPlan:
        self.planned += 1
        return plan_memory(cfg, device_memory=self.device_memory, host_memory=self.host_memory,
                           world_size=self.world_size, n_layers=n_layers)

    def whole(self, cfg) -> MemoryPlan:
        """One plan of ``cfg`` as configured (no shortcut)."""
        return self._plan(cfg)

    def layered(self, cfg, n_layers: int | None = None) -> MemoryPlan:
        """``cfg`` planned with two and four blocks and extrapolated to its own block count (or ``n_layers``)."""
        n_layers = model_facts(cfg).n_layers if n_layers is None else n_layers
        offloaded = any(t.frozen_weights_home(cfg) == "host" for t in registry.TECHNIQUES)
        if self.exact or n_layers <= _LAYERS[-1] or offloaded:
            # weight offloading's device peak is not linear in the block count between 2, 4 and more blocks (the
            # tests measured 14.5 MB extrapolated against 21.7 MB planned at 8): planned whole
            return self._plan(cfg, n_layers if n_layers != model_facts(cfg).n_layers else None)
        small, large = (self._plan(cfg, n) for n in _LAYERS)
        t = (n_layers - _LAYERS[0]) / (_LAYERS[1] - _LAYERS[0])
        return _combine(small, large, t, estimated=f"planned with {_LAYERS[0]} and {_LAYERS[1]} blocks, "
                                                  f"extrapolated to {n_layers}", seconds=small.seconds + large.seconds)

    def estimate(self, cfg) -> MemoryPlan:
        structure = _structure_key(cfg)
        batch, accumulation = int(cfg.batch_size), int(cfg.get("gradient_accumulation_steps") or 1)
        key = (structure, batch, accumulation)
        if key in self._cache:
            return self._cache[key]
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
            plan = self.layered(cfg)
            points[batch] = plan
        self._cache[key] = plan
        return plan
