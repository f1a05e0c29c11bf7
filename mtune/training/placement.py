"""Where tensors live: the compute device, where the model runs, and the host, where offloaded tensors wait.

Every offloading technique (activations, frozen weights, optimizer states) and every byte count that says "on the
device" or "on the host" asks one :class:`Placement` instead of testing ``device.type`` or
``torch.cuda.is_available()`` itself.

On a GPU machine the two are different devices (``cuda:0`` and ``cpu``) and moving a tensor copies it. On a
CPU-only machine both are ``cpu``: by default moves are free (the tensor is returned as it is), so an offloading
flag changes nothing there. Tests and the planner build ``Placement(cpu, cpu, distinct=True)``: then every move
really copies, exactly as it would between a GPU and its host, and the placement remembers which storages it put
on the host (:meth:`Placement.on_host`), so the two memories can be told apart although both are ``cpu``. This
works with fake tensors too (the planner's), since storages are recognised by identity, not by address.

Transfers between distinct devices use pinned host memory and side streams only where there is an accelerator
(:attr:`Placement.pinned`, :attr:`Placement.streams`); pinning or creating a stream raises on a CPU-only build.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

__all__ = ["Placement", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """An identity for the storage behind ``t`` (shared by all its views), valid while the storage lives. Works for
    real, meta and fake tensors alike (a meta storage has no address, but it is still one object)."""
    return t.untyped_storage()._cdata


class Placement:
    """A compute device and a host device.

    Args:
        compute: where the model computes (``cuda:0``, ``cpu``).
        host: where offloaded tensors are kept; default ``cpu``.
        distinct: whether a move copies data. Default: whether the two devices differ. Set it to True on a
            CPU-only machine to run the offloading mechanics for real (tests, planning).
    """

    def __init__(self, compute: torch.device | str, host: torch.device | str = "cpu", *, distinct: bool | None = None):
        self.compute = torch.device(compute)
        self.host = torch.device(host)
        self.distinct = self.compute != self.host if distinct is None else distinct
        self._host_storages: dict[int, weakref.ref] = {}  # storage_key -> weakref to a host tensor holding it
        self._allocating_host = 0  # > 0 while empty_host allocates (a byte tracker counts that storage as host)
        self._side_stream = 0  # > 0 inside side_stream(): device allocations come from a side stream's pool

    @classmethod
    def default(cls) -> Placement:
        """The machine's accelerator (CUDA first) and the CPU; the CPU for both on a machine without one."""
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return cls(accelerator or "cpu")

    def __repr__(self) -> str:
        return f"Placement(compute={self.compute}, host={self.host}, distinct={self.distinct})"

    @property
    def pinned(self) -> bool:
        """Whether host buffers are pinned (page-locked), so device<->host copies can be asynchronous."""
        return self.distinct and self.compute.type != "cpu" and torch.accelerator.is_available()

    @property
    def streams(self) -> bool:
        """Whether copies can run on a side CUDA stream, overlapping compute."""
        return self.distinct and self.compute.type == "cuda" and torch.cuda.is_available()

    # ------------------------------------------------------------------ moves
    def to_host(self, t: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
        """A host copy of ``t`` (pinned where that helps), remembered as host-resident. Without distinct devices,
        ``t`` itself, also remembered as host-resident."""
        if not self.distinct:
            return self.mark_host(t)
        host = self.empty_host(t.shape, t.dtype)
        host.copy_(t, non_blocking=non_blocking)
        return host

    def to_compute(self, t: torch.Tensor, *, non_blocking: bool = False) -> torch.Tensor:
        """A compute-device copy of ``t`` (or ``t`` itself without distinct devices)."""
        if not self.distinct:
            return t
        if t.device == self.compute:
            return t.clone()  # same device type on both sides (tests): still a new, compute-side storage
        return t.to(self.compute, non_blocking=non_blocking)

    def empty_host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor (pinned when :attr:`pinned`), remembered as host-resident."""
        self._allocating_host += 1
        try:
            host = torch.empty(shape, dtype=dtype, device=self.host, pin_memory=self.pinned)
        finally:
            self._allocating_host -= 1
        return self.mark_host(host)

    @contextlib.contextmanager
    def host_allocation(self) -> Iterator[None]:
        """Every storage created inside is a host one (a byte tracker counts it there): for work that runs on the
        host, such as an optimizer step in host memory and the states it creates. Mark what it keeps with
        :meth:`mark_host` before leaving."""
        self._allocating_host += 1
        try:
            yield
        finally:
            self._allocating_host -= 1

    @contextlib.contextmanager
    def side_stream(self, stream: "torch.cuda.Stream | None") -> Iterator[None]:
        """Work whose device allocations come from a side stream's pool (a transfer that overlaps compute): on CUDA
        ``stream`` is made current; None (the same transfer run in line, where a CUDA run would use a side stream:
        planning, tests) only marks them (:attr:`allocating_on_side_stream`, which the planner's log of device
        storages reads: the caching allocator keeps each stream's freed blocks for that stream)."""
        self._side_stream += 1
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                yield
        finally:
            self._side_stream -= 1

    @property
    def allocating_on_side_stream(self) -> bool:
        return self._side_stream > 0

    @property
    def allocating_host(self) -> bool:
        """True while :meth:`empty_host` allocates: the storage then being created is a host one even where the
        two devices are the same (the tensor byte tracker asks, as it sees the allocation before it is marked)."""
        return self._allocating_host > 0 and self.distinct

    # -------------------------------------------------------------- queries
    def mark_host(self, t: torch.Tensor) -> torch.Tensor:
        """Remember ``t``'s storage as host-resident (for as long as ``t`` lives); returns ``t``."""
        key = storage_key(t)
        self._host_storages[key] = weakref.ref(t, lambda _, key=key: self._host_storages.pop(key, None))
        return t

    def host_tensors(self) -> list[torch.Tensor]:
        """The live tensors this placement put on (or marked as) the host, one per storage."""
        return [t for t in (ref() for ref in list(self._host_storages.values())) if t is not None]

    def on_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in host memory: on a host-type device that is not the compute device, or in a storage
        this placement put on the host."""
        if t.device.type != self.host.type:
            return False
        if t.device != self.compute:
            return True
        ref = self._host_storages.get(storage_key(t))
        return ref is not None and ref() is not None

    def on_compute(self, t: torch.Tensor) -> bool:
        """Whether ``t`` takes compute-device memory (the complement of :meth:`on_host` for the two devices)."""
        return t.device == self.compute and not self.on_host(t)
