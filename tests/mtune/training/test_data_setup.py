"""The run's tokenizer: ``tokenizer.path``, else the model's checkpoint directory, else one line naming the key;
refused in one line when its ids do not fit the model's embedding."""

import dataclasses

import pytest

from mtune.config import ConfigError
from mtune.errors import PathNotFoundError
from mtune.tokenizers import load_tokenizer
from mtune.training.data_setup import setup_tokenizer
from mtune.training.model_setup import ModelSource, resolve_model_source
from tests._helpers.tokenizers import write_tokenizer_files

TEXT = "red green blue cat dog sun moon tree rock bird fish star"


def source(checkpoint_dir=None, vocab_size=1024) -> ModelSource:
    """The tiny model's source with ``vocab_size`` embedding rows (the fixture tokenizers have 500 to 768 ids)."""
    tiny = resolve_model_source({"family": "tiny", "size": "tiny"})
    return ModelSource(tiny.family, dataclasses.replace(tiny.args, vocab_size=vocab_size), checkpoint_dir)


def test_setup_tokenizer_reads_tokenizer_path_else_the_checkpoint_and_keeps_max_seq_len(tmp_path):
    """Mutations seen failing: ignoring ``path`` (the checkpoint's Llama 2 files are read); ignoring
    ``max_seq_len`` (the text is not cut)."""
    write_tokenizer_files(tmp_path / "checkpoint", "llama2")
    write_tokenizer_files(tmp_path / "own", "llama3")
    expected = load_tokenizer(tmp_path / "own").encode(TEXT)
    assert setup_tokenizer({"path": str(tmp_path / "own"), "max_seq_len": None},
                           source(tmp_path / "checkpoint")).encode(TEXT) == expected
    assert expected != load_tokenizer(tmp_path / "checkpoint").encode(TEXT)
    from_checkpoint = setup_tokenizer({"path": None, "max_seq_len": 4}, source(tmp_path / "checkpoint")).encode(TEXT)
    assert from_checkpoint == load_tokenizer(tmp_path / "checkpoint", max_seq_len=4).encode(TEXT)
    assert len(from_checkpoint) == 4 < len(load_tokenizer(tmp_path / "checkpoint").encode(TEXT))
    with pytest.raises(PathNotFoundError, match="tokenizer.path is not set"):
        setup_tokenizer(None, source())  # random weights (model.size) and no tokenizer.path


def test_tokenizer_options_reach_the_familys_tokenizer_and_a_foreign_one_is_refused(tmp_path):
    """``tokenizer.options`` are the family's own settings: gpt-oss's ``reasoning_effort`` and ``current_date`` change
    its system message as its tokenizer renders them given directly; an option the family does not take is refused
    by name. Mutation seen failing: options not passed on (the system message keeps ``Reasoning: medium``)."""
    from omegaconf import OmegaConf

    from mtune.tokenizers import Message

    write_tokenizer_files(tmp_path / "gpt_oss", "gpt_oss")
    options = {"reasoning_effort": "high", "current_date": "2026-01-02"}
    node = OmegaConf.create({"path": str(tmp_path / "gpt_oss"), "max_seq_len": None, "options": options})
    tokenizer = setup_tokenizer(node, source())
    conversation = [Message("user", "hi"), Message("assistant", "hello")]
    ids = tokenizer.tokenize_messages(conversation).tokens
    assert ids == load_tokenizer(tmp_path / "gpt_oss", **options).tokenize_messages(conversation).tokens
    text = tokenizer.decode(ids)
    assert "Reasoning: high" in text and "Current date: 2026-01-02" in text
    with pytest.raises(ValueError, match="enable_thinking does not apply to the gpt_oss tokenizer"):
        setup_tokenizer({"path": str(tmp_path / "gpt_oss"), "options": {"enable_thinking": False}}, source())


def test_a_tokenizer_with_more_ids_than_the_models_embedding_is_refused_in_one_line(tmp_path):
    """The fixture's Llama 3 tokenizer has 768 ids; a model of 512 embedding rows would fail in its first forward
    (an index error inside the embedding) once a higher id came, so setup refuses the pair, naming both sizes and
    the tokenizer; 768 rows take it. Mutation seen failing: the check against the model's rows left out."""
    write_tokenizer_files(tmp_path / "llama3", "llama3")
    node = {"path": str(tmp_path / "llama3")}
    with pytest.raises(ConfigError) as refused:
        setup_tokenizer(node, source(vocab_size=512))
    assert str(refused.value) == (f"tokenizer.path={tmp_path / 'llama3'}: 768 token ids, more than the 512 rows of the "
                                  "model's embedding (tiny with random weights); use the tokenizer the model was "
                                  "trained with")
    assert setup_tokenizer(node, source(vocab_size=768)).vocab_size == 768
    # from a checkpoint, its config.json's vocab_size may be what is wrong (weights of 768 rows): said too
    with pytest.raises(ConfigError) as refused:
        setup_tokenizer(node, source(vocab_size=512, checkpoint_dir="/ckpt"))
    assert str(refused.value).endswith("rows of the model's embedding (vocab_size in model.checkpoint_dir=/ckpt's "
                                       "config.json); use the tokenizer the model was trained with, or mend "
                                       "config.json if its vocab_size is not the weights'")


def test_a_data_error_names_the_node_it_came_from(tmp_path):
    """dataset and dataset_val may name files alike: "source='x': no such file" did not say which node."""
    from omegaconf import OmegaConf

    from mtune.data import DataError
    from mtune.training.data_setup import setup_data

    write_tokenizer_files(tmp_path / "tok", "llama3")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"instruction": "a", "output": "b"}\n')
    node = {"_component_": "mtune.data.instruct_dataset", "source": str(rows), "cache": False}
    cfg = OmegaConf.create({"dataset": node, "dataset_val": {**node, "source": str(tmp_path / "nope.jsonl")},
                            "batch_size": 1, "seed": 0, "gradient_accumulation_steps": 1, "epochs": 1})
    with pytest.raises(DataError, match=r"^dataset_val: source='.*nope\.jsonl': no such file or directory$"):
        setup_data(cfg, load_tokenizer(str(tmp_path / "tok")))


def test_a_tokenizer_of_another_family_than_the_models_is_refused(tmp_path):
    """A Llama 2 tokenizer on a Llama 3 model trained without a word, on the wrong ids (a loss of 9.6 against 2.5
    in the audit's run); a Qwen2 one failed later as 'every sample fully masked'. Phi-4 reads both its tokenizers."""
    from mtune.models import model_args

    write_tokenizer_files(tmp_path / "llama2", "llama2")
    write_tokenizer_files(tmp_path / "llama3", "llama3")
    llama3 = ModelSource("llama3_1", model_args("llama3_1", "tiny", vocab_size=1024), None)
    with pytest.raises(ConfigError) as refused:
        setup_tokenizer({"path": str(tmp_path / "llama2")}, llama3)
    assert str(refused.value) == (f"tokenizer.path={tmp_path / 'llama2'}: a llama2 tokenizer, but the model is "
                                  "llama3_1, trained on llama3 token ids; use the tokenizer the model was trained "
                                  "with (null: the one in model.checkpoint_dir)")
    assert setup_tokenizer({"path": str(tmp_path / "llama3")}, llama3).family == "llama3"
    assert setup_tokenizer({"path": str(tmp_path / "llama2")}, source()).family == "llama2"  # tiny: any
