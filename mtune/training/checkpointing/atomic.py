"""One directory published whole: written under a temporary name beside its target, fsynced, then renamed into
place (atomic on POSIX file systems), so a reader or a crash sees either the old directory (or none) or the complete
new one, never half of it. Checkpoints (:mod:`mtune.training.checkpointing.checkpoint_dir`) and merged models are
published this way; what a crash leaves is a ``.tmp_*`` directory that ``clean_incomplete_checkpoints`` removes.

This module does not import torch.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["TMP_PREFIX", "atomic_directory", "fsync_tree", "publish", "temporary_path"]

TMP_PREFIX = ".tmp_"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (so a rename publishes data that is on the disk)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def temporary_path(target: Path) -> Path:
    """Where ``target`` is written before it is published: ``.tmp_<name>_<pid>`` beside it (what a crash leaves,
    for ``clean_incomplete_checkpoints``), emptied if an earlier write of this process left it."""
    tmp = target.parent / f"{TMP_PREFIX}{target.name}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def publish(tmp: Path, target: Path) -> None:
    """Rename the written ``tmp`` to ``target`` (atomic on POSIX) and fsync their directory. Rename cannot replace
    a non-empty directory: one already at ``target`` moves aside first (as a ``.tmp_`` dir, so a crash here leaves
    something ``clean_incomplete_checkpoints`` removes) and is deleted after the swap."""
    old = None
    if target.exists():
        old = target.parent / f"{TMP_PREFIX}replaced_{target.name}_{os.getpid()}"
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_path(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``target``; when the block ends without an exception, fsync its
    files and :func:`publish` it as ``target``; on an exception remove it, leaving ``target`` as it was. For outputs
    that are one directory but not a checkpoint (a merged model); ``CheckpointWriter`` adds the checksums and
    ``mtune_state.json``."""
    target = Path(target)
    tmp = temporary_path(target)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish(tmp, target)
