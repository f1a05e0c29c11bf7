"""Room on the disk for a checkpoint: how big the next one is (the last one's size, or a prediction from the tensors
it will hold before the first), a warning when ``output_dir`` has less free space, and the one-line error when a save
fails for want of it.

A failed write reaches mtune in three shapes: an ``OSError`` (``ENOSPC``, ``EACCES``, ``EROFS``...), safetensors'
``SafetensorError`` wrapping its writer's, and the ``RuntimeError("... unexpected pos ...")`` that ``torch.save``
raises with the ``OSError`` only attached as its context. :func:`write_failure` finds the cause in all three.

This module does not import torch.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from mtune.units import format_bytes

__all__ = ["write_failure", "directory_bytes", "free_bytes", "predicted_bytes", "warn_if_short", "failure_reason"]

log = logging.getLogger(__name__)


def write_failure(err: BaseException) -> BaseException | None:
    """The filesystem's error under ``err`` (itself, its cause or its context, however deep), or None when the
    failure is not the filesystem's."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) or type(err).__name__ == "SafetensorError":
            return err
        err = err.__cause__ or err.__context__
    return None


def failure_reason(err: BaseException) -> str:
    """``No space left on device`` for an OSError, else the first line of the error."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def directory_bytes(path: str | os.PathLike) -> int:
    """The bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes, for an unprivileged writer, on the filesystem of ``path`` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def predicted_bytes(model: Any, optimizer: Any = None, *, adapter_only: bool = False, merged: bool = True) -> int:
    """About what a checkpoint of ``model`` takes before the first one is written: the model's tensors in their own
    dtype (the trainable ones alone for ``adapter_only``; a LoRA checkpoint with ``merged`` adds the whole model to
    its adapter) and the optimizer's state tensors. Sharded tensors count whole: together the ranks write them all."""

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "element_size"))

    trainable = nbytes(p for p in model.parameters() if p.requires_grad)
    # Parameters and buffers rather than state_dict(): one rank predicts, and an FSDP2 model's state_dict hooks may
    # run collectives that the other ranks would not join.
    whole = nbytes([*model.parameters(), *model.buffers()])
    model_bytes = trainable if adapter_only else (whole + (trainable if merged else 0))
    if optimizer is None:
        return model_bytes
    states = [v for state in optimizer.state_dict().get("state", {}).values() for v in state.values()]
    # Before the first step an optimizer holds no state yet: count AdamW's two moments per trainable parameter.
    return model_bytes + (nbytes(states) if states else 2 * trainable)


def warn_if_short(output_dir: str | os.PathLike, need: int | None, what: str) -> bool:
    """One warning line when ``output_dir`` has less free space than ``need`` bytes; True when it warned."""
    if not need:
        return False
    free = free_bytes(output_dir)
    if free >= need:
        return False
    log.warning("%s has %s free, less than the %s %s needs: free space (or point output_dir elsewhere) before it "
                "is saved, or the save will fail", output_dir, format_bytes(free), format_bytes(need), what)
    return True
