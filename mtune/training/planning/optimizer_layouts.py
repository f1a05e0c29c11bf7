"""Stand-ins for optimizers that cannot step on fake tensors, for ``mtune plan``: each creates, on its first step,
exactly the state tensors its real counterpart creates (shapes and dtypes from the library's documented layout)
and changes no parameter. ``tests/mtune/training/memory/test_plan.py`` checks each against a real step.

bitsandbytes (0.4x-0.50) Adam-family optimizers, per parameter ``p``:

- 8-bit (``AdamW8bit``, ``PagedAdamW8bit``): when ``p.numel() >= min_8bit_size`` (default 4096): ``state1`` and
  ``state2`` uint8 of ``p``'s shape, ``absmax1`` / ``absmax2`` fp32 of ``ceil(numel / 256)`` (one scale per block
  of 256), and ``qmap1`` / ``qmap2``: 256-entry fp32 code tables (the signed and the unsigned dynamic map), each
  one tensor shared by every parameter of the optimizer.
  Smaller parameters get 32-bit states.
- 32-bit (``PagedAdamW``, and the small parameters above): ``state1`` and ``state2`` fp32 of ``p``'s shape.

The paged variants keep their states in CUDA managed (unified) memory, which the caching allocator never sees
and the driver pages between the GPU and the host. For a CUDA target the planner sets :attr:`managed` to the run's
placement: the stand-in then creates its states as host storages (counted under ``host``), and the plan reports
them as managed bytes beside the allocator's peak (`mtune.training.planning.memory_plan.MemoryPlan.managed_bytes`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["LAYOUT_STANDINS", "BnbAdamLayout", "Bnb8bitAdamLayout"]

_BLOCK = 256  # bitsandbytes' 8-bit optimizer states: one fp32 absmax per 256 values (``blocksize = 256`` in
# bitsandbytes/optim/optimizer.py's Optimizer2State.init_state); benchmarks/results/README.md


class BnbAdamLayout(torch.optim.Optimizer):
    """bitsandbytes' 32-bit Adam-family state: ``state1``, ``state2`` fp32 per parameter."""

    eight_bit = False

    def __init__(self, params, lr: float = 1e-3, min_8bit_size: int = 4096, **kwargs):
        super().__init__(params, dict(lr=lr, **kwargs))
        self.min_8bit_size = min_8bit_size
        self._qmaps: dict[int, torch.Tensor] = {}
        self.managed = None  # a Placement: states live in managed memory, outside the device's allocator

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    if self.managed is None:
                        self._init_state(p, state)
                    else:
                        with self.managed.host_allocation():
                            self._init_state(p, state)
                        for value in state.values():
                            if isinstance(value, torch.Tensor):
                                self.managed.mark_host(value)
                state["step"] += 1
        return None

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        if self.eight_bit and p.numel() >= self.min_8bit_size:
            blocks = math.ceil(p.numel() / _BLOCK)
            for i in (1, 2):
                if i not in self._qmaps:
                    self._qmaps[i] = torch.zeros(256, dtype=torch.float32, device=p.device)
                state[f"state{i}"] = torch.zeros_like(p, dtype=torch.uint8)
                state[f"qmap{i}"] = self._qmaps[i]
                state[f"absmax{i}"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        else:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)


class Bnb8bitAdamLayout(BnbAdamLayout):
    """bitsandbytes' blockwise 8-bit Adam-family state (see the module docstring)."""

    eight_bit = True


LAYOUT_STANDINS = {
    "bitsandbytes.optim.AdamW8bit": "mtune.training.planning.optimizer_layouts.Bnb8bitAdamLayout",
    "bitsandbytes.optim.PagedAdamW8bit": "mtune.training.planning.optimizer_layouts.Bnb8bitAdamLayout",
    "bitsandbytes.optim.PagedAdamW": "mtune.training.planning.optimizer_layouts.BnbAdamLayout",
}
"""``_component_`` -> the stand-in the planner builds instead (same keyword arguments)."""
