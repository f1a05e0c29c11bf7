"""The cache of precomputed reference log-probs (``reference: precomputed``): one pass over a pair dataset before
training writes, for every pair, the reference model's summed log-probs of its chosen and rejected response.

Layout under ``reference_cache_dir``, per dataset role (``train``, ``val``)::

    <role>.json           the fingerprint (data, model, tokenizer, dtype), the pair count, and a CRC-32 per part
    <role>.part<k>.pt     fp32 [pairs of part k, 2]: chosen, rejected

Every file is written to a temporary name, flushed to disk and renamed, and the manifest after each part, so a pass
that is stopped resumes at its first missing part; a part whose bytes no longer match its CRC is computed again. A
directory whose manifest carries another fingerprint is refused with one line: a cache is never silently mixed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mtune.config import ConfigError

__all__ = ["FORMAT", "model_fingerprint", "cached_reference_logps"]

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a cache holds, or how it is computed, changes
PART_PAIRS = 4096  # pairs per part file: the most a stopped pass recomputes
_WHOLE_FILE_BYTES = 64 << 20  # files up to this size are hashed whole; larger ones by size and sampled blocks


def model_fingerprint(checkpoint_dir: str | Path | None, described: Mapping[str, Any]) -> str:
    """A hash of a checkpoint directory's files: names, sizes, and contents (files over 64 MiB by their first,
    last and 14 evenly spaced 1 MiB blocks, so an 8B checkpoint is fingerprinted in well under a second). Without a
    checkpoint (random weights) a hash of ``described`` (family, size, seed)."""
    digest = hashlib.sha256(json.dumps(dict(described), sort_keys=True, default=str).encode())
    if checkpoint_dir is None:
        return digest.hexdigest()[:32]
    for path in sorted(Path(checkpoint_dir).iterdir()):
        if not path.is_file() or not path.name.endswith((".safetensors", ".bin", ".json", ".model", ".tiktoken")):
            continue
        size = path.stat().st_size
        digest.update(f"{path.name}\n{size}\n".encode())
        with open(path, "rb") as f:
            if size <= _WHOLE_FILE_BYTES:
                digest.update(f.read())
                continue
            block = 1 << 20
            for i in range(16):
                f.seek((size - block) * i // 15)
                digest.update(f.read(block))
    return digest.hexdigest()[:32]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp_{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _check_writable(cache_dir: Path) -> None:
    """Make ``cache_dir`` and write a file in it, so that a directory the cache cannot be written to is one line
    now, not a traceback after the reference's whole pass."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(cache_dir / ".write_check", b"")
        (cache_dir / ".write_check").unlink()
    except OSError as err:
        raise ConfigError(f"reference_cache_dir={cache_dir}: cannot write there ({err.strerror or err})",
                          "point reference_cache_dir at a writable directory (null: ${output_dir}/reference_cache)"
                          ) from None


def _differences(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    return ", ".join(k for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k))


def cached_reference_logps(cache_dir: str | Path, role: str, fingerprint: Mapping[str, Any], num_pairs: int,
                           compute: Callable[[int, int], torch.Tensor], *, writer: bool = True,
                           barrier: Callable[[], None] = lambda: None) -> torch.Tensor:
    """fp32 [num_pairs, 2] reference log-probs of a dataset (``role``: train or val), from the cache when its
    fingerprint matches, else computed part by part with ``compute(start, end) -> [end - start, 2]`` and cached.
    In a distributed run every rank calls it (each computes every missing part, in step with the others, as FSDP2's
    forward needs) and only the ``writer`` (rank 0) writes; ``barrier`` waits for every rank, so all of them decide
    from the cache as it was before anything is written."""
    cache_dir = Path(cache_dir)
    if writer:
        _check_writable(cache_dir)
    barrier()
    mine = {"format": FORMAT, **fingerprint, "pairs": num_pairs}
    manifest_path = cache_dir / f"{role}.json"
    manifest = {"fingerprint": mine, "part_pairs": PART_PAIRS, "parts": {}}
    if manifest_path.exists():
        saved = json.loads(manifest_path.read_text())
        if saved.get("fingerprint") != mine:
            raise ConfigError(
                f"reference_cache_dir {cache_dir} holds the {role} reference log-probs of another run (its "
                f"{_differences(saved.get('fingerprint', {}), mine)} differ): point reference_cache_dir elsewhere, "
                "or delete that directory to compute them again")
        manifest = saved
    bounds = [(start, min(start + manifest["part_pairs"], num_pairs))
              for start in range(0, num_pairs, manifest["part_pairs"])]
    parts: list[torch.Tensor | None] = []
    for k in range(len(bounds)):  # what the cache holds intact, decided by every rank before anything is written
        path, crc = cache_dir / f"{role}.part{k}.pt", manifest["parts"].get(str(k))
        data = path.read_bytes() if crc is not None and path.exists() else None
        if data is not None and zlib.crc32(data) != crc:
            log.warning("%s: its checksum does not match; computing it again", path)
        intact = data is not None and zlib.crc32(data) == crc
        parts.append(torch.load(io.BytesIO(data), weights_only=True) if intact else None)
    barrier()
    computed = 0
    for k, (start, end) in enumerate(bounds):
        if parts[k] is not None:
            continue
        parts[k] = compute(start, end).detach().float().cpu().contiguous()
        computed += end - start
        if writer:
            buffer = io.BytesIO()
            torch.save(parts[k], buffer)
            _write_atomic(cache_dir / f"{role}.part{k}.pt", buffer.getvalue())
            manifest["parts"][str(k)] = zlib.crc32(buffer.getvalue())
            _write_atomic(manifest_path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    barrier()
    reused = num_pairs - computed
    log.info("reference log-probs (%s, %d pairs): %d from the cache in %s, %d computed", role, num_pairs, reused,
             cache_dir, computed)
    return torch.cat(parts) if parts else torch.zeros(0, 2)
