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
