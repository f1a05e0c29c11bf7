"""Bytes of tensors as memory holds them: tensor subclasses (torchao's NF4 and low-bit optimizer states, FSDP2's
DTensor) count their inner tensors, views of one storage count once. The optimizers, the tensor tracker and the
memory breakdown count with these."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["tensor_bytes", "tensor_storage_bytes", "storages", "plain_parts"]


def plain_parts(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s bytes: ``t`` itself, or a wrapper subclass's (NF4, DTensor, low-bit
    optimizer states) inner tensors, recursively. Never through ``.data``: under fake tensors, ``param.data`` makes a
    new tensor that re-grows the shared storage to its full size, undoing what weight offloading emptied (a wrapper
    parameter is the subclass itself, so it needs no ``.data`` either)."""
    if _is_wrapper(t):
        for part in _inner_tensors(t):
            yield from plain_parts(part)
        return
    yield t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements; tensor subclasses (torchao's quantized states, NF4) count their inner parts, and
    a DTensor (an FSDP2-sharded parameter, gradient or optimizer state) the local shard of this rank."""
    return sum(part.numel() * part.element_size() for part in plain_parts(t))


def _is_wrapper(t: torch.Tensor) -> bool:
    return type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__")


def _inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors a wrapper subclass holds. ``__tensor_flatten__`` also names non-tensor parts (a DTensor's
    ``device_mesh``), which hold no tensor bytes."""
    names, _ = t.__tensor_flatten__()
    for name in names:
        part = getattr(t, name)
        if isinstance(part, torch.Tensor):
            yield part


def storages(tensor: torch.Tensor) -> Iterator[tuple[tuple, int]]:
    """``(key, nbytes)`` of the storages behind ``tensor``. Wrapper subclasses (torchao's NF4Tensor, low-bit
    optimizer states, DTensor) are opened up to their inner tensors, whose storages hold the real bytes: a
    DTensor's local shard, which may itself be an NF4Tensor."""
    for part in plain_parts(tensor):
        if part.device.type == "meta":
            continue
        storage = part.untyped_storage()
        if storage.nbytes() > 0:
            yield (part.device.type, part.device.index, storage.data_ptr()), storage.nbytes()


def tensor_storage_bytes(tensors: Iterable[torch.Tensor], exclude: set | None = None) -> tuple[int, set]:
    """Bytes of the distinct storages behind ``tensors`` (a storage shared by views counts once), skipping storage
    keys in ``exclude``. Returns ``(bytes, keys)``."""
    seen: set = set()
    total = 0
    for tensor in tensors:
        for key, nbytes in storages(tensor):
            if key in seen or (exclude is not None and key in exclude):
                continue
            seen.add(key)
            total += nbytes
    return total, seen
