"""Write tensors into size-limited safetensors shards, one tensor at a time, with the standard index."""

import json
from pathlib import Path

import torch

from mtune.training.checkpointing.manifest import renamed, write_safetensors


class ShardWriter:
    """Collects tensors until the next would pass ``max_bytes``, then writes a shard (a tensor larger than the limit
    gets a shard of its own). ``finish()`` names the shards ``model-0000i-of-0000N.safetensors`` and writes
    ``model.safetensors.index.json``, or a lone ``model.safetensors`` when everything fit in one shard."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[key] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.out_dir / f".shard-{len(self.shards):05d}.tmp"
        write_safetensors(self.pending, path, metadata={"format": "pt"})  # hashed as written, inside a checkpoint
        self.shards.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            final = self.out_dir / "model.safetensors"
            self.shards[0][0].rename(final)
            renamed(self.shards[0][0], final)
            return [final]
        weight_map, paths = {}, []
        for i, (tmp, keys) in enumerate(self.shards, start=1):
            final = self.out_dir / f"model-{i:05d}-of-{n:05d}.safetensors"
            tmp.rename(final)
            renamed(tmp, final)
            paths.append(final)
            weight_map.update((k, final.name) for k in keys)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return paths
