"""The precomputed reference's cache (mtune.training.reference_cache): a directory it cannot write to is one line
before the reference's pass, not a traceback after it."""

import pytest
import torch

from mtune.config.errors import ConfigError
from mtune.training.reference_cache import cached_reference_logps


def _logps(start: int, end: int) -> torch.Tensor:
    return torch.arange(2 * start, 2 * end, dtype=torch.float32).view(-1, 2)


def test_a_cache_dir_that_cannot_be_written_is_refused_before_anything_is_computed(tmp_path):
    computed = []

    def compute(start, end):
        computed.append((start, end))
        return _logps(start, end)

    (tmp_path / "a_file").write_text("not a directory")
    for where in (tmp_path / "a_file", tmp_path / "a_file" / "cache"):
        with pytest.raises(ConfigError, match=rf"^reference_cache_dir={where}: cannot write there \("):
            cached_reference_logps(where, "train", {"data": "x"}, 4, compute)
    assert computed == []
    assert torch.equal(cached_reference_logps(tmp_path / "cache", "train", {"data": "x"}, 4, compute), _logps(0, 4))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")) == []  # no probe left


def _fingerprint_by_hand(checkpoint_dir, described, names):
    """model_fingerprint's documented hash, written out: sha256 of the sorted-keys JSON of ``described``, then per
    weight/config file (sorted by name) its name and size and its bytes, for a file over 64 MiB its first, last and
    14 evenly spaced 1 MiB blocks; the first 32 hex digits."""
    import hashlib
    import json

    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode())
    for name in sorted(names):
        data = (checkpoint_dir / name).read_bytes() if (checkpoint_dir / name).stat().st_size <= 64 << 20 else None
        size = (checkpoint_dir / name).stat().st_size
        digest.update(f"{name}\n{size}\n".encode())
        if data is not None:
            digest.update(data)
            continue
        with open(checkpoint_dir / name, "rb") as f:
            for i in range(16):
                f.seek((size - (1 << 20)) * i // 15)
                digest.update(f.read(1 << 20))
    return digest.hexdigest()[:32]


def test_the_model_fingerprint_hashes_names_sizes_and_contents(tmp_path):
    """Oracle: the hash written out from model_fingerprint's docstring. Only weight / config / tokenizer files count
    (not README.md, not a folder); a file over 64 MiB (sparse here, 64 MiB + 4 KiB) is hashed by 16 sampled 1 MiB
    blocks, the last ending at its last byte. A byte changed in place in a small safetensors file, or in the big
    file's last byte, changes it; without a checkpoint the hash is of ``described`` alone. Mutations seen failing:
    ``.safetensors`` left out of the suffixes; names and sizes not hashed; small files' bytes not hashed; blocks at
    ``block * i`` (the first 16 MiB); 15 blocks; the whole-file limit at 64 GiB; ``described`` not hashed."""
    from mtune.training.reference_cache import model_fingerprint

    described = {"family": "llama3_1", "seed": 0}
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 10)
    (tmp_path / "config.json").write_text('{"hidden_size": 256}')
    (tmp_path / "README.md").write_text("ignored")
    (tmp_path / "sub.json").mkdir()
    with open(tmp_path / "big.safetensors", "wb") as f:
        f.truncate((64 << 20) + 4096)
    names = ["model.safetensors", "config.json", "big.safetensors"]
    first = model_fingerprint(tmp_path, described)
    assert first == _fingerprint_by_hand(tmp_path, described, names) and len(first) == 32
    (tmp_path / "model.safetensors").write_bytes(b"weighTs" * 10)
    second = model_fingerprint(tmp_path, described)
    assert second == _fingerprint_by_hand(tmp_path, described, names) != first
    with open(tmp_path / "big.safetensors", "r+b") as f:
        f.seek((64 << 20) + 4095)
        f.write(b"\x01")
    assert model_fingerprint(tmp_path, described) == _fingerprint_by_hand(tmp_path, described, names) != second
    assert model_fingerprint(None, described) == _fingerprint_by_hand(tmp_path, described, [])
    assert model_fingerprint(None, {**described, "seed": 1}) != model_fingerprint(None, described)


def test_the_cache_holds_fp32_parts_and_only_the_writer_writes(tmp_path, caplog):
    """5 pairs computed in float64 come back, and are cached, as fp32 [5, 2]; a non-writer rank computes them and
    writes nothing (the directory is not even made); 0 pairs are an empty [0, 2] table with nothing computed; the
    log counts what came from the cache and what was computed. Mutations seen failing: the fp32 cast dropped; the
    part written by every rank; ``torch.zeros(0)`` for no pairs; the computed count left at 0."""
    import logging

    def compute(start, end):
        return _logps(start, end).double()

    got = cached_reference_logps(tmp_path / "reader", "train", {"data": "x"}, 5, compute, writer=False)
    assert got.dtype == torch.float32 and torch.equal(got, _logps(0, 5))
    assert not (tmp_path / "reader").exists()
    with caplog.at_level(logging.INFO, logger="mtune.training.reference_cache"):
        got = cached_reference_logps(tmp_path / "cache", "train", {"data": "x"}, 5, compute)
    assert got.dtype == torch.float32 and torch.equal(got, _logps(0, 5))
    assert torch.load(tmp_path / "cache" / "train.part0.pt", weights_only=True).dtype == torch.float32
    assert f"reference log-probs (train, 5 pairs): 0 from the cache in {tmp_path / 'cache'}, 5 computed" in caplog.text
    empty = cached_reference_logps(tmp_path / "cache", "val", {"data": "x"}, 0, lambda s, e: 1 / 0)
    assert empty.shape == (0, 2)


def test_a_fingerprint_that_lost_a_key_is_named_in_the_refusal(tmp_path):
    """A cache written with a fingerprint key this run does not have (``extra``) is refused naming that key, and the
    changed ``data`` beside it. Mutation seen failing: _differences reading only the run's own keys."""
    cached_reference_logps(tmp_path, "train", {"data": "x", "extra": 1}, 2, _logps)
    with pytest.raises(ConfigError) as err:
        cached_reference_logps(tmp_path, "train", {"data": "y"}, 2, _logps)
    assert str(err.value) == (f"reference_cache_dir {tmp_path} holds the train reference log-probs of another run (its "
                              "data, extra differ): point reference_cache_dir elsewhere, or delete that directory to "
                              "compute them again")
