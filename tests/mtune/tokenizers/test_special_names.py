"""Llama 3 special-token names come from the checkpoint's files, as transformers reads them."""

import json
import shutil

import pytest

from mtune.tokenizers import load_tokenizer
from mtune.tokenizers.base import TokenizerError
from tests._helpers.tokenizers import LLAMA3_BASE_VOCAB as BASE
from tests._helpers.tokenizers import llama3_special_token_names, write_llama3_tokenizer

SPECIAL_IDS = list(range(BASE, BASE + 256))


def _with_text(tok, ids):
    """Special ids interleaved with plain-text ids, so decode has to join names and text."""
    text = tok.encode_text(" hello world, 12345 café")
    return [i for special in ids for i in (special, *text)]


@pytest.mark.parametrize("release", ["3.2", "3.1"])
def test_decode_prints_the_checkpoints_names_like_transformers(release, tmp_path):
    from transformers import AutoTokenizer

    write_llama3_tokenizer(tmp_path, release=release)
    tok, hf = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert tok.special_token_sources == [tmp_path / "tokenizer.json"]
    ids = _with_text(tok, SPECIAL_IDS)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    names = [tok.decode([i], skip_special_tokens=False) for i in SPECIAL_IDS]
    assert names == llama3_special_token_names(release) == hf.convert_ids_to_tokens(SPECIAL_IDS)
    if release == "3.2":  # Llama 3.2's real layout, where the generated names were wrong
        assert names[5] == "<|step_id|>"
        assert names[11] == "<|reserved_special_token_2|>" and names[255] == "<|reserved_special_token_246|>"
    # The ids are positions, whatever the names.
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.eom_id, tok.eot_id) == (BASE, BASE + 1, BASE + 4, BASE + 8,
                                                                            BASE + 9)


def test_names_from_tokenizer_config_when_tokenizer_json_is_absent(tmp_path):
    write_llama3_tokenizer(tmp_path, release="3.2")
    added = json.loads((tmp_path / "tokenizer.json").read_text())["added_tokens"]
    (tmp_path / "tokenizer.json").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.special_token_sources == [tmp_path / "tokenizer_config.json"]
    assert [tok.decode([i], skip_special_tokens=False) for i in SPECIAL_IDS] == llama3_special_token_names("3.2")


def test_bare_rank_file_gets_the_generated_llama3_1_names(tmp_path):
    write_llama3_tokenizer(tmp_path / "model", release="3.2")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tmp_path / "model" / "original" / "tokenizer.model", bare / "tokenizer.model")
    tok = load_tokenizer(bare / "tokenizer.model")
    assert tok.special_token_sources == []
    assert [tok.decode([i], skip_special_tokens=False) for i in SPECIAL_IDS] == llama3_special_token_names("3.1")


def test_tokenizer_json_of_another_layout_is_refused(tmp_path):
    write_llama3_tokenizer(tmp_path, release="3.2")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"][9]["content"] = "<|im_end|>"  # +9 must be <|eot_id|>
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=rf"id {BASE + 9} is '<\|im_end\|>'.*<\|eot_id\|>"):
        load_tokenizer(tmp_path)
