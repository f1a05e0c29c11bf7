"""Shared constants, the data error type, the cache directory and rank helpers."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from mtune.errors import MtuneError

IGNORE_INDEX = -100
"""Label of positions that are not trained on (prompt tokens, padding, the last token of a document)."""

log = logging.getLogger(__name__)


class DataError(MtuneError, ValueError):
    """A problem with the data or the dataset settings that the user has to fix (one line, naming file/row/key)."""


def cache_dir() -> Path:
    """mtune's cache root: `$MTUNE_CACHE_DIR`, else `~/.cache/mtune`."""
    return Path(os.environ.get("MTUNE_CACHE_DIR") or Path.home() / ".cache" / "mtune").expanduser()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def is_main_process() -> bool:
    """True on global rank 0, and when not distributed: the process that logs."""
    return not _distributed() or torch.distributed.get_rank() == 0


def is_local_main_process() -> bool:
    """True on the first process of each node: the one that writes the node's cache files."""
    if not _distributed():
        return True
    return int(os.environ.get("LOCAL_RANK", torch.distributed.get_rank())) == 0


def barrier() -> None:
    """Wait for every rank (no-op when torch.distributed is not initialised)."""
    if _distributed():
        torch.distributed.barrier()
