"""Checksums of a checkpoint's files, so that a damaged checkpoint is refused instead of resumed.

Every checkpoint directory holds ``checksums/rank_<r>.json``: for each file that rank wrote, its size and CRC-32
(``zlib.crc32``: in the standard library, about 4 GB/s on one core, so no dependency and a few percent of a save).
The checksums of tensor files (safetensors shards, ``recipe_state.pt``) are computed from the bytes *as they are
written*: :func:`open_for_write` and :func:`write_safetensors` hash each buffer on its way to the file, so nothing
is read back. Files written by code that does not go through them (small JSON and tokenizer files, and the
``distributed_state/`` shards that ``torch.distributed.checkpoint`` writes itself) are hashed when the rank
finishes, by reading them back (from the page cache, just written). Each rank hashes its own files: rank ``r``
its ``distributed_state/__<r>_*.distcp``, rank 0 everything else. The manifests are written inside the temporary
directory before the rename that publishes the checkpoint, so a published checkpoint always has them.

:func:`verify_checkpoint` reads each listed file again and compares; resuming and loading do that by default
(``verify_checksums=false`` skips it). A checkpoint written before checksums existed has no ``checksums/``
directory and is loaded without a check (one line says so).

This module does not import torch at module level.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mtune.errors import MtuneError

__all__ = ["CHECKSUMS_DIRNAME", "DamagedCheckpointError", "UNREADABLE_HINT", "Manifest", "recording", "open_for_write",
           "renamed", "write_safetensors", "verify_checkpoint", "has_checksums", "checkpoint_root"]

log = logging.getLogger(__name__)


class DamagedCheckpointError(MtuneError, ValueError):
    """A checkpoint's files no longer match the checksums saved with them, or cannot be read at all; the message
    names the file."""


UNREADABLE_HINT = ("resume from an earlier checkpoint (resume_from_checkpoint=<its directory>), or start again in "
                   "another output_dir")
"""The hint of a checkpoint file that cannot be read at all (recipe_state.pt, distributed shards)."""


CHECKSUMS_DIRNAME = "checksums"
ALGORITHM = "crc32"
_CHUNK = 16 * 2**20
_DISTCP_RE = re.compile(r"(^|/)__(\d+)_\d+\.distcp$")
_STATE_FILENAME = "mtune_state.json"  # written after the manifests; read and checked on its own


class _ChecksumFile:
    """A binary file open for writing that keeps the CRC-32 and size of everything written through it."""

    def __init__(self, raw):
        self._raw = raw
        self.crc = 0
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return self._raw.write(view)

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()


class Manifest:
    """The checksums one rank records for the files it writes under ``root`` (a checkpoint's temporary
    directory). Entries are keyed by path relative to ``root``."""

    def __init__(self, root: str | os.PathLike, rank: int = 0):
        self.root = Path(root)
        self.rank = rank
        self.entries: dict[str, dict[str, int]] = {}

    def relative(self, path: str | os.PathLike) -> str | None:
        """``path`` relative to the root, or None when it lies outside."""
        try:
            return Path(os.path.abspath(path)).relative_to(os.path.abspath(self.root)).as_posix()
        except ValueError:
            return None

    def owns(self, relative: str) -> bool:
        """Whether this rank hashes ``relative``: rank r its own DCP shards, rank 0 every other file."""
        if relative.startswith(CHECKSUMS_DIRNAME + "/") or relative == _STATE_FILENAME:
            return False
        match = _DISTCP_RE.search(relative)
        return int(match.group(2)) == self.rank if match else self.rank == 0

    def finish(self) -> Path:
        """Hash the files this rank owns that were written without :func:`open_for_write` (read back), then write
        ``checksums/rank_<r>.json`` (fsynced) and return its path."""
        for path in sorted(p for p in self.root.rglob("*") if p.is_file()):
            relative = self.relative(path)
            if relative not in self.entries and self.owns(relative):
                self.entries[relative] = {"size": path.stat().st_size, ALGORITHM: _file_crc(path)}
        out = self.root / CHECKSUMS_DIRNAME / f"rank_{self.rank}.json"
        out.parent.mkdir(exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"algorithm": ALGORITHM, "files": dict(sorted(self.entries.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        return out


_ACTIVE: contextvars.ContextVar[Manifest | None] = contextvars.ContextVar("mtune_manifest", default=None)


@contextmanager
def recording(manifest: Manifest) -> Iterator[Manifest]:
    """Within the block, files written with :func:`open_for_write` under ``manifest.root`` are recorded in it."""
    token = _ACTIVE.set(manifest)
    try:
        yield manifest
    finally:
        _ACTIVE.reset(token)


@contextmanager
def open_for_write(path: str | os.PathLike) -> Iterator[Any]:
    """Open ``path`` for writing bytes; inside :func:`recording` the file's CRC-32 is computed from what is written
    and recorded when it closes (outside, a plain file)."""
    manifest = _ACTIVE.get()
    relative = manifest.relative(path) if manifest is not None else None
    with open(path, "wb") as raw:
        if relative is None:
            yield raw
            return
        f = _ChecksumFile(raw)
        yield f
    manifest.entries[relative] = {"size": f.size, ALGORITHM: f.crc}


def renamed(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Tell the recording manifest that ``src`` was renamed to ``dst`` (its checksum moves with it)."""
    manifest = _ACTIVE.get()
    if manifest is None:
        return
    old, new = manifest.relative(src), manifest.relative(dst)
    if old in manifest.entries and new is not None:
        manifest.entries[new] = manifest.entries.pop(old)


