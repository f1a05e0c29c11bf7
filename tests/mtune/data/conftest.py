import pytest

from tests._helpers.data import tiny_tokenizer


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("MTUNE_CACHE_DIR", str(tmp_path / "mtune-cache"))


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The tiny Llama 3 tokenizer (tiktoken), max_seq_len 64."""
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))
