"""Allocation replay: while a plan runs, a function whose allocations follow from its arguments' metadata alone
runs its ops once per metadata; later calls replay the byte totals it left after each op and make only its output.

A QLoRA plan dequantizes every frozen NF4 weight in forward, in backward and in each recomputation (torchao's
``NF4Tensor.get_original_weight``: about twenty ops through the NF4 subclass's ``__torch_function__``, the fake
mode and the byte tracker, for a tensor whose values a plan never reads): a fifth of the CPU time of an 8B QLoRA
``--fit --maximize``. On fake tensors those ops allocate the same storages in the same order whenever the weight's
metadata is the same, so their first run is recorded (the tracker's device and host totals after each op, relative
to the call's start, and the op that made the output) and the later ones replay it: the totals step through the
same values with a peak update after each, the output is made by one ``empty_strided`` at the op that made it, and
the transient bytes are dropped at the end, as the function's locals are when it returns. The peaks, what was live
at them and every category's peak come out exactly as if the ops had run (``tests/mtune/training/planning/
test_replay.py`` plans with and without it).

Recorded only where that holds: every storage the call makes is counted under the category the call runs in (one
category: an op's category follows from where the step is, which one call does not change), it frees no storage it
did not make, and its output owns its whole storage (no view into a larger one) and was made by the call. A call
that breaks any of these runs as it is, every time; so does every call while a log of the device's storages is
recorded (`tracker.device_events`), which replayed totals would not reach.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from mtune.modules import nf4_dequantize
from mtune.modules.nf4_linear import nf4_tensor_class
from mtune.training.planning.tracker import LOCATIONS, TensorTracker, recording_device_events

__all__ = ["AllocationReplay", "fused_nf4_dequantization", "replayed_nf4_dequantization"]


@dataclass(frozen=True)
class _Trace:
    totals: tuple[tuple[int, ...], ...]  # per op, the live bytes per location above the call's start
    made_at: int  # the op that made the output
    output: tuple[int, ...]  # the output's bytes per location
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


class AllocationReplay:
    """Records and replays calls under ``tracker`` (see the module docstring), one trace per key."""

    def __init__(self, tracker: TensorTracker):
        self.tracker = tracker
        self.traces: dict[Hashable, _Trace | None] = {}  # None: the call cannot be replayed
        self.replayed = 0

    def tracking(self) -> bool:
        """Whether the tracker counts the ops run now (entered, not paused, not inside DTensor's inference)."""
        return self.tracker in _get_current_dispatch_mode_stack() and not self.tracker._propagating

    def __call__(self, key: Hashable, fn: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
        """``fn()``, whose allocations ``key`` determines: run and recorded the first time, replayed after."""
        if key not in self.traces:
            out, self.traces[key] = self._record(fn)
            return out
        trace = self.traces[key]
        if trace is None or recording_device_events():  # a log of device storages needs them made
            return fn()
        self.replayed += 1
        return self._replay(trace, device)

    def _record(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, _Trace | None]:
        tracker = self.tracker
        start, category = dict(tracker._total), tracker.category_now()
        records = tracker._records
        before = dict(records)  # the storages live before the call (held, so no record id is reused)
        totals, last_made = [], []
        update_peaks = tracker._update_peaks

        def observed() -> None:  # after every op of the call: its totals, and the storage registered last
            update_peaks()
            totals.append(tuple(tracker._total[w] - start[w] for w in LOCATIONS))
            last_made.append(records[next(reversed(records))] if records else None)

        tracker._update_peaks = observed  # on this instance, for this call only
        try:
            out = fn()
        finally:
            del tracker._update_peaks
        record = records.get(id(out.untyped_storage()))
        made_at = next((i for i, r in enumerate(last_made) if r is record), None)
        owns = (out.storage_offset() == 0 and out.untyped_storage().nbytes()
                == _needed_bytes(out.shape, out.stride(), out.dtype))
        made = {id(r): r for r in last_made if r is not None and before.get(id(r)) is not r}
        kept = all(records.get(key) is r for key, r in before.items())  # the call freed nothing it did not make
        if (record is None or made_at is None or not owns or not kept
                or any(r.category != category for r in made.values())):
            return out, None
        output = tuple(record.nbytes if w == record.where else 0 for w in LOCATIONS)
        return out, _Trace(tuple(totals), made_at, output, tuple(out.shape), out.stride(), out.dtype)

    def _replay(self, trace: _Trace, device: torch.device) -> torch.Tensor:
        tracker = self.tracker
        category, current, total = tracker.category_now(), tracker._current, tracker._total
        held = dict.fromkeys(LOCATIONS, 0)  # the replayed transient bytes now counted

        def hold(values) -> None:
            for where, value in zip(LOCATIONS, values):
                change, held[where] = value - held[where], value
                current[where][category] += change
                total[where] += change

        out = None
        for i, after in enumerate(trace.totals):
            made = trace.output if out is not None or i == trace.made_at else (0,) * len(LOCATIONS)
            hold(a - m for a, m in zip(after, made))
            if i == trace.made_at:  # the output's own op counts it and updates the peaks
                out = torch.empty_strided(trace.shape, trace.stride, dtype=trace.dtype, device=device)
            else:
                tracker._update_peaks()
        hold((0,) * len(LOCATIONS))  # the call's locals are freed as it returns
        return out


def _needed_bytes(shape, stride, dtype: torch.dtype) -> int:
    if any(size == 0 for size in shape):
        return 0
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride))) * dtype.itemsize


