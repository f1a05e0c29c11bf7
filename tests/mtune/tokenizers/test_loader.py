"""Family detection, fingerprints, lazy imports."""

import json
import shutil
import subprocess
import sys

import pytest

from mtune.errors import MtuneError, PathNotFoundError
from mtune.tokenizers import detect_tokenizer, load_tokenizer
from mtune.tokenizers.base import TokenizerError
from mtune.tokenizers.llama2 import Llama2Tokenizer
from mtune.tokenizers.llama3 import Llama3Tokenizer
from mtune.tokenizers.mistral import MistralTokenizer
from mtune.tokenizers.qwen2 import Qwen2Tokenizer
from mtune.tokenizers.gemma3 import Gemma3Tokenizer
from mtune.tokenizers.gemma4 import Gemma4Tokenizer
from mtune.tokenizers.gpt_oss import GptOssTokenizer
from mtune.tokenizers.phi4 import Phi4MiniTokenizer, Phi4Tokenizer
from mtune.tokenizers.qwen3 import Qwen3Tokenizer

CLASSES = {"llama2": Llama2Tokenizer, "llama3": Llama3Tokenizer, "mistral": MistralTokenizer,
           "qwen2": Qwen2Tokenizer, "qwen3": Qwen3Tokenizer,
           "phi4": Phi4Tokenizer, "phi4_mini": Phi4MiniTokenizer, "gemma3": Gemma3Tokenizer, "gemma4": Gemma4Tokenizer,
           "gpt_oss": GptOssTokenizer}
FILES = {"llama2": "tokenizer.model", "llama3": "original/tokenizer.model", "mistral": "tokenizer.model",
         "qwen2": "tokenizer.json", "qwen3": "tokenizer.json",
         "phi4": "tokenizer.json", "phi4_mini": "tokenizer.json", "gemma3": "tokenizer.json", "gemma4": "tokenizer.json",
         "gpt_oss": "tokenizer.json"}


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_detects_family_from_directory_and_from_file(family, tokenizer_dirs, tmp_path):
    directory = tokenizer_dirs[family]
    assert detect_tokenizer(directory) == (family, directory / FILES[family])
    assert type(load_tokenizer(directory)) is CLASSES[family]
    # A lone file: its kind is read from its contents.
    assert type(load_tokenizer(directory / FILES[family])) is CLASSES[family]
    # A directory without config.json: found by its files.
    bare = shutil.copytree(directory, tmp_path / "bare")
    (bare / "config.json").unlink()
    assert detect_tokenizer(bare)[0] == family


def test_llama3_from_tokenizer_json_alone(tokenizer_dirs, tmp_path):
    # A Hub download without original/: the ranks come from tokenizer.json and the ids are the same.
    hub = shutil.copytree(tokenizer_dirs["llama3"], tmp_path / "hub")
    shutil.rmtree(hub / "original")
    assert detect_tokenizer(hub) == ("llama3", hub / "tokenizer.json")
    from_json, from_ranks = load_tokenizer(hub), load_tokenizer(tokenizer_dirs["llama3"])
    text = "Name a café in 東京, it's 12345 <|eot_id|>\n\n"
    assert from_json.encode(text) == from_ranks.encode(text)
    assert from_json.special == from_ranks.special and from_json.vocab_size == 768


def test_llama_model_type_with_sentencepiece_is_llama2(tokenizer_dirs, tmp_path):
    # A tiktoken file named tokenizer.model at the top level is Llama 3 too.
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(tokenizer_dirs["llama3"] / "original" / "tokenizer.model", flat / "tokenizer.model")
    (flat / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert detect_tokenizer(flat)[0] == "llama3"
    assert json.loads((tokenizer_dirs["llama2"] / "config.json").read_text())["model_type"] == "llama"
    assert detect_tokenizer(tokenizer_dirs["llama2"])[0] == "llama2"


def test_clear_errors(tokenizer_dirs, tmp_path):
    # Each is an MtuneError (the CLI prints it as one line) and still the built-in error it refines.
    assert issubclass(TokenizerError, MtuneError) and issubclass(TokenizerError, ValueError)
    assert issubclass(PathNotFoundError, MtuneError) and issubclass(PathNotFoundError, FileNotFoundError)
    with pytest.raises(PathNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(TokenizerError, match="model_type 'gpt2' has no mtune tokenizer"):
        load_tokenizer(gpt)
    # A Llama 2 sentencepiece model given as Mistral: no [INST] control tokens.
    fake = shutil.copytree(tokenizer_dirs["llama2"], tmp_path / "fake_mistral")
    (fake / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(TokenizerError, match=r"no \[INST\]/\[/INST\] control tokens"):
        load_tokenizer(fake)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PathNotFoundError, match="no config.json and no tokenizer"):
        load_tokenizer(empty)


LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:4d2b4f0a\nsize 2183982\n"


@pytest.mark.parametrize("family, file", [("llama2", "tokenizer.model"), ("mistral", "tokenizer.model"),
                                          ("llama3", "original/tokenizer.model"), ("qwen2", "tokenizer.json"),
                                          ("qwen2", "tokenizer_config.json"), ("gemma3", "config.json")])
def test_a_file_the_libraries_cannot_read_is_named(family, file, tokenizer_dirs, tmp_path):
    """A Git LFS pointer (a clone without git-lfs) or a file cut short: one line naming the file, where the libraries
    raised a traceback (sentencepiece's RuntimeError, json's JSONDecodeError naming no file)."""
    for name, text in (("lfs", LFS_POINTER), ("cut", '{"version": "1.0", "added_tokens": [')):
        model = shutil.copytree(tokenizer_dirs[family], tmp_path / f"{family}_{name}")
        (model / file).write_text(text)
        expected = "a Git LFS pointer, not the file itself" if name == "lfs" else (
            "not valid JSON" if file.endswith(".json") else "not a sentencepiece model")
        with pytest.raises(TokenizerError, match=f"^{model / file}: {expected}"):
            load_tokenizer(model)


def test_fingerprint_is_stable_and_tells_tokenizers_apart(tokenizer_dirs, tmp_path):
    prints = {family: load_tokenizer(path).fingerprint() for family, path in tokenizer_dirs.items()}
    assert len(set(prints.values())) == len(prints)
    copy = shutil.copytree(tokenizer_dirs["qwen2"], tmp_path / "copy")
    assert load_tokenizer(copy, max_seq_len=16).fingerprint() == prints["qwen2"]  # files, not paths or lengths
    # The same sentencepiece file read as another family would tokenize chats differently.
    assert Llama2Tokenizer(tokenizer_dirs["mistral"] / "tokenizer.model").fingerprint() != prints["mistral"]


def test_model_helper_config_is_kept(tmp_path):
    from tests._helpers.tokenizers import write_tokenizer_files

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 1024, "hidden_size": 256}))
    assert write_tokenizer_files(tmp_path, "qwen2") == 503
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == 1024 and config["hidden_size"] == 256 and config["eos_token_id"] == 502


def test_importing_mtune_tokenizers_is_light():
    code = ("import sys, mtune.tokenizers; "
            "print(sorted(m for m in ('torch', 'tiktoken', 'sentencepiece', 'tokenizers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
