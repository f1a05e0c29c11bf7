"""Phi-4 (14B) beside Phi-4-mini: both of Phi-4's published templates, its special ids, and the checkpoints whose
format mtune does not render (Phi-4-reasoning's template, Phi-3 / Phi-3.5's tokenizer) refused in one line."""

import json
import shutil

import pytest

from mtune.tokenizers import Message, detect_tokenizer, load_tokenizer
from mtune.tokenizers.base import TokenizerError
from tests._helpers.tokenizers import CONVERSATIONS, PHI4_FIRST_CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")


def with_template(directory, tmp_path, template):
    copy = shutil.copytree(directory, tmp_path / "copy")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return copy


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_first_release_template_renders_the_same_ids(name, tokenizer_dirs, tmp_path):
    """Phi-4's first template opened the reply's header inside each user turn; for conversations that alternate
    user and assistant it gives the ids of the current one, the generation prompt included."""
    hf = transformers.AutoTokenizer.from_pretrained(with_template(tokenizer_dirs["phi4"], tmp_path,
                                                                  PHI4_FIRST_CHAT_TEMPLATE))
    tok = load_tokenizer(tokenizer_dirs["phi4"])
    messages = CONVERSATIONS[name]
    text = hf.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False)
    full = tok.tokenize_messages([Message(*m) for m in messages])
    assert full.tokens == hf(text, add_special_tokens=False)["input_ids"]
    prompt = hf.apply_chat_template([{"role": r, "content": c} for r, c in messages[:-1]], tokenize=False)
    ours = tok.tokenize_messages([Message(*m) for m in messages[:-1]], add_generation_prompt=True)
    assert ours.tokens == hf(prompt, add_special_tokens=False)["input_ids"] == full.tokens[: len(ours.tokens)]
    assert ours.trained == full.trained[: len(ours.tokens)] and not ours.trained[-1]


def test_special_ids(tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["phi4"]), hf_tokenizers["phi4"]
    assert tok.bos_id is None and tok.eos_id == tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>") == 500
    assert tok.end_of_turn_id == hf.convert_tokens_to_ids(hf.eos_token) == 502  # <|im_end|>, the hub's eos
    assert tok.stop_tokens == [500, 502] and tok.vocab_size == len(hf) == 505
    # A trained reply ends with <|im_end|>; the header before it is not trained.
    result = tok.tokenize_messages([Message("user", "hi"), Message("assistant", "hello")])
    first = result.trained.index(True)
    assert result.tokens[first - 1] == hf.convert_tokens_to_ids("<|im_sep|>") and result.tokens[-1] == 502
    assert all(result.trained[first:])


def test_reasoning_template_is_refused_naming_its_file(tokenizer_dirs, tmp_path):
    template = ("<|im_start|>system<|im_sep|>Think first: <think> {Thought} </think> {Solution}<|im_end|>"
                "{% for message in messages %}{{'<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] "
                "+ '<|im_end|>'}}{% endfor %}")
    copy = with_template(tokenizer_dirs["phi4"], tmp_path, template)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: a Phi-4-reasoning chat template"):
        load_tokenizer(copy)


def test_phi3_tokenizer_is_refused(tokenizer_dirs, tmp_path):
    """Phi-3 / Phi-3.5 share the phi3 model type and Phi-4-mini's role tokens but not its format: not read."""
    copy = shutil.copytree(tokenizer_dirs["phi4_mini"], tmp_path / "phi3")
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["added_tokens"].append({**spec["added_tokens"][0], "id": 505, "content": "<s>"})
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: a Phi-3 / Phi-3\.5 tokenizer\.json"):
        detect_tokenizer(copy)
    assert detect_tokenizer(tokenizer_dirs["phi4_mini"])[0] == "phi4_mini"
