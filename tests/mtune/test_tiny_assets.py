"""The shipped tiny model, tokenizer and word-reversal data (mtune/assets/tiny), checked against transformers."""

import json

import pytest
import torch

from mtune.assets import asset_path, tiny_data_dir, tiny_model_dir
from mtune.data.word_reversal import PROMPT_TEMPLATE, WORDS
from mtune.tokenizers import Message, load_tokenizer


def _rows(name):
    return [json.loads(line) for line in (tiny_data_dir() / name).read_text().splitlines()]


def test_paths_and_config_resolver(tmp_path):
    from mtune.config.loading import load_config

    assert (tiny_model_dir() / "config.json").is_file()
    assert {p.name for p in tiny_data_dir().iterdir()} == {"train.jsonl", "eval.jsonl", "preference_train.jsonl",
                                                           "preference_eval.jsonl"}
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model:\n  checkpoint_dir: ${mtune_asset:tiny/model}\n")
    assert load_config(cfg_file).model.checkpoint_dir == str(tiny_model_dir())
    with pytest.raises(FileNotFoundError, match="'tiny/nope' not found.*shipped: tiny/data, tiny/model"):
        asset_path("tiny/nope")


def test_size_and_config():
    files = {p.name: p.stat().st_size for p in tiny_model_dir().iterdir()}
    assert set(files) == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
                          "tokenizer.json", "tokenizer_config.json"}
    assert sum(files.values()) <= 10 * 2**20
    config = json.loads((tiny_model_dir() / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 768
    # NF4-friendly: every linear weight's element count divisible by 32768 (2-rank FSDP split of 16384 blocks).
    h, kv = config["hidden_size"], config["num_key_value_heads"] * config["head_dim"]
    for numel in (h * h, h * kv, h * config["intermediate_size"], h * config["vocab_size"]):
        assert numel % 32768 == 0


def test_mtune_and_transformers_logits_match():
    from transformers import AutoModelForCausalLM

    from mtune.training.checkpointing.hf import load_model_from_hf

    tok = load_tokenizer(tiny_model_dir())
    ids = tok.tokenize_messages([Message("user", "Reverse the words: apple moon zebra")],
                                add_generation_prompt=True).tokens
    ours = load_model_from_hf(tiny_model_dir(), dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = ours(x), theirs(x).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert a.abs().max() > 1  # a trained model, not zeros


def test_tokenizer_round_trip_and_matches_transformers():
    from transformers import AutoTokenizer

    tok = load_tokenizer(tiny_model_dir())
    assert tok.family == "llama3" and tok.vocab_size == 768 and tok.num_base_tokens == 512
    for word in WORDS:  # every task word is one token, at a line start and after a space
        assert len(tok.encode_text(word)) == 1 and len(tok.encode_text(" " + word)) == 1
    hf = AutoTokenizer.from_pretrained(tiny_model_dir())
    for row in _rows("eval.jsonl")[:20]:
        for text in (row["instruction"], row["output"]):
            assert tok.decode(tok.encode_text(text)) == text
        messages = [Message("user", row["instruction"]), Message("assistant", row["output"])]
        ours = tok.tokenize_messages(messages).tokens
        theirs = hf.apply_chat_template([m.__dict__ for m in messages], tokenize=True, return_dict=False)
        assert ours == list(theirs)


def test_task_data_disjoint_exact_reversals():
    train, evals = _rows("train.jsonl"), _rows("eval.jsonl")
    assert (len(train), len(evals)) == (2000, 100)
    prefix = PROMPT_TEMPLATE.format(words="")
    for row in train + evals:
        assert set(row) == {"instruction", "output"} and row["instruction"].startswith(prefix)
        words = row["instruction"][len(prefix):].split(" ")
        assert len(words) == 3 and len(set(words)) == 3 and set(words) <= set(WORDS)
        assert row["output"] == " ".join(reversed(words))
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in evals}
    assert len({r["instruction"] for r in train}) == 2000


def test_chat_warmup_examples_are_never_reversal():
    import random

    from mtune.data.word_reversal import chat_warmup_example

    rng, kinds = random.Random(0), set()
    for _ in range(500):
        row = chat_warmup_example(rng)
        question, words = row["instruction"].split(": ")
        words = words.split(" ")
        kinds.add(question.split(" ")[0])
        assert not row["instruction"].startswith(PROMPT_TEMPLATE.format(words=""))
        if question == "Repeat the words":
            assert row["output"] == " ".join(words)
        elif question.startswith("What is the"):
            assert row["output"] == words[0 if "first" in question else -1]
        else:  # "Which word comes before X" / "after X": the neighbour of X in the list
            x, step = question.split(" ")[-1], -1 if "before" in question else 1
            assert row["output"] == words[words.index(x) + step]
    assert kinds == {"Repeat", "What", "Which"}


def test_preference_pairs_are_the_task_rows_with_a_wrong_answer():
    """preference_{train,eval}.jsonl are `preference_split` of the first 1024 train rows and the 100 eval rows: the
    chosen answer the exact reversal, the rejected one the given order or the reversal with two neighbours swapped."""
    from mtune.data.word_reversal import preference_split

    for name, source, n, seed in (("train", "train.jsonl", 1024, 1), ("eval", "eval.jsonl", 100, 2)):
        pairs = _rows(f"preference_{name}.jsonl")
        assert pairs == preference_split(_rows(source)[:n], seed)
        for pair in pairs:
            words = pair["chosen"].split()
            assert pair["rejected"] != pair["chosen"] and sorted(pair["rejected"].split()) == sorted(words)
        kinds = {pair["rejected"] == " ".join(reversed(pair["chosen"].split())) for pair in pairs}
        assert kinds == {True, False}  # both kinds of wrong answer
