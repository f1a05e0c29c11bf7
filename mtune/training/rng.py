"""Random number generator state: seed every generator, capture them all, restore them all.

Covers Python's ``random``, numpy's global generator (when numpy is installed), torch's CPU generator and every
CUDA device's generator (when CUDA is available). The captured state holds only tuples, ints, lists and tensors, so
it loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

__all__ = ["set_seed", "get_rng_state", "set_rng_state"]

log = logging.getLogger(__name__)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def set_seed(seed: int) -> None:
    """Seed Python, numpy, torch CPU and all CUDA devices with ``seed`` (the same on every rank, so weights that
    are initialised on each rank agree; the data loader gives ranks different samples)."""
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def get_rng_state() -> dict[str, Any]:
    """Every generator's state: ``{"python": ..., "numpy": ... | None, "torch_cpu": ByteTensor,
    "torch_cuda": [ByteTensor per device] | None}``."""
    np = _numpy()
    numpy_state = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        numpy_state = (kind, keys.tolist(), int(pos), int(has_gauss), float(cached))
    return {
        "python": random.getstate(),
        "numpy": numpy_state,
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned. A state saved with a different number of CUDA devices
    restores the devices both have, with a warning."""
    random.setstate(_as_python_state(state["python"]))
    np = _numpy()
    if np is not None and state.get("numpy") is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda")
    if cuda_states and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if len(cuda_states) != count:
            log.warning("RNG state was saved with %d CUDA devices, restoring onto %d: only the first %d match",
                        len(cuda_states), count, min(count, len(cuda_states)))
        for device, device_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(device_state, device)


def _as_python_state(state: Any) -> tuple:
    # torch.save/load may turn the inner tuple into a list; random.setstate wants tuples.
    version, internal, gauss_next = state
    return (version, tuple(internal), gauss_next)
