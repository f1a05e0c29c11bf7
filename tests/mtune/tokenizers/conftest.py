import pytest

from tests._helpers.tokenizers import FAMILIES, write_tokenizer_files


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory):
    """One tiny model directory per family (trained once per session, ~0.1 s each)."""
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    for family in FAMILIES:
        write_tokenizer_files(root / family, family)
        dirs[family] = root / family
    return dirs


@pytest.fixture(scope="session")
def hf_tokenizers(tokenizer_dirs):
    from transformers import AutoTokenizer

    return {family: AutoTokenizer.from_pretrained(path) for family, path in tokenizer_dirs.items()}
