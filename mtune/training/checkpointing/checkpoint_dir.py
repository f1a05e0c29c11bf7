"""Checkpoint directories: ``${output_dir}/step_<N>/`` and ``${output_dir}/final/``, written atomically.

A checkpoint is *complete* iff its directory has its final name and holds ``mtune_state.json``. The writer builds
it in ``${output_dir}/.tmp_<name>_<pid>/``, writes the checksums of its files (``checksums/``, see
:mod:`mtune.training.checkpointing.manifest`), fsyncs every file, writes ``mtune_state.json`` last, renames the
directory into place (atomic on POSIX file systems) and fsyncs ``output_dir``. A crash at any moment therefore leaves
either the previous complete checkpoint or the new one, plus maybe a ``.tmp_*`` directory that
:func:`find_latest_checkpoint` cleans up. The temporary directory and the rename are
:mod:`mtune.training.checkpointing.atomic`'s, which other outputs use too.

Crash tests: ``MTUNE_FAULT_INJECT=<point>`` (or ``<point>@<step>``) kills the process (exit status 137, no cleanup) at that point of
:meth:`CheckpointWriter.save`; see :data:`FAULT_POINTS`.

This module does not import torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mtune
from mtune.config.errors import ConfigError
from mtune.errors import PathNotFoundError
from mtune.units import format_bytes
from mtune.training.checkpointing.atomic import TMP_PREFIX, fsync_tree, publish, temporary_path
from mtune.training.checkpointing.disk_space import (directory_bytes, failure_reason, free_bytes, warn_if_short,
                                                     write_failure)
from mtune.training.checkpointing.hf import CheckpointError
from mtune.training.checkpointing.manifest import Manifest, recording

__all__ = ["CheckpointWriter", "find_latest_checkpoint", "list_checkpoints", "read_checkpoint_state",
           "clean_incomplete_checkpoints", "maybe_inject_fault", "STATE_FILENAME", "FAULT_POINTS"]

log = logging.getLogger(__name__)

STATE_FILENAME = "mtune_state.json"
FINAL_NAME = "final"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PID_RE = re.compile(r"_(\d+)$")

FAULT_ENV = "MTUNE_FAULT_INJECT"
FAULT_POINTS = (
    "after_model_write",  # the caller's files are in the temp dir; no mtune_state.json yet
    "before_rename",  # mtune_state.json written and fsynced in the temp dir; not renamed
    "after_rename",  # the new checkpoint is complete; older ones not yet pruned
    "during_prune",  # one old checkpoint has lost its mtune_state.json, its files are still there
)


def maybe_inject_fault(point: str, step: int | None = None) -> None:
    """Kill this process now (exit status 137, like SIGKILL) if ``MTUNE_FAULT_INJECT`` names ``point``, or
    ``point@N`` and this is the save of step N (so a crash test can let earlier saves complete)."""
    wanted = os.environ.get(FAULT_ENV)
    if wanted == point or (step is not None and wanted == f"{point}@{step}"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(137)


def read_checkpoint_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``mtune_state.json`` of a checkpoint, as a dict (keys: ``mtune_version``, ``step``, ``epoch``,
    ``kind``, ``final``, ``complete``, ``config``, ``files``, ``created``)."""
    path = Path(checkpoint_dir) / STATE_FILENAME
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        if not Path(checkpoint_dir).is_dir():
            raise PathNotFoundError(f"{checkpoint_dir}: no such checkpoint directory") from None
        raise PathNotFoundError(f"{checkpoint_dir} is not a complete mtune checkpoint: {STATE_FILENAME} is missing")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt, not JSON ({e})", _CORRUPT_HINT.format(path=checkpoint_dir)) from None
    if not isinstance(state, dict) or state.get("complete") is not True or not isinstance(state.get("step"), int):
        raise CheckpointError(f"{path}: not the state of a complete checkpoint (no complete: true and step)",
                              _CORRUPT_HINT.format(path=checkpoint_dir))
    return state


_CORRUPT_HINT = ("resume from an earlier checkpoint (resume_from_checkpoint=<its directory>), or move {path} away "
                 "and resume from the latest one left")


def _complete_state(path: Path, strict: bool = False) -> dict[str, Any] | None:
    """The checkpoint state of ``path``, or None when it is not a complete checkpoint. With ``strict`` a state file
    that exists but cannot be read raises :class:`CheckpointError` (a damaged checkpoint, not a half-written one)."""
    if strict and not (path / STATE_FILENAME).exists():
        return None
    try:
        return read_checkpoint_state(path)
    except (OSError, ValueError):
        if strict:
            raise
        return None


