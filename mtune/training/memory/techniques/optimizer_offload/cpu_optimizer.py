"""Optimizer-state offload (``optimizer_offload: cpu``), ZeRO-Offload style: the optimizer lives in host memory.

The model's trainable parameters stay on the compute device, where forward and backward run. The optimizer keeps
its own copy of each of them in host memory (same dtype, so the step computes exactly what the plain optimizer
computes) together with its states (AdamW's two moments: 8 bytes per fp32 element, usually the largest item of a
full fine-tune). During backward, as soon as a parameter's gradient is complete
(``register_post_accumulate_grad_hook``) it is copied into a host buffer and the device copy is dropped, so no full
set of gradients ever exists on the device. When backward ends, the host gradients are complete; clipping reads
them there (``param_groups`` holds the host copies); ``step()`` runs the optimizer on the CPU (vectorised: torch's
foreach or fused CPU AdamW) and copies the updated values back into the device parameters.

Gradient accumulation: the first micro-batch's gradient lands in the host buffer, each later one in a staging
buffer that is added to it, in the same order the device would have added them (so results are bit-identical).

On CUDA the device-to-host copies run on a side stream into pinned buffers, overlapping the rest of backward; the
allocator is told (``record_stream``) that the stream still reads each gradient, and backward's end waits for the
stream. On a machine without an accelerator there is nothing to offload: :func:`build_offloaded_optimizer` returns
the plain optimizer and says so once. ``Placement("cpu", distinct=True)`` runs the real copies on CPU (tests).

torchao's ``CPUOffloadOptimizer`` does the same on CUDA/XPU but refuses to run elsewhere; this one runs wherever a
:class:`~mtune.training.placement.Placement` can copy, so the flag is tested on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mtune.training.placement import Placement

__all__ = ["CPUOffloadOptimizer"]

log = logging.getLogger(__name__)


class CPUOffloadOptimizer(torch.optim.Optimizer):
    """An optimizer stepped in host memory for parameters that live on the compute device.

    Args:
        named_params: ``(name, parameter)`` of the trainable parameters (on ``placement.compute``).
        optimizer_cls: the optimizer class run on the host copies (e.g. ``torch.optim.AdamW``).
        placement: the compute device and the host; must be distinct (a placement where moves copy).
        kwargs: the optimizer's keyword arguments (``lr``, ``foreach`` ...), for a CPU step.

    ``param_groups`` and ``state`` are the host optimizer's own, so LR schedulers, gradient clipping, checkpoints
    and state accounting see host tensors; ``state_dict()`` has the plain optimizer's layout.
    """

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], optimizer_cls: Callable,
                 placement: Placement, **kwargs: Any):
        named_params = list(named_params)
        if not placement.distinct:
            raise ValueError(f"{placement}: nothing to offload to; use the optimizer itself")
        self.placement = placement
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        with torch.no_grad():
            self.host_params = [placement.to_host(p.detach()) for p in self.params]
        self.optimizer = optimizer_cls(self.host_params, **kwargs)
        super().__init__(self.host_params, dict(lr=kwargs.get("lr", 0.0)))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.stream = torch.cuda.Stream() if placement.streams else None
        self._grads: list[torch.Tensor | None] = [None] * len(self.params)  # host gradient buffers, kept
        self._staging: list[torch.Tensor | None] = [None] * len(self.params)  # later micro-batches land here
        self._has_grad = [False] * len(self.params)  # the host buffer holds this step's gradient
        self._unfolded: set[int] = set()  # staging buffers not yet added to their host gradient
        self._in_backward = False
        self._copied_back: torch.cuda.Event | None = None  # the last host->device parameter copies
        self.moved_gradient_bytes = 0  # bytes of gradients copied to the host (logs and tests)
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ------------------------------------------------------------------------------------------ backward
    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._gradient_ready(i, param)

        return hook

    def _gradient_ready(self, i: int, param: torch.Tensor) -> None:
        """Move ``param``'s complete gradient into host memory and drop the device copy."""
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        if self._has_grad[i]:  # a later micro-batch: stage it, add it when the copy is done
            self._fold(i)  # the staging buffer of the micro-batch before must be added first
            target = self._staging[i] = self._buffer(self._staging[i], grad)
            self._unfolded.add(i)
        else:
            target = self._grads[i] = self._buffer(self._grads[i], grad)
            self._has_grad[i] = True
            self.host_params[i].grad = target
        self._copy_to_host(target, grad)
        self.moved_gradient_bytes += grad.numel() * grad.element_size()

    def _buffer(self, existing: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        if existing is None:
            existing = self.placement.empty_host(like.shape, like.dtype)
        return existing

    def _copy_to_host(self, host: torch.Tensor, grad: torch.Tensor) -> None:
        if self.stream is None:
            host.copy_(grad)
            return
        self.stream.wait_stream(torch.cuda.current_stream())  # the gradient is computed on the current stream
        with torch.cuda.stream(self.stream):
            host.copy_(grad, non_blocking=True)
        grad.record_stream(self.stream)  # its memory is reused only after the copy has read it

    def _wait_for_copies(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _fold(self, i: int) -> None:
        if i in self._unfolded:
            self._wait_for_copies()
            self._grads[i].add_(self._staging[i])
            self._unfolded.discard(i)

    def _backward_done(self) -> None:
        """End of backward: every gradient is in host memory and complete."""
        self._in_backward = False
        self._wait_for_copies()
        for i in sorted(self._unfolded):
            self._fold(i)

    # ---------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None) -> None:
        """The optimizer step on the host copies, then the updated values into the device parameters."""
        if closure is not None:
            raise ValueError("CPUOffloadOptimizer.step takes no closure")
        self._backward_done()  # no-op after a backward; makes a step without one safe
        if self._copied_back is not None:
            self._copied_back.synchronize()  # the last copies still read the host values we are about to change
        with self.placement.host_allocation():  # the step's states and temporaries are host memory
            self.optimizer.step()
        self.mark_states()
        for param, host in zip(self.params, self.host_params):
            param.copy_(host, non_blocking=self.placement.pinned)
        self._copied_back = torch.cuda.Event() if self.placement.pinned and self.placement.streams else None
        if self._copied_back is not None:
            self._copied_back.record()

    def mark_states(self) -> None:
        """Tell the placement that the states the optimizer created (next to the host copies) are host memory:
        they are on the host device already, but where both are ``cpu`` only a mark tells them apart."""
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.placement.mark_host(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (the host buffers are kept for the next step)."""
        for i, host in enumerate(self.host_params):
            host.grad = None
            self._has_grad[i] = False
            self.params[i].grad = None
        self._unfolded.clear()

    # ---------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the plain optimizer's state; the host copies are refreshed from the device parameters (a resumed
        run has just loaded its weights into those)."""
        self.optimizer.load_state_dict(state_dict)
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.mark_states()
        for param, host in zip(self.params, self.host_params):
            host.copy_(param)

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()


def offloaded_optimizer(spec: Any, named_params: list, target: str, placement: Placement) -> CPUOffloadOptimizer | None:
    """The config's optimizer (``spec``: `mtune.training.optimizers.OptimizerSpec`) stepped in host memory, its
    AdamW states allocated there from the start; None when the model already computes in host memory (nothing
    would move: the plain optimizer runs)."""
    if not placement.distinct:
        log.info("optimizer_offload=%s: the model already computes in host memory (%s): the optimizer runs "
                 "unchanged, nothing is moved", target, placement.compute)
        return None
    kwargs = spec.kwargs_for(placement.host)  # the step runs on the host
    log.info("optimizer_offload=%s: %s states in %s memory, stepped there", target, spec.component, placement.host)
    offloaded = CPUOffloadOptimizer(named_params, spec.cls, placement, **kwargs)
    if type(offloaded.optimizer) is torch.optim.AdamW:
        with placement.host_allocation():  # the states live on the host from the start, beside the copies
            spec.allocate(offloaded.optimizer)
        offloaded.mark_states()
    return offloaded
