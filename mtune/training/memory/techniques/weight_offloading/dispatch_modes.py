"""Weight offloading's copies beside selective (op-level) activation checkpointing.

``selective_op`` (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) counts, with two dispatch modes,
every op a checkpointed block runs in forward and requires its recomputation to run the same ones in the same order.
The offloader copies weights in at other points in recomputation than in forward (``leaf_level``: every leaf but the
last, still there from forward; with ``use_streams`` the prefetch runs the other way), so its copies run with those
modes set aside; the modes below them (the byte tracker's) stay: it sees the storages grow through ``resize_``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

__all__ = ["outside_selective_checkpointing"]

try:  # torch's own (private) names for the two modes (torch 2.4 on)
    from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
except ImportError:  # pragma: no cover - a torch that renamed them: the copies are counted (the test fails there)
    _SELECTIVE_MODES: tuple[type, ...] = ()
else:
    _SELECTIVE_MODES = (_CachingTorchDispatchMode, _CachedTorchDispatchMode)


@contextlib.contextmanager
def outside_selective_checkpointing() -> Iterator[None]:
    """Inside: the dispatch modes from the top of the stack down to selective checkpointing's, set aside."""
    popped = []
    while _SELECTIVE_MODES and any(isinstance(mode, _SELECTIVE_MODES) for mode in _get_current_dispatch_mode_stack()):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)
