import pytest

from tests._helpers.tokenizers import FAMILIES, write_tokenizer_files

# Conversations rendered by every family. Texts avoid control-token spellings (Hugging Face turns those into
# control tokens; mtune deliberately does not, tested separately) and use the whitespace the templates normalise.
CONVERSATIONS = {
    "single": [("user", "hello world, what is 12345 + 6?"), ("assistant", "It's 12351.")],
    "system": [("system", "Be brief and exact."), ("user", "Name a café in 東京."),
               ("assistant", "  Über café 🙂  "), ("user", "another one\nplease"),
               ("assistant", "naïve data\n\nmemory")],
    "multi": [("user", " we're  fine tuning a llama "), ("assistant", "The model learns."),
              ("user", "don't stop"), ("assistant", "I'll go on:\n- rank 8\n- batch 4")],
}


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