# safetensors dtype names (see the format's README)
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def write_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (CPU torch tensors) to a safetensors file at ``path``, one tensor's bytes at a time through
    :func:`open_for_write` (so they are hashed as they go, and no second copy of the shard is made). The file is
    what ``safetensors.torch.save_file`` writes: an 8-byte little-endian header length, the JSON header (padded with
    spaces to 8 bytes), then the tensors' bytes back to back."""
    import torch

    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset, flat = 0, []
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu").contiguous()
        data = tensor.reshape(-1).view(torch.uint8)
        dtype = str(tensor.dtype).removeprefix("torch.")
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + data.numel()]}
        offset += data.numel()
        flat.append(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open_for_write(path) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in flat:
            if data.numel():
                f.write(data.numpy())


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def checkpoint_root(path: str | os.PathLike) -> Path | None:
    """The mtune checkpoint directory that ``path`` is or lies directly inside (``final/`` for ``final/model``),
    or None."""
    path = Path(path)
    for candidate in (path, path.parent):
        if (candidate / _STATE_FILENAME).is_file():
            return candidate
    return None


def has_checksums(checkpoint: str | os.PathLike) -> bool:
    return any((Path(checkpoint) / CHECKSUMS_DIRNAME).glob("rank_*.json"))


def verify_checkpoint(checkpoint: str | os.PathLike, under: str | os.PathLike | None = None) -> list[str]:
    """Problems with the files of ``checkpoint`` against its ``checksums/`` (only those inside ``under`` when
    given), one line each naming the file; empty when every file is intact. A checkpoint without checksums has
    nothing to check: empty too (see :func:`has_checksums`)."""
    root = Path(checkpoint)
    scope = None if under is None else Path(os.path.abspath(under))
    problems = []
    listed = [] if has_checksums(root) else _listed_checksums(root)
    if listed:  # they were written, and are gone: not a checkpoint of an older mtune
        problems.append(f"{root / listed[0]}: missing (mtune_state.json lists it; the checkpoint's files cannot be "
                        "verified without it)")
    for manifest in sorted((root / CHECKSUMS_DIRNAME).glob("rank_*.json")):
        try:
            files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError) as err:
            problems.append(f"{manifest}: unreadable checksums ({type(err).__name__})")
            continue
        for relative, expected in files.items():
            path = root / relative
            if scope is not None and scope != Path(os.path.abspath(path)) and scope not in Path(
                    os.path.abspath(path)).parents:
                continue
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            size = path.stat().st_size
            if size != expected["size"]:
                problems.append(f"{path}: {size} bytes, {expected['size']} when saved")
            elif _file_crc(path) != expected[ALGORITHM]:
                problems.append(f"{path}: checksum mismatch (its bytes changed since it was saved)")
    return problems


def _listed_checksums(root: Path) -> list[str]:
    """The checksum files ``root``'s ``mtune_state.json`` says were saved with it (none when it names none or
    cannot be read: that is another check's to report)."""
    try:
        files = json.loads((root / _STATE_FILENAME).read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [f for f in files if isinstance(f, str) and f.startswith(f"{CHECKSUMS_DIRNAME}/rank_")]


def check_before_loading(path: str | os.PathLike) -> None:
    """Refuse to load ``path`` (a model or adapter directory, or a checkpoint) when it is part of an mtune
    checkpoint whose checksums its files no longer match: one line naming the file. Anything else (a downloaded
    model, a checkpoint saved before checksums existed) passes unchecked."""
    root = checkpoint_root(path)
    if root is None or not has_checksums(root):
        return
    problems = verify_checkpoint(root, under=path)
    if problems:
        raise DamagedCheckpointError(f"{path}: checkpoint {root} is damaged: {problems[0]}",
                              "load an earlier checkpoint, or set verify_checksums=false to load it anyway")