def list_checkpoints(output_dir: str | os.PathLike, strict: bool = False) -> list[tuple[int, Path]]:
    """Complete ``step_<N>`` checkpoints in ``output_dir`` as ``(step, path)``, oldest first (``final`` excluded).
    ``strict``: a ``step_<N>`` whose state file is damaged raises :class:`CheckpointError` instead of being skipped."""
    found = []
    root = Path(output_dir)
    if not root.is_dir():
        return found
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir() and _complete_state(child, strict) is not None:
            found.append((int(match.group(1)), child))
    return sorted(found)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_incomplete_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Remove what interrupted writers left in ``output_dir``: ``.tmp_*`` directories (unless their pid is this
    process or another live one, which may still be writing) and ``step_<N>`` dirs without ``mtune_state.json``
    (a prune cut short). Logs one line for each; returns the removed paths."""
    removed = []
    root = Path(output_dir)
    if not root.is_dir():
        return removed
    for child in sorted(root.iterdir()):
        if not child.is_dir():
            continue
        if child.name.startswith(TMP_PREFIX):
            match = _TMP_PID_RE.search(child.name)
            if match and (int(match.group(1)) == os.getpid() or _pid_alive(int(match.group(1)))):
                continue
        elif not (_STEP_RE.match(child.name) and not (child / STATE_FILENAME).exists()):
            continue
        log.warning("Removing %s: an unfinished checkpoint left by an interrupted run", child)
        shutil.rmtree(child, ignore_errors=True)
        removed.append(child)
    return removed


def find_latest_checkpoint(output_dir: str | os.PathLike, clean: bool = True, strict: bool = False) -> Path | None:
    """The complete checkpoint with the highest step in ``output_dir`` (``step_<N>`` dirs and ``final``; on a tie
    the ``step_<N>`` dir), or None. Directories without ``mtune_state.json`` and ``.tmp_*`` dirs are ignored; with
    ``clean=True`` they are removed (see :func:`clean_incomplete_checkpoints`). ``strict`` (resuming): a checkpoint
    whose ``mtune_state.json`` exists but is damaged raises :class:`CheckpointError` naming it, so a resume never
    silently starts over."""
    if clean:
        clean_incomplete_checkpoints(output_dir)
    candidates = [(step, 1, path) for step, path in list_checkpoints(output_dir, strict)]
    final = Path(output_dir) / FINAL_NAME
    final_state = _complete_state(final, strict) if final.is_dir() else None
    if final_state is not None:
        candidates.append((final_state["step"], 0, final))
    return max(candidates)[2] if candidates else None


class CheckpointWriter:
    """Writes checkpoints into ``output_dir`` atomically and keeps the newest ``keep_last_n_checkpoints``.

    Args:
        output_dir: the run's output directory.
        keep_last_n_checkpoints: after a new ``step_<N>`` checkpoint is complete, delete older ``step_`` dirs so
            this many remain (``final`` is never deleted). None keeps all.
        mtune_version: recorded in ``mtune_state.json`` (defaults to ``mtune.__version__``).

    Use it from rank 0 only; in distributed runs the other ranks gather their shards to rank 0 first.
    Either pass a function that writes files into the temporary directory::

        writer.save(step=100, epoch=1, config=resolved_cfg, kind="lora", write_fn=lambda d: ...)

    or write them yourself inside the context manager::

        with writer.open(step=100, epoch=1, config=resolved_cfg, kind="full") as tmp_dir:
            save_hf_checkpoint(model, tmp_dir)
            save_recipe_state(tmp_dir, ...)
    """

    def __init__(self, output_dir: str | os.PathLike, keep_last_n_checkpoints: int | None = None,
                 mtune_version: str | None = None):
        if keep_last_n_checkpoints is not None and keep_last_n_checkpoints < 1:
            raise ConfigError(f"keep_last_n_checkpoints must be >= 1 or null, got {keep_last_n_checkpoints}")
        self.output_dir = Path(output_dir)
        self.keep_last_n_checkpoints = keep_last_n_checkpoints
        self.mtune_version = mtune_version if mtune_version is not None else mtune.__version__
        self.expected_bytes: int | None = None
        """About the bytes of the next checkpoint: the last one's size, or a prediction before the first."""

    def save(self, *, step: int, epoch: int, config: Mapping[str, Any], kind: str,
             write_fn: Callable[[Path], None], final: bool = False, world_size: int = 1,
             state: Mapping[str, Any] | None = None) -> Path:
        """Write a checkpoint with ``write_fn(tmp_dir)`` and return its final path."""
        with self.open(step=step, epoch=epoch, config=config, kind=kind, final=final, world_size=world_size,
                       state=state) as tmp_dir:
            write_fn(tmp_dir)
        return self.checkpoint_path(step, final)

    def checkpoint_path(self, step: int, final: bool = False) -> Path:
        return self.output_dir / (FINAL_NAME if final else f"step_{int(step)}")

    @contextmanager
    def open(self, *, step: int, epoch: int, config: Mapping[str, Any], kind: str, final: bool = False,
             world_size: int = 1, state: Mapping[str, Any] | None = None) -> Iterator[Path]:
        """Yield an empty temporary directory; when the block ends without an exception, commit it as
        ``step_<step>`` (or ``final``), with ``state``'s entries added to its ``mtune_state.json``. On an exception
        the temporary directory is removed."""
        target = self.checkpoint_path(step, final)
        warn_if_short(self.output_dir, self.expected_bytes, f"checkpoint {target.name}")
        tmp = temporary_path(target)
        try:
            tmp.mkdir(parents=True)
            manifest = Manifest(tmp, rank=0)
            with recording(manifest):  # tensor files are hashed as they are written
                yield tmp
            maybe_inject_fault("after_model_write", step)
            manifest.finish()  # checksums/rank_0.json, before mtune_state.json and the rename that publishes
            self._write_state(tmp, step=step, epoch=epoch, config=config, kind=kind, final=final,
                              world_size=world_size, extra=state)
            fsync_tree(tmp)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            failure = write_failure(err)
            if failure is not None:
                raise self._save_failed(target, failure) from err
            raise
        maybe_inject_fault("before_rename", step)
        publish(tmp, target)
        maybe_inject_fault("after_rename", step)
        self.expected_bytes = directory_bytes(target)  # the next checkpoint is this one's size
        if not final:
            self._prune()

    def _save_failed(self, target: Path, err: BaseException) -> CheckpointError:
        """The one-line error for a save the filesystem refused (disk full, permissions, ...): what was being
        saved where, why, the bytes it needs and those free, and which checkpoint is still intact."""
        previous = find_latest_checkpoint(self.output_dir, clean=False)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        need = self.expected_bytes or (directory_bytes(previous) if previous else None)
        room = (f" (it needs about {format_bytes(need)}, {format_bytes(free_bytes(self.output_dir))} free)"
                if need else f" ({format_bytes(free_bytes(self.output_dir))} free)")
        return CheckpointError(f"saving {target.name} to {self.output_dir}: {failure_reason(err)}{room}",
                               f"free space in {self.output_dir} (or point output_dir elsewhere); {kept}, "
                               "resume_from_checkpoint=true continues from it")

    def _write_state(self, tmp: Path, *, step: int, epoch: int, config: Mapping[str, Any], kind: str,
                     final: bool, world_size: int = 1, extra: Mapping[str, Any] | None = None) -> None:
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        state = {
            "mtune_version": self.mtune_version,
            "step": int(step),
            "epoch": int(epoch),
            "kind": kind,
            "final": bool(final),
            "world_size": int(world_size),  # with batch_size, fixes the global batch a resume must keep
            "complete": True,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
            "config": _plain_config(config),
            **(extra or {}),
        }
        with open(tmp / STATE_FILENAME, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())

    def _prune(self) -> None:
        if self.keep_last_n_checkpoints is None:
            return
        checkpoints = list_checkpoints(self.output_dir)
        for _, path in checkpoints[: max(0, len(checkpoints) - self.keep_last_n_checkpoints)]:
            # Losing mtune_state.json first makes the dir incomplete at once, so a crash mid-delete never leaves a
            # half-deleted dir that looks complete.
            (path / STATE_FILENAME).unlink()
            maybe_inject_fault("during_prune")
            shutil.rmtree(path)
            log.info("Removed old checkpoint %s (keep_last_n_checkpoints=%d)", path, self.keep_last_n_checkpoints)


def _plain_config(config: Mapping[str, Any]) -> Any:
    """A JSON-able dict from a dict or an OmegaConf DictConfig (interpolations resolved)."""
    if type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    return dict(config)
