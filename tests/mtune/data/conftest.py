import pytest

from tests._helpers.data import ByteChatTokenizer


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("MTUNE_CACHE_DIR", str(tmp_path / "mtune-cache"))


@pytest.fixture
def tok():
    return ByteChatTokenizer(max_seq_len=64)
