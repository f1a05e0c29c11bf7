"""mtune's ids against the underlying libraries and against transformers loading the same files."""

import pytest

from mtune.tokenizers import load_tokenizer
from tests._helpers.tokenizers import corpus

TEXTS = corpus(60, seed=1) + [
    "", " ", "  leading and trailing  ", "tabs\tand\r\nnewlines\n\n\nend", "digits 1234567890 and 3.14159",
    "naïve café über 東京 数据 🙂🙂", "it's THEY'VE we'RE", "x" * 300, "unseen bytes: \x00\x7f ☃ Ω",
]
SPELLED_SPECIALS = ("<|eot_id|>", "<|im_end|>", "[INST]", "<s>")


@pytest.mark.parametrize("family", ["llama2", "llama3", "mistral", "qwen2", "qwen3", "phi4", "phi4_mini", "gemma3",
                                    "gemma4", "gpt_oss"])
def test_ids_match_transformers_and_round_trip(family, tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs[family]), hf_tokenizers[family]
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False, add_eos=False)
        assert tok.decode(ids) == text, text
        # transformers turns spelled-out special tokens into control tokens (mtune does not, tested below). For
        # plain text its sentencepiece conversions differ from sentencepiece at the start of a text (Mistral's
        # adds no dummy prefix, Llama 2's merges it with leading spaces); sentencepiece is the oracle there
        # (next test) and the chat tests compare Mistral's with transformers inside conversations.
        spelled_special = any(s in text for s in SPELLED_SPECIALS)
        if spelled_special or family == "mistral" or (family == "llama2" and text[:1].isspace()):
            continue
        assert ids == hf(text, add_special_tokens=False)["input_ids"], text


def test_sentencepiece_ids_equal_sentencepiece(tokenizer_dirs):
    import sentencepiece

    for family in ("llama2", "mistral"):
        tok = load_tokenizer(tokenizer_dirs[family])
        sp = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_dirs[family] / "tokenizer.model"))
        for text in TEXTS:
            assert tok.encode(text) == [1] + sp.encode(text) + [2]
            assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))
        assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size, tok.stop_tokens) == (1, 2, 0, 500, [2])


def test_llama3_ids_equal_tiktoken_converter_and_special_ids(tokenizer_dirs, hf_tokenizers):
    # transformers' own tiktoken converter, reading the rank file, is a second oracle besides the trained BPE.
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from tests._helpers.tokenizers import llama3_special_token_names

    rank_file = tokenizer_dirs["llama3"] / "original" / "tokenizer.model"
    names = llama3_special_token_names()
    converted = PreTrainedTokenizerFast(
        tokenizer_object=TikTokenConverter(vocab_file=str(rank_file), extra_special_tokens=names).converted())
    tok, hf = load_tokenizer(tokenizer_dirs["llama3"]), hf_tokenizers["llama3"]
    for text in [t for t in TEXTS if not any(s in t for s in SPELLED_SPECIALS)]:
        assert tok.encode(text, add_bos=False, add_eos=False) == converted(text, add_special_tokens=False)["input_ids"]
    for name in names:
        assert tok.special[name] == hf.convert_tokens_to_ids(name) == converted.convert_tokens_to_ids(name), name
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (512, 513, 516, 768)
    assert tok.stop_tokens == [513, 520, 521] and tok.eot_id == 521
    assert tok.encode("hi") == [512] + converted("hi", add_special_tokens=False)["input_ids"] + [513]


def test_qwen2_special_ids(tokenizer_dirs, hf_tokenizers):
    tok, hf = load_tokenizer(tokenizer_dirs["qwen2"]), hf_tokenizers["qwen2"]
    assert tok.bos_id is None and tok.eos_id == tok.pad_id == hf.convert_tokens_to_ids("<|endoftext|>") == 500
    assert tok.end_of_turn_id == hf.convert_tokens_to_ids("<|im_end|>") == 502 and tok.vocab_size == len(hf) == 503
    assert tok.encode("hi", add_bos=True, add_eos=True) == hf("hi")["input_ids"] + [500]


@pytest.mark.parametrize("family,spelled,control", [
    ("llama3", "<|eot_id|>", "<|eot_id|>"), ("llama3", "<|begin_of_text|>", "<|begin_of_text|>"),
    ("qwen2", "<|im_end|>", "<|im_end|>"), ("qwen3", "</think>", "</think>"), ("phi4", "<|im_sep|>", "<|im_sep|>"),
    ("phi4_mini", "<|end|>", "<|end|>"),
    ("gemma3", "<end_of_turn>", "<end_of_turn>"), ("gpt_oss", "<|return|>", "<|return|>"),
    ("mistral", "[INST]", "[INST]"), ("llama2", "</s>", "</s>"),
])
def test_control_token_spelled_in_text_stays_text(family, spelled, control, tokenizer_dirs, hf_tokenizers):
    tok = load_tokenizer(tokenizer_dirs[family])
    control_id = hf_tokenizers[family].convert_tokens_to_ids(control)
    text = f"before {spelled} after"
    ids = tok.encode(text, add_bos=False, add_eos=False)
    assert control_id not in ids and tok.decode(ids) == text

    # In a conversation the control token appears exactly as often as with harmless text in its place.
    def count(content):
        turns = [{"role": "user", "content": content}, {"role": "assistant", "content": content}]
        return tok.tokenize_messages(turns).tokens.count(control_id)

    assert count(text) == count("before x after") >= 1


def test_encode_truncation_keeps_eos(tokenizer_dirs):
    for family, path in tokenizer_dirs.items():
        tok = load_tokenizer(path, max_seq_len=8)
        text = "the model learns to follow instructions and answers questions"
        full = load_tokenizer(path).encode(text)
        assert len(full) > 8
        cut = tok.encode_with_truncation(text)
        assert cut.truncated and len(cut.tokens) == 8 and cut.tokens[-1] == tok.eos_id
        assert cut.tokens[:7] == full[:7] and tok.encode(text) == cut.tokens
        assert tok.encode_with_truncation(text, add_eos=False).tokens == full[:8]
        assert not tok.encode_with_truncation("hi").truncated
