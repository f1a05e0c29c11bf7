"""What ``mtune plan`` predicts (:class:`MemoryPlan`: the peaks, each category's share, whether it fits, as a
table, JSON and a chart)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from mtune.errors import MtuneError
from mtune.training.observe.plots import plot_memory_plan
from mtune.training.planning.tracker import CATEGORIES
from mtune.units import MIB, format_bytes

__all__ = ["MemoryPlan", "PlanError", "CUDA_CONTEXT_BYTES", "CUDA_BLOCK_BYTES"]

CUDA_BLOCK_BYTES = 512
"""The caching allocator rounds every request up to a multiple of 512 bytes; ``max_memory_allocated`` counts that.
Cited: ``kMinBlockSize = 512`` in PyTorch's ``c10/cuda/CUDACachingAllocator.cpp`` ("all sizes are rounded to at
least 512 bytes"); benchmarks/results/README.md."""
CUDA_CONTEXT_BYTES = 751 * MIB
"""What a CUDA process holds on the GPU outside the caching allocator (the context, the kernels it loads, the
cuBLAS/cuDNN handles): measured, 0.733 GiB rounded up to a MiB. It is the median of ``device_used_gib`` -
``max_reserved_gib`` over the GPU suite's rows that keep nothing outside the allocator (no managed or offloaded
memory): 0.733 to 0.753 GiB on every such row but one, one H100 with CUDA 13 and torch 2.11, 2026-11-26 and 27
(``cuda_context_gib`` in ``benchmarks/results/derived_gpu_suite.json``); the row on flash-linear-attention's
Triton kernels held 1.03 GiB, the kernels it compiled and loaded included. Other drivers, CUDA versions and cards
differ somewhat (CUDA's lazy loading, the default since 12.2, loads kernels as they are first used). Added to the
whole-GPU figure and subtracted from a ``--fit`` budget; ``max_memory_allocated`` does not see it. Until that
measurement it was a stated 0.5 GiB."""


class PlanError(MtuneError, RuntimeError):
    """The planner cannot plan this config (it names the key and what to do)."""


@dataclass
class MemoryPlan:
    """A plan: the predicted peaks (bytes) and what makes them up. ``device`` / ``host``: each category's own peak;
    ``at_peak``: what is live at the instant of each location's peak."""

    target: str
    world_size: int
    device_peak_bytes: int
    host_peak_bytes: int
    device: dict[str, int]
    host: dict[str, int]
    at_peak: dict[str, dict[str, int]]
    batch: dict[str, int]
    parameters: dict[str, int]
    predicts: str
    cuda_context_bytes: int = 0
    device_memory: int | None = None
    host_memory: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    managed_bytes: int = 0
    """Optimizer states in CUDA managed memory (paged optimizers): outside the caching allocator, so not in
    ``device_peak_bytes``; counted in ``host_peak_bytes`` (where the driver pages them under pressure)."""
    estimated: str = ""
    """How the figures were obtained when not by one whole plan (``--fit``'s extrapolation), else empty."""
    lower_bound: bool = False
    """The figures are a lower bound (``--fit``: a shortened model already over the budget), not an estimate."""

    def managed_resident_bytes(self) -> int:
        """Managed bytes that stay on the device: as many as fit beside the allocator's peak and the context in
        ``device_memory`` (all of them when no budget is given)."""
        if self.device_memory is None:
            return self.managed_bytes
        return max(0, min(self.managed_bytes, self.device_memory - self.device_total_bytes))

    def paged_bytes(self) -> int:
        """Managed bytes the driver must page between host and device: each of them crosses about twice a step."""
        return self.managed_bytes - self.managed_resident_bytes()

    @property
    def host_need_bytes(self) -> int:
        """What the host must hold: its peak less the managed bytes that stay resident on the device (counted in
        ``host_peak_bytes``, where the driver pages them under pressure, but taking no host memory while resident).
        The figure ``--fit`` holds within the host budget, and prints as the answer's host."""
        return self.host_peak_bytes - self.managed_resident_bytes()

    @property
    def device_total_bytes(self) -> int:
        """The device peak plus the CUDA context: what the GPU must hold."""
        return self.device_peak_bytes + self.cuda_context_bytes

    def fits(self) -> dict[str, int | None]:
        """Spare bytes per location (negative: short by that much); None where no budget was given."""
        return {
            "device": None if self.device_memory is None else self.device_memory - self.device_total_bytes,
            "host": None if self.host_memory is None else self.host_memory - self.host_need_bytes,
        }

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["device_total_bytes"] = self.device_total_bytes
        out["spare_bytes"] = self.fits()
        out["allocator_bytes"] = self.device_peak_bytes
        out["managed_resident_bytes"] = self.managed_resident_bytes()
        out["unit"] = "bytes"
        return out

    def plot(self, out_png) -> Any:
        """The stacked bar chart (PNG) of what is live at each location's peak; None without matplotlib."""
        return plot_memory_plan(self.at_peak, out_png, CATEGORIES, title=f"mtune plan: {self.target}",
                                context_bytes=self.cuda_context_bytes, budget_bytes=self.device_memory)

    def table(self) -> str:
        """The plan as text: the peaks, each category's peak and what is live at the peak, and whether it fits."""
        lines = [f"target: {self.target}" + (f" x {self.world_size} ranks (per rank)" if self.world_size > 1 else "")
                 + f"; batch {self.batch['batch_size']} x {self.batch['seq_len']} tokens"
                 + (f", {self.batch['accumulation']} micro-batches per step" if self.batch["accumulation"] > 1 else ""),
                 f"parameters: {self.parameters['total']:,} ({self.parameters['trainable']:,} trainable)",
                 "",
                 f"{'category':<18}{'device peak':>14}{'at device peak':>16}{'host peak':>14}"]
        for category in CATEGORIES:
            lines.append(f"{category:<18}{format_bytes(self.device[category]):>14}"
                         f"{format_bytes(self.at_peak['device'][category]):>16}{format_bytes(self.host[category]):>14}")
        lines.append(f"{'peak':<18}{format_bytes(self.device_peak_bytes):>14}{'':>16}"
                     f"{format_bytes(self.host_peak_bytes):>14}")
        lines.append("")
        if self.cuda_context_bytes:
            lines.append(f"predicted torch.cuda.max_memory_allocated(): {format_bytes(self.device_peak_bytes)}; "
                         f"with the CUDA context (~{format_bytes(self.cuda_context_bytes)}): "
                         f"{format_bytes(self.device_total_bytes)} on the GPU")
        else:
            lines.append(f"predicted peak of live tensors on {self.target}: {format_bytes(self.device_peak_bytes)} "
                         f"(peak_tensor_gib in metrics.jsonl)")
        lines.append(f"host (offloaded tensors): {format_bytes(self.host_peak_bytes)}")
        if self.managed_bytes:
            resident = self.managed_resident_bytes()
            lines.append(f"managed memory (paged optimizer states, outside the allocator): "
                         f"{format_bytes(self.managed_bytes)}; "
                         + ("resident on the device beside the allocator's peak" if resident == self.managed_bytes
                            else f"{format_bytes(resident)} resident, {format_bytes(self.paged_bytes())} paged to the "
                                 "host (about twice that crosses PCIe each step)"))
        for where, spare in self.fits().items():
            if spare is None:
                continue
            budget = self.device_memory if where == "device" else self.host_memory
            verdict = (f"fits in {format_bytes(budget)} with {format_bytes(spare)} to spare" if spare >= 0
                       else f"does NOT fit in {format_bytes(budget)}: {format_bytes(-spare)} short")
            lines.append(f"{where}: {verdict}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)