def _metadata(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes(), t.device


def fused_nf4_dequantization(target: torch.device) -> bool:
    """Whether a run on ``target`` dequantizes NF4 weights in one compiled kernel: on CUDA
    (:mod:`~mtune.modules.nf4_dequantize`; a ``compile: true`` run fuses it into its blocks alike)."""
    return target.type == "cuda" and nf4_dequantize.COMPILED_ON_CUDA


@contextlib.contextmanager
def replayed_nf4_dequantization(tracker: TensorTracker, fused: bool = False):
    """While the block runs, NF4 dequantization of the planner's fake weights under ``tracker`` is replayed (see
    the module docstring); a real weight, or one dequantized where the tracker is not counting, runs as it is.
    ``fused``: the target decodes the codes in one compiled kernel (CUDA: :mod:`~mtune.modules.nf4_dequantize`),
    so a dequantization makes the block scales (one value per block, in the weight's dtype) and, beside them, its
    result, and nothing else.
    Yields the `AllocationReplay` (its ``replayed`` count)."""
    nf4 = nf4_tensor_class()
    replay = AllocationReplay(tracker)
    if nf4 is None:  # no NF4 weight was made in this process: nothing to replay
        yield replay
        return
    original = nf4.get_original_weight

    def get_original_weight(weight):
        data = weight.quantized_data
        if not (type(data) is FakeTensor and data.fake_mode is tracker.fake_mode and replay.tracking()):
            return original(weight)
        if fused:
            made = [torch.empty(weight.numel() // weight.block_size, dtype=weight.dtype, device=data.device)]
            made.append(torch.empty(weight.shape, dtype=weight.dtype, device=data.device))  # beside the scales
            return made[1]  # the scales are freed as the dequantization returns
        names, context = weight.__tensor_flatten__()
        key = (tuple(weight.shape), weight.stride(), weight.dtype, context["block_size"], context["n_blocks"],
               context["scaler_block_size"], tracker.placement.allocating_host,
               *(_metadata(getattr(weight, name)) for name in names))
        return replay(key, lambda: original(weight), data.device)

    nf4.get_original_weight = get_original_weight
    try:
        with nf4_dequantize.planning_decodes_alone(fused):  # what the run's code then does (ExpertLinear.stacked)
            yield replay
    finally:
        nf4.get_original_weight = original
