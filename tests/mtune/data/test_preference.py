"""Preference pairs: every layout gives the same tokens through the chat format, only the final response is
labelled, bad rows are named with their row, Parquet reads like JSONL, and a batch holds chosen rows then rejected."""

import json

import pytest
import torch

from mtune.data import DataError, build_dataloader, preference_dataset
from mtune.tokenizers import Message


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


STRINGS = {"prompt": "reverse: red cat", "chosen": "cat red", "rejected": "red cat"}
MESSAGES = {"chosen": [{"role": "user", "content": "reverse: red cat"}, {"role": "assistant", "content": "cat red"}],
            "rejected": [{"role": "user", "content": "reverse: red cat"}, {"role": "assistant", "content": "red cat"}]}
PROMPT_LIST = {"prompt": [{"role": "user", "content": "reverse: red cat"}],
               "chosen": [{"role": "assistant", "content": "cat red"}], "rejected": "red cat"}


def test_layouts_agree_and_only_the_response_is_labelled(tok, tmp_path):
    samples = []
    for i, row in enumerate((STRINGS, MESSAGES, PROMPT_LIST)):
        ds = preference_dataset(tok, _jsonl(tmp_path / f"{i}.jsonl", [row]))
        samples.append(ds[0])
    assert samples[0] == samples[1] == samples[2]
    pair = samples[0]
    full = tok.tokenize_messages([Message("user", "reverse: red cat"), Message("assistant", "cat red")]).tokens
    prompt = tok.tokenize_messages([Message("user", "reverse: red cat")], add_generation_prompt=True).tokens
    assert pair["chosen"]["tokens"] == full
    labelled = [i for i, label in enumerate(pair["chosen"]["labels"]) if label != -100]
    assert labelled[0] == len(prompt) - 1  # the first response token is predicted from the prompt's last
    assert [pair["chosen"]["labels"][i] for i in labelled] == full[len(prompt):]


def test_earlier_assistant_turns_of_a_shared_prefix_are_not_labelled(tok, tmp_path):
    prefix = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "reverse: red cat"}]
    row = {"chosen": prefix + [{"role": "assistant", "content": "cat red"}],
           "rejected": prefix + [{"role": "assistant", "content": "red cat"}]}
    pair = preference_dataset(tok, _jsonl(tmp_path / "p.jsonl", [row]))[0]
    prompt = tok.tokenize_messages([Message(m["role"], m["content"]) for m in prefix],
                                   add_generation_prompt=True).tokens
    first = next(i for i, label in enumerate(pair["rejected"]["labels"]) if label != -100)
    assert first == len(prompt) - 1


@pytest.mark.parametrize("row,message", [
    ({"prompt": "p", "chosen": "a"}, "line 2: missing field 'rejected'"),
    ({"prompt": "p", "chosen": "a", "rejected": "a"}, "line 2: chosen and rejected are identical"),
    ({"prompt": "p", "chosen": " ", "rejected": "b"}, "line 2: the chosen response is empty"),
    ({"chosen": "a", "rejected": "b"}, "line 2: missing field 'prompt'"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]},
     "line 2: chosen and rejected must be message lists that share every message but the last"),
])
def test_bad_rows_are_named(tok, tmp_path, row, message):
    with pytest.raises(DataError, match=message):
        preference_dataset(tok, _jsonl(tmp_path / "bad.jsonl", [STRINGS, row]))


