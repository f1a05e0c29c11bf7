import pytest

from tests._helpers.recipes import write_instruct_data, write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama 3.1-shaped model (untied, 2 layers) with a Llama 3 tokenizer."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    return write_instruct_data(tmp_path_factory.mktemp("data") / "train.jsonl")
