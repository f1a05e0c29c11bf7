"""The run's tokenizer: ``tokenizer.path``, else the model's checkpoint directory, else one line naming the key."""

import pytest

from mtune.errors import PathNotFoundError
from mtune.tokenizers import load_tokenizer
from mtune.training.data_setup import setup_tokenizer
from tests._helpers.tokenizers import write_tokenizer_files

TEXT = "red green blue cat dog sun moon tree rock bird fish star"


def test_setup_tokenizer_reads_tokenizer_path_else_the_checkpoint_and_keeps_max_seq_len(tmp_path):
    """Mutations seen failing: ignoring ``path`` (the checkpoint's Llama 2 files are read); ignoring
    ``max_seq_len`` (the text is not cut)."""
    write_tokenizer_files(tmp_path / "checkpoint", "llama2")
    write_tokenizer_files(tmp_path / "own", "llama3")
    expected = load_tokenizer(tmp_path / "own").encode(TEXT)
    assert setup_tokenizer({"path": str(tmp_path / "own"), "max_seq_len": None},
                           tmp_path / "checkpoint").encode(TEXT) == expected
    assert expected != load_tokenizer(tmp_path / "checkpoint").encode(TEXT)
    from_checkpoint = setup_tokenizer({"path": None, "max_seq_len": 4}, tmp_path / "checkpoint").encode(TEXT)
    assert from_checkpoint == load_tokenizer(tmp_path / "checkpoint", max_seq_len=4).encode(TEXT)
    assert len(from_checkpoint) == 4 < len(load_tokenizer(tmp_path / "checkpoint").encode(TEXT))
    with pytest.raises(PathNotFoundError, match="tokenizer.path is not set"):
        setup_tokenizer(None, None)  # random weights (model.size) and no tokenizer.path


def test_tokenizer_options_reach_the_familys_tokenizer_and_a_foreign_one_is_refused(tmp_path):
    """``tokenizer.options`` are the family's own settings: gpt-oss's ``reasoning_effort`` and ``current_date`` change
    its system message as its tokenizer renders them given directly; an option the family does not take is refused
    by name. Mutation seen failing: options not passed on (the system message keeps ``Reasoning: medium``)."""
    from omegaconf import OmegaConf

    from mtune.tokenizers import Message

    write_tokenizer_files(tmp_path / "gpt_oss", "gpt_oss")
    options = {"reasoning_effort": "high", "current_date": "2026-01-02"}
    node = OmegaConf.create({"path": str(tmp_path / "gpt_oss"), "max_seq_len": None, "options": options})
    tokenizer = setup_tokenizer(node, None)
    conversation = [Message("user", "hi"), Message("assistant", "hello")]
    ids = tokenizer.tokenize_messages(conversation).tokens
    assert ids == load_tokenizer(tmp_path / "gpt_oss", **options).tokenize_messages(conversation).tokens
    text = tokenizer.decode(ids)
    assert "Reasoning: high" in text and "Current date: 2026-01-02" in text
    with pytest.raises(ValueError, match="enable_thinking does not apply to the gpt_oss tokenizer"):
        setup_tokenizer({"path": str(tmp_path / "gpt_oss"), "options": {"enable_thinking": False}}, None)
