"""Activation offloading: keep the tensors autograd saves for backward in host memory instead of GPU memory.

`OffloadActivations` is a `torch.autograd.graph.saved_tensors_hooks` context that the training step enters around
forward *and* the loss (`mtune.training.session.TrainingSession.train_step`). While it is active, every tensor
autograd saves is copied to host memory (pinned, so the copy is asynchronous) and copied back when backward needs
it. With `use_streams=True` both copies run on a side CUDA stream, so they overlap with compute; the allocator is
told (`record_stream`) which stream still uses each buffer. Where the host is and whether a move copies anything
is the run's `Placement` (`mtune.training.placement`).

Not offloaded: parameters and other tensors that share a parameter's storage (they stay in memory anyway), tensor
subclasses such as NF4 weights, tensors smaller than `min_offload_bytes` (the copy would cost more than it frees),
and tensors already in host memory. Combined with activation checkpointing (required by mtune's validator), what
is saved per block is just the block's input, so offloading moves one [batch, seq, dim] tensor per block.

On a machine without an accelerator everything already lives in host memory: the hooks run, move nothing, and
results are identical; `apply_activation_offloading` says so once in the log. A placement with ``distinct=True``
makes the copies happen on CPU too (tests).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from mtune.training.placement import Placement, storage_key

__all__ = ["OffloadActivations", "NoOffload", "apply_activation_offloading"]

log = logging.getLogger(__name__)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: saved activations go to host memory during forward and come back during backward.

    Args:
        use_streams: copy on a side CUDA stream so transfers overlap compute (CUDA only; ignored elsewhere).
        placement: the compute device and the host; default `Placement.default()` (the accelerator and the CPU).
        min_offload_bytes: tensors smaller than this stay where they are. Default 1 MiB.
        params: parameters never to offload (their storages are recognised); default none.
        model: its parameters are never offloaded either, read each time the context is entered (a model set up
            on the meta device gets its real parameters later).
    """

    def __init__(self, use_streams: bool = True, min_offload_bytes: int = 1 << 20, params=(),
                 model: nn.Module | None = None, placement: Placement | None = None):
        self.placement = placement or Placement.default()
        self.min_offload_bytes = min_offload_bytes
        self.use_streams = use_streams and self.placement.streams
        self.streams_asked = use_streams and self.placement.distinct  # as on CUDA, where planned or tested
        self.stream = torch.cuda.Stream() if self.use_streams else None
        self.model = model
        self._param_storages = {storage_key(p) for p in params if not p.is_meta}
        self.offloaded_bytes = 0  # bytes moved to the host in the last forward(s); for logs and tests
        self._copies: dict[int, tuple] = {}  # id(device tensor) -> (weakref to it, its host copy), while it lives
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        if self.model is not None:
            # By storage identity: a weight offloaded by weight_offloading has an empty storage (and no address) now,
            # and fake tensors (the planner's) have no address at all.
            self._param_storages = {storage_key(p) for p in self.model.parameters() if not p.is_meta}
        return super().__enter__()

    def _should_offload(self, t: torch.Tensor) -> bool:
        return (
            not isinstance(t, nn.Parameter) and not is_traceable_wrapper_subclass(t)  # not NF4; fake tensors ok
            and self.placement.distinct
            and not self.placement.on_host(t)
            and t.numel() * t.element_size() >= self.min_offload_bytes
            and storage_key(t) not in self._param_storages
        )

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._should_offload(t):
            return t
        # One tensor saved by several ops (log_softmax's output, by it and by nll_loss) is copied once.
        seen = self._copies.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1]
        packed = self._copy_to_host(t)
        self._copies[id(t)] = (weakref.ref(t, lambda _, key=id(t): self._copies.pop(key, None)), packed)
        return packed

    def _copy_to_host(self, t: torch.Tensor) -> Any:
        self.offloaded_bytes += t.numel() * t.element_size()
        if self.stream is None:
            return (t.device, self.placement.to_host(t))
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host = self.placement.empty_host(t.shape, t.dtype)
            host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # t's memory may be reused only after the copy finished
        event = self.stream.record_event()
        return (t.device, host, event)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if len(packed) == 2:
            _, host = packed
            # in line; a CUDA run with use_streams copies back on the side stream, from its pool: planned alike
            with self.placement.side_stream(None) if self.streams_asked else contextlib.nullcontext():
                return self.placement.to_compute(host)
        device, host, event = packed
        with self.placement.side_stream(self.stream):
            self.stream.wait_event(event)
            t = host.to(device, non_blocking=True)
        compute = torch.cuda.current_stream()
        compute.wait_stream(self.stream)
        t.record_stream(compute)
        return t


class NoOffload(torch.autograd.graph.saved_tensors_hooks):
    """Inner context that keeps saved tensors in place (used for the final norm and output projection, whose
    activations backward needs first)."""

    def __init__(self):
        super().__init__(lambda t: t, lambda t: t)


def _keep_saved_tensors_in_place(module: nn.Module) -> None:
    no_offload = NoOffload()
    module.register_forward_pre_hook(lambda m, args: no_offload.__enter__())
    module.register_forward_hook(lambda m, args, out: no_offload.__exit__(None, None, None), always_call=True)


def apply_activation_offloading(
    model: nn.Module, use_streams: bool = True, min_offload_bytes: int = 1 << 20, placement: Placement | None = None,
    blocks: int | None = None,
) -> OffloadActivations:
    """The `OffloadActivations` context for `model`; enter it around forward and backward. Inside `model.norm` and
    `model.lm_head` saved tensors stay in place (forward hooks installed here, in place): they run last in forward
    and first in backward, so offloading them would only add copies. ``blocks``: only the first ``blocks`` of
    ``model.layers`` offload what they save (a checkpointed block: its input), the later ones keep it in place too;
    None: every block. The first ones go because their inputs wait longest for backward."""
    placement = placement or Placement.default()
    if not placement.distinct:
        log.info("activation offloading: the model computes in host memory (%s): it saves nothing", placement.compute)
    for name in ("norm", "lm_head"):
        module = getattr(model, name, None)
        if module is not None:
            _keep_saved_tensors_in_place(module)
    if blocks is not None:
        for block in list(model.layers)[blocks:]:
            _keep_saved_tensors_in_place(block)
    return OffloadActivations(use_streams=use_streams, min_offload_bytes=min_offload_bytes, model=model,
                              placement=placement)