def test_parquet_and_column_map(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["reverse: red cat"], "good": ["cat red"], "bad": ["red cat"]}),
                   tmp_path / "p.parquet")
    ds = preference_dataset(tok, str(tmp_path / "p.parquet"),
                            column_map={"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert ds[0] == preference_dataset(tok, _jsonl(tmp_path / "s.jsonl", [STRINGS]))[0]
    with pytest.raises(DataError, match="'answer' is not a column preference_dataset reads"):
        preference_dataset(tok, str(tmp_path / "p.parquet"), column_map={"answer": "good"})


def test_a_batch_is_chosen_rows_then_rejected_rows(tok, tmp_path):
    rows = [dict(STRINGS, chosen="cat red" + " cat" * i) for i in range(3)]
    ds = preference_dataset(tok, _jsonl(tmp_path / "p.jsonl", rows))
    batch = next(iter(build_dataloader(ds, 3, seed=0, shuffle=False)))
    assert batch["tokens"].shape[0] == 6 and batch["pair_index"].tolist() == [0, 1, 2]
    assert batch["pairs_of"] == ds.fingerprint
    for i in range(3):
        n = len(ds[i]["chosen"]["tokens"])
        assert batch["tokens"][i, :n].tolist() == ds[i]["chosen"]["tokens"]
        assert batch["tokens"][3 + i, :len(ds[i]["rejected"]["tokens"])].tolist() == ds[i]["rejected"]["tokens"]
        assert (batch["labels"][i, n:] == -100).all()  # padding is not labelled
    other = preference_dataset(tok, _jsonl(tmp_path / "q.jsonl", rows[:2]))
    assert other.fingerprint != ds.fingerprint


def test_a_response_truncated_away_drops_its_pair(tok, tmp_path):
    long = dict(STRINGS, prompt="reverse: " + " ".join(["red cat"] * 60))
    ds = preference_dataset(tok, _jsonl(tmp_path / "p.jsonl", [STRINGS, long]), max_seq_len=32)
    assert len(ds) == 1 and ds.stats["dropped_truncated"] == 1 and ds.stats["truncated"] == 1


def test_a_pair_truncation_leaves_identical_is_dropped(tok, tmp_path):
    """Responses that differ only past max_seq_len: cut there, the two conversations are the same tokens (a zero
    margin forever, a miss in the reward accuracy). Before, the pair was kept and trained on."""
    same = " ".join(["red cat"] * 40)
    late = {"prompt": "say it", "chosen": same + " good", "rejected": same + " bad"}
    ds = preference_dataset(tok, _jsonl(tmp_path / "p.jsonl", [STRINGS, late]), max_seq_len=32)
    assert len(ds) == 1 and ds.stats["dropped_truncated"] == 1 and ds.stats["truncated"] == 1
    assert ds[0]["chosen"]["tokens"] != ds[0]["rejected"]["tokens"]


def test_whole_conversations_beside_a_prompt_column(tok, tmp_path):
    """UltraFeedback's layout: a prompt string and chosen / rejected conversations that repeat it."""
    row = dict(MESSAGES, prompt="reverse: red cat")
    assert preference_dataset(tok, _jsonl(tmp_path / "u.jsonl", [row]))[0] == \
        preference_dataset(tok, _jsonl(tmp_path / "s.jsonl", [STRINGS]))[0]


def test_a_system_column_opens_the_prompt(tok, tmp_path):
    """LLaMA-Factory's separate ``system`` column: the pair equals the same pair with that system message in its
    prompt; the prompt's own system message wins; ``column_map`` names another column; ``system_prompt`` replaces it.
    Mutation seen failing: the column not read."""
    system = {"role": "system", "content": "Reverse the words."}
    with_system = dict(PROMPT_LIST, prompt=[system, *PROMPT_LIST["prompt"]])
    expected = preference_dataset(tok, _jsonl(tmp_path / "expected.jsonl", [with_system]))[0]
    assert preference_dataset(tok, _jsonl(tmp_path / "column.jsonl", [dict(STRINGS, system=system["content"])]))[0] \
        == expected
    assert preference_dataset(tok, _jsonl(tmp_path / "own.jsonl", [dict(with_system, system="Not this.")]))[0] \
        == expected
    assert preference_dataset(tok, _jsonl(tmp_path / "mapped.jsonl", [dict(STRINGS, sys=system["content"])]),
                              column_map={"system": "sys"})[0] == expected
    replaced = preference_dataset(tok, _jsonl(tmp_path / "replaced.jsonl", [dict(STRINGS, system="Not this.")]),
                                  system_prompt=system["content"])[0]
    assert replaced == expected


@pytest.mark.parametrize("name", ["system", "tools"])
def test_a_mapped_optional_column_the_rows_lack_is_named(tok, tmp_path, name):
    """column_map naming a system or tools column that is not there (misspelt): before, every pair was built without
    its system prompt or tools."""
    with pytest.raises(DataError, match=r"p.jsonl line 1: no column 'sytem' \(column_map names it\); the row has "
                                        r"prompt, chosen, rejected, system$"):
        preference_dataset(tok, _jsonl(tmp_path / "p.jsonl", [dict(STRINGS, system="Be brief.")]),
                           column_map={name: "sytem"})


def _pairs(chosen, rejected):
    """A PreferenceDataset of hand-written pairs: ``chosen`` / ``rejected`` lists of (tokens, labels)."""
    from mtune.data.preference import PreferenceDataset
    from mtune.data.tokenized import TokenizedDataset

    def half(samples):
        offsets = torch.tensor([0] + [len(t) for t, _ in samples]).cumsum(0)
        fields = {"tokens": torch.tensor([x for t, _ in samples for x in t], dtype=torch.int32),
                  "labels": torch.tensor([x for _, l in samples for x in l], dtype=torch.int32)}
        return TokenizedDataset(fields, offsets, 0, {})

    return PreferenceDataset(half(chosen), half(rejected), pad_id=0, stats={})


CHOSEN = [([10, 11], [11, -100]), ([12, 13, 14], [13, 14, -100]), ([15], [-100])]
REJECTED = [([20], [-100]), ([21, 22], [22, -100]), ([23, 24], [24, -100])]


def test_packed_pairs_rows_and_batch_by_hand():
    """Rows of 8: pairs 0 and 1 (3 + 5 tokens) fill the first exactly, pair 2 starts the second. Each response is a
    document with positions from 0 (pair j: 2j chosen, 2j + 1 rejected); in the batch, sequence_ids number the chosen
    responses 0..n-1 and the rejected n..2n-1, and the padding -1."""
    from mtune.data.packing import pack_pairs
    from mtune.data.preference import PackedPreferenceDataset

    packed = PackedPreferenceDataset(_pairs(CHOSEN, REJECTED), row_len=8)
    assert packed.rows == [[0, 1], [2]] and packed.stats == {"packs": 2, "padding": 16 - 11}
    assert packed[0] == {"tokens": [10, 11, 20, 12, 13, 14, 21, 22],
                         "labels": [11, -100, -100, 13, 14, -100, 22, -100],
                         "input_pos": [0, 1, 0, 0, 1, 2, 0, 1], "document_ids": [0, 0, 1, 2, 2, 2, 3, 3],
                         "pairs": [0, 1]}
    batch = packed.collate_fn([packed[0], packed[1]])
    assert batch["tokens"][1].tolist() == [15, 23, 24, 0, 0, 0, 0, 0]
    assert batch["input_pos"][1].tolist() == [0, 0, 1, 0, 1, 2, 3, 4]
    assert batch["sequence_ids"].tolist() == [[0, 0, 3, 1, 1, 1, 4, 4], [2, 5, 5, -1, -1, -1, -1, -1]]
    assert batch["pair_index"].tolist() == [0, 1, 2] and int(batch["num_tokens"]) == 11
    with pytest.raises(ValueError, match=r"^pair 1: 9 tokens do not fit a packed row of 8$"):
        pack_pairs([(4, 4), (5, 4)], 8)


def test_fingerprint_changes_with_any_token_of_either_side():
    """The precomputed reference is keyed by the fingerprint: one token changed, lengths kept, on either side, is
    another dataset."""
    base = _pairs(CHOSEN, REJECTED).fingerprint
    assert base == _pairs(CHOSEN, REJECTED).fingerprint
    assert _pairs(CHOSEN, REJECTED[:2] + [([23, 25], [25, -100])]).fingerprint != base
    assert _pairs([([10, 19], [19, -100])] + CHOSEN[1:], REJECTED).fingerprint != base


def test_system_prompt_replaces_the_prompts_own_system_message(tok, tmp_path):
    """A prompt with a system message of its own and ``system_prompt``: the pair has only ``system_prompt``."""
    system = {"role": "system", "content": "Reverse the words."}
    expected = preference_dataset(tok, _jsonl(tmp_path / "expected.jsonl",
                                              [dict(PROMPT_LIST, prompt=[system, *PROMPT_LIST["prompt"]])]))[0]
    own = dict(PROMPT_LIST, prompt=[{"role": "system", "content": "Not this."}, *PROMPT_LIST["prompt"]])
    assert preference_dataset(tok, _jsonl(tmp_path / "own.jsonl", [own]), system_prompt=system["content"])[0] \
        == expected
