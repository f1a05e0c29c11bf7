"""Live tensor bytes, by category, on the compute device and on the host: the yardstick that real runs log
(``peak_tensor_gib``, ``peak_host_tensor_gib``, ``memory_breakdown.json``) and that ``mtune plan`` runs on fake
tensors, so a prediction and a measurement count exactly the same things at the same instants.

:class:`TensorTracker` is a ``TorchDispatchMode``: every op's output storages are registered when they appear and
dropped when Python frees them (a weak reference per storage; views share one), so the running totals are the
bytes of live tensor storages after every op, and the peak is the largest of them. Nothing the allocator adds
(block rounding, caching, the CUDA context) is counted here; :mod:`mtune.training.planning.plan` adds it for a CUDA
target.

Categories (:data:`CATEGORIES`):

- ``parameters`` and ``buffers``: the model's, registered when tracking starts (NF4 weights by their packed parts,
  FSDP2 shards by this rank's shard);
- ``gradients``: a parameter's ``.grad`` from the moment autograd accumulates it;
- ``optimizer_state``: tensors in ``optimizer.state`` (recognised after each optimizer step; states created in
  the very first step count as temporaries until it ends);
- ``activations``: storages created outside backward and outside the optimizer step: the batch, what forward and
  the loss keep for backward, and forward's short-lived intermediates;
- ``temporaries``: storages created during backward (activation checkpointing's recomputation included) or the
  optimizer step that are none of the above.

Where a storage lives is decided by the run's :class:`~mtune.training.placement.Placement`: storages it
allocates on the host (offloaded activations, weights, optimizer states) count under ``host``, all others on the
compute device under ``device``. Without distinct devices (a CPU-only run) nothing moves, so everything counts
under ``device``.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from mtune.training.placement import Placement
from mtune.training.memory.tensor_bytes import plain_parts
from mtune.units import format_bytes

__all__ = ["CATEGORIES", "LOCATIONS", "TensorTracker", "StepMemory", "device_events", "recording_device_events"]

# DTensor runs each op once on fake tensors to infer its output's layout (under the planner's own FakeTensorMode
# when one is active); what that allocates is not memory a step uses.
_PROPAGATE = "_propagate_tensor_meta_non_cached"
try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
except ImportError:  # a torch build without distributed: no DTensor either
    DTensor = ShardingPropagator = None

CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")
LOCATIONS = ("device", "host")


_EVENT_LOGS: list[list[tuple[str, int, int, int]]] = []


@contextlib.contextmanager
def device_events():
    """Yields a list that receives, in order, every change to the device storages any tracker counts inside the
    block: ``("alloc", key, nbytes, stream)``, ``("resize", key, nbytes, stream)`` (an emptied or re-filled storage:
    weight offloading, FSDP2's all-gather buffers) and ``("free", key, 0, 0)``; ``key`` names a storage while it
    lives, ``nbytes`` is counted as the tracker counts it (512-byte blocks for a CUDA target) and ``stream`` is 1
    where a CUDA run allocates on a side stream (`Placement.side_stream`), else 0. An allocator model's input
    (``benchmarks/allocator_margin.py``); storages moved between device and host appear as a free or an alloc."""
    log: list[tuple[str, int, int, int]] = []
    _EVENT_LOGS.append(log)
    try:
        yield log
    finally:
        _EVENT_LOGS.remove(log)


def recording_device_events() -> bool:
    """Whether a `device_events` block is open (allocation replay then runs each call whole, so that every storage
    reaches the log)."""
    return bool(_EVENT_LOGS)


def _log_device(kind: str, record, nbytes: int, side_stream: bool = False) -> None:
    if record.where == "device":
        for log in _EVENT_LOGS:
            log.append((kind, id(record), nbytes, int(side_stream)))


def _zero() -> dict[str, dict[str, int]]:
    return {where: dict.fromkeys(CATEGORIES, 0) for where in LOCATIONS}


@dataclass
class StepMemory:
    """The live tensor bytes of one tracked interval (an optimizer step).

    ``peak[where]``: the largest total on the device / host; ``at_peak[where][category]``: what was live at the
    instant of that peak; ``category_peak[where][category]``: each category's own largest value.
    """

    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOCATIONS, 0))
    at_peak: dict[str, dict[str, int]] = field(default_factory=_zero)
    category_peak: dict[str, dict[str, int]] = field(default_factory=_zero)

    def merge(self, other: StepMemory) -> StepMemory:
        """The larger of the two intervals, per location and per category."""
        out = StepMemory()
        for where in LOCATIONS:
            best = self if self.peak[where] >= other.peak[where] else other
            out.peak[where] = best.peak[where]
            out.at_peak[where] = dict(best.at_peak[where])
            out.category_peak[where] = {c: max(self.category_peak[where][c], other.category_peak[where][c])
                                        for c in CATEGORIES}
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"peak": dict(self.peak), "at_peak": copy.deepcopy(self.at_peak),
                "category_peak": copy.deepcopy(self.category_peak)}


class _Record:
    __slots__ = ("nbytes", "category", "where", "ref")


_DEVICE = torch.ops.prim.device.default


class TensorTracker(TorchDispatchMode):
    """Counts live tensor bytes by category and location; see the module docstring.

    Use::

        tracker = TensorTracker(placement, model=model, optimizers=inner_optimizers(optimizer))
        with tracker:                        # one optimizer step (or two, or a whole planning run)
            train_step(...)
        tracker.take_interval()              # StepMemory of what ran since the last call

    The mode may be entered and left many times; what it registered stays registered (parameters and optimizer
    state live across steps). Works on real and fake tensors alike.
    """

    def __init__(self, placement: Placement | None = None, *, model: nn.Module | None = None,
                 optimizers: Iterable[torch.optim.Optimizer] = (), device_alignment: int = 1,
                 fake_mode: Any = None, device_limit: int | None = None):
        super().__init__()
        # With a limit (``device_memory_limit`` on a device without an allocator that enforces one: the CPU), an op
        # or gradient that takes the device's live bytes over it raises torch.OutOfMemoryError, as a GPU would.
        self.device_limit = device_limit
        # With ``defer_limit`` (a distributed run's ``oom_recovery``: its ranks must agree before any of them stops)
        # going over the limit is only noted (:meth:`take_over_limit`), not raised.
        self.defer_limit = False
        self._over_limit: str | None = None
        self.refused_bytes = 0  # the device's live bytes when the limit was last crossed
        self.device_alignment = device_alignment  # 512 counts device storages as CUDA's caching allocator does
        # The FakeTensorMode whose tensors stand for real ones (the planner's); fake tensors of any other mode are
        # shape propagation (DTensor runs each op on fakes to infer its output's layout) and occupy no memory.
        self.fake_mode = fake_mode
        self.placement = placement or Placement("cpu")
        self.model = model
        self.optimizers = list(optimizers)
        self._records: dict[int, _Record] = {}  # id(storage) -> record, while the storage lives
        self._current = _zero()
        self._total = dict.fromkeys(LOCATIONS, 0)
        self._interval = StepMemory()
        self._in_optimizer = 0
        self._hooks: list = []
        self._orig_resize = None
        self._orig_propagate = None
        self._propagating = 0
        if model is not None:
            self.register_model(model)
        self._recategorize_optimizer_state()  # states allocated up front (on the host, when offloaded)
        for t in self.placement.host_tensors():  # moved to the host before tracking began: offloaded weights
            self.track(t, "parameters", recategorize=False)

    # ------------------------------------------------------------------------------------------ registration
    def register_model(self, model: nn.Module) -> None:
        """Count ``model``'s parameters and buffers (again after they were replaced, e.g. by FSDP2 sharding) and
        watch its gradients."""
        self.model = model
        for p in model.parameters():
            self.track(p, "parameters")
        for b in model.buffers():
            self.track(b, "buffers")
        for handle in self._hooks:
            handle.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad)
                       for p in model.parameters() if p.requires_grad]

    def remove_hooks(self) -> None:
        """Stop watching gradients: remove the post-accumulate-grad hook :meth:`register_model` put on every
        trainable parameter, which runs whether or not the mode is entered (a Python call per parameter per step).
        For a tracker that will not be entered again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def register_optimizers(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self._recategorize_optimizer_state()

    def track(self, t: torch.Tensor, category: str, *, recategorize: bool = True) -> None:
        """Count the storages behind ``t`` under ``category`` (moving them there if already counted)."""
        for part in plain_parts(t):
            storage = part.untyped_storage()
            record = self._records.get(id(storage))
            if record is not None and self.placement.distinct:
                self._relocate(record, self._where(storage, part))  # marked as host since it was counted
            if record is None:
                self._add(storage, category, part)  # where the placement says it lives (offloaded: the host)
            elif recategorize and record.category != category and record.category not in ("parameters", "buffers"):
                self._move(record, category)

    def _where(self, storage: torch.UntypedStorage, sample: torch.Tensor | None) -> str:
        placement = self.placement
        if placement.allocating_host:
            return "host"
        if sample is not None and placement.distinct and placement.on_host(sample):
            return "host"
        return "device"

    def _add(self, storage: torch.UntypedStorage, category: str, sample: torch.Tensor | None = None) -> None:
        record = _Record()
        record.category = category
        record.where = self._where(storage, sample)
        record.nbytes = self._size(storage, record.where)
        key = id(storage)
        records, current, total = self._records, self._current, self._total

        def freed(_ref, key=key, record=record):
            if records.get(key) is record:
                del records[key]
                current[record.where][record.category] -= record.nbytes
                total[record.where] -= record.nbytes
                if _EVENT_LOGS:
                    _log_device("free", record, 0)

        record.ref = weakref.ref(storage, freed)
        records[key] = record
        current[record.where][category] += record.nbytes
        total[record.where] += record.nbytes
        if _EVENT_LOGS:
            _log_device("alloc", record, record.nbytes, self.placement.allocating_on_side_stream)

    def _size(self, storage: torch.UntypedStorage, where: str) -> int:
        nbytes = storage.nbytes()
        align = self.device_alignment if where == "device" else 1
        return -(-nbytes // align) * align

    def _relocate(self, record: _Record, where: str) -> None:
        if where == record.where:
            return
        if _EVENT_LOGS:
            _log_device("free", record, 0)
        self._current[record.where][record.category] -= record.nbytes
        self._total[record.where] -= record.nbytes
        record.where = where
        self._current[where][record.category] += record.nbytes
        self._total[where] += record.nbytes
        if _EVENT_LOGS:
            _log_device("alloc", record, record.nbytes, self.placement.allocating_on_side_stream)

    def _move(self, record: _Record, category: str) -> None:
        self._current[record.where][record.category] -= record.nbytes
        record.category = category
        self._current[record.where][category] += record.nbytes

    def _resized(self, storage: torch.UntypedStorage) -> None:
        record = self._records.get(id(storage))
        if record is None:
            return
        delta = self._size(storage, record.where) - record.nbytes
        record.nbytes += delta
        if delta and _EVENT_LOGS:
            _log_device("resize", record, record.nbytes, self.placement.allocating_on_side_stream)
        self._current[record.where][record.category] += delta
        self._total[record.where] += delta
        self._update_peaks()

    # ---------------------------------------------------------------------------------------------- events
    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.track(param.grad, "gradients")
            self._update_peaks()
            self._check_limit()

    def _check_limit(self) -> None:
        limit, held = self.device_limit, self._total["device"]
        if limit is not None and held > limit:
            message = (f"device_memory_limit: the run's tensors on the device reached {format_bytes(held)}, over the "
                       f"limit of {format_bytes(limit)}")
            self.refused_bytes = max(self.refused_bytes, held) if self._over_limit else held
            if not self.defer_limit:
                raise torch.OutOfMemoryError(message)
            self._over_limit = self._over_limit or message

    def take_over_limit(self) -> str | None:
        """With ``defer_limit``: the first over-limit message since the last call (None: the limit held)."""
        over, self._over_limit = self._over_limit, None
        return over

    def _recategorize_optimizer_state(self) -> None:
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        self.track(value, "optimizer_state")

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        self._in_optimizer += 1

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        self._in_optimizer -= 1
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.track(value, "optimizer_state")

    def _update_peaks(self) -> None:
        interval = self._interval
        for where in LOCATIONS:
            current = self._current[where]
            if self._total[where] > interval.peak[where]:
                interval.peak[where] = self._total[where]
                interval.at_peak[where] = dict(current)
            category_peak = interval.category_peak[where]
            for category, value in current.items():
                if value > category_peak[category]:
                    category_peak[category] = value

    # ---------------------------------------------------------------------------------------------- queries
    def category_now(self) -> str:
        """The category of a storage an op makes now: ``temporaries`` in backward and in the optimizer step,
        else ``activations``."""
        if self._in_optimizer or torch._C._current_graph_task_id() != -1:
            return "temporaries"
        return "activations"

    def current(self) -> dict[str, dict[str, int]]:
        """Live bytes now, ``{where: {category: bytes}}``."""
        return copy.deepcopy(self._current)

    def take_interval(self) -> StepMemory:
        """The peaks since the last call (or since tracking began); starts a new interval at the current totals."""
        interval = self._interval
        self._interval = StepMemory()
        self._update_peaks()
        return interval

    # -------------------------------------------------------------------------------------------- the mode
    def __enter__(self):
        self._optimizer_hooks = [register_optimizer_step_pre_hook(self._optimizer_pre),
                                 register_optimizer_step_post_hook(self._optimizer_post)]
        self._orig_resize = torch.UntypedStorage.resize_
        orig, tracker = self._orig_resize, self

        def resize_(storage, size):  # FSDP2 frees and refills its all-gather buffers this way; no op sees it
            result = orig(storage, size)
            tracker._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        self._orig_propagate = getattr(ShardingPropagator, _PROPAGATE, None) if ShardingPropagator else None
        if self._orig_propagate is not None:
            orig_propagate = self._orig_propagate

            def propagate(propagator, op_schema):  # DTensor's layout inference, on fake tensors: no memory
                tracker._propagating += 1
                try:
                    return orig_propagate(propagator, op_schema)
                finally:
                    tracker._propagating -= 1

            setattr(ShardingPropagator, _PROPAGATE, propagate)
        self._recategorize_optimizer_state()  # and relocate states marked as host since the last step
        self._update_peaks()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.UntypedStorage.resize_ = self._orig_resize
            if self._orig_propagate is not None:
                setattr(ShardingPropagator, _PROPAGATE, self._orig_propagate)
            for handle in self._optimizer_hooks:
                handle.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor is not None and DTensor in types:
            return NotImplemented  # let DTensor run its local ops, which this mode then sees
        if func is _DEVICE:  # a tensor's .device (the autograd engine asks it of every gradient): no storage
            tensor = args[0]
            if type(tensor) is FakeTensor and not tensor.fake_mode.in_kernel_invocation:
                return tensor.fake_device  # FakeTensor's own answer, without two more dispatches to reach it
            return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self._propagating:
            return out
        category = self.category_now()
        if isinstance(out, torch.Tensor):  # most ops: one tensor, or a tuple of them (no pytree walk)
            self._register_output(out, category)
        elif type(out) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in out):
            for t in out:
                self._register_output(t, category)
        else:
            tree_map_only(torch.Tensor, lambda t: self._register_output(t, category), out)
        self._update_peaks()
        self._check_limit()
        return out

    def _register_output(self, t: torch.Tensor, category: str) -> None:
        # a fake tensor holds its own bytes (no inner parts): skip plain_parts' generator for the planner's ops
        for part in (t,) if type(t) is FakeTensor else plain_parts(t):
            if isinstance(part, FakeTensor) and part.fake_mode is not self.fake_mode:
                continue
            storage = part.untyped_storage()
            if id(storage) not in self._records:
                self._add(storage, category, part)

    @contextlib.contextmanager
    def paused(self):
        """Run a block untracked (its new storages are not counted)."""
        with torch.utils._python_dispatch._disable_current_modes():
            yield
