"""One forward and backward of a model, the bit-exact comparison the memory-technique tests make of two, and the
bytes autograd saves for backward."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtune.modules.loss import CrossEntropyLoss


def loss_and_grads(model, tokens, labels, context=None, seed=None):
    """``(summed loss, {name: grad})`` of one forward and backward of ``model`` on ``tokens`` -> ``labels``, run
    inside ``context`` (around forward and backward, as the session enters an activation context). ``seed`` seeds
    torch first (the same dropout masks on both sides of a comparison)."""
    if seed is not None:
        torch.manual_seed(seed)
    with context if context is not None else contextlib.nullcontext():
        loss_sum, n = CrossEntropyLoss()(model(tokens), labels)
        (loss_sum / n).backward()
    return loss_sum.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def assert_identical(a, b):
    """Two :func:`loss_and_grads` results are equal bit for bit."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)


def assert_close(a, b, tol=1e-5):
    """Two :func:`loss_and_grads` results agree to ``tol``: the loss relatively, every gradient element absolutely
    (compiled against eager, whose kernels round differently)."""
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert abs(loss_a.item() - loss_b.item()) <= tol * loss_a.abs().item()
    for k, g in grads_a.items():
        if g is not None:
            assert (g - grads_b[k]).abs().max().item() <= tol, k


class LargestTensor(TorchDispatchMode):
    """The largest element count of any tensor an op returns while the mode is entered (``largest``): the long-
    context tests check that no step makes a tensor of s² elements."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def apply_memory_techniques(model, memory=None, lora=None, placement=None):
    """The model phase of ``memory``'s techniques on ``model`` (`mtune.training.memory.phases.prepare_model`), with a
    ``lora`` node given beside it and the machine's default placement; returns the step context or None."""
    from mtune.training.memory import phases
    from mtune.training.memory.registry import MemoryConfig
    from mtune.training.placement import Placement

    memory = memory if memory is not None else MemoryConfig()
    if lora is not None:
        memory = memory.replace(lora=lora)
    return phases.prepare_model(model, memory, placement or Placement.default())
