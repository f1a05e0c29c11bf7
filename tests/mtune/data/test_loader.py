"""The loader: deterministic order, disjoint rank shares, exact resume (also onto another world size); collation;
mixtures."""

import random

import pytest
import torch

from mtune.data import (IGNORE_INDEX, DataError, build_dataloader, collate_padded,
                        mixture_dataset, text_completion_dataset)
from tests._helpers.data import ALPACA_ROWS, write_rows


@pytest.fixture
def text_path(tmp_path):
    (tmp_path / "t.txt").write_text("\n".join(f"sample {i} " + "x " * (i % 7) for i in range(50)))
    return str(tmp_path / "t.txt")


@pytest.fixture(params=["shuffled", "packed"])
def dataset(request, tok, text_path):
    packed = request.param == "packed"
    return text_completion_dataset(tok, text_path, max_seq_len=24 if packed else 64, packed=packed)


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def test_resume_single_process_across_epochs(dataset):
    loader = build_dataloader(dataset, batch_size=2, seed=7)
    per_epoch = len(loader)
    assert per_epoch == len(dataset) // 2
    uninterrupted = [b for epoch in range(2) for b in (loader.set_epoch(epoch) or list(loader))]
    assert not same(uninterrupted[0], uninterrupted[per_epoch])  # each epoch has its own permutation
    for k in (3, per_epoch - 1, per_epoch + 2):
        run = build_dataloader(dataset, batch_size=2, seed=7)
        seen = []
        for epoch in range(2):
            run.set_epoch(epoch)
            for batch in run:
                seen.append(batch)
                if len(seen) == k:
                    break
            if len(seen) == k:
                break
        state = run.state_dict()
        resumed = build_dataloader(dataset, batch_size=2, seed=7)
        resumed.load_state_dict(state)
        rest = []
        for epoch in range(state["epoch"], 2):  # the recipe's epoch loop, restarted from the saved epoch
            resumed.set_epoch(epoch)
            rest.extend(resumed)
        assert len(seen) + len(rest) == len(uninterrupted)
        assert all(same(a, b) for a, b in zip(seen + rest, uninterrupted))


def test_two_ranks_share_each_global_batch_and_resume(dataset):
    order = build_dataloader(dataset, batch_size=4, seed=3).global_order(0)

    def rank_loader(rank, world_size=2, collate_fn=list):  # list: batches as the samples themselves
        return build_dataloader(dataset, batch_size=2, seed=3, rank=rank, world_size=world_size,
                                collate_fn=collate_fn)

    assert len(rank_loader(0)) == len(rank_loader(1)) == len(dataset) // 4
    full = [list(rank_loader(r)) for r in range(2)]
    # Rank r's batch k is the r-th half of global batch k: disjoint shares that together are the global order.
    for k, (b0, b1) in enumerate(zip(*full)):
        assert b0 + b1 == [dataset[i] for i in order[4 * k: 4 * k + 4]]
    ranks = [rank_loader(r) for r in range(2)]
    for r in ranks:
        take(r, 3)
    states = [r.state_dict() for r in ranks]
    assert states[0] == states[1] == {"epoch": 0, "consumed": 12, "num_samples": len(dataset), "seed": 3,
                                      "shuffle": 1}
    for r in range(2):
        resumed = rank_loader(r, collate_fn=None)  # default collation, compared as tensors
        resumed.load_state_dict(states[r])
        expected = list(rank_loader(r, collate_fn=None))[3:]
        assert len(expected) > 0 and all(same(a, b) for a, b in zip(list(resumed), expected, strict=True))
    # From 2 ranks to 1: the single process continues where the pair of ranks stopped in the global order.
    one = rank_loader(0, world_size=1)
    one.load_state_dict(states[0])
    assert list(one) == list(rank_loader(0, world_size=1))[6:]


def test_bad_state_and_too_small_dataset(dataset):
    loader = build_dataloader(dataset, batch_size=2, seed=0)
    with pytest.raises(DataError, match="saved with seed=1, this run has seed=0"):
        loader.load_state_dict(dict(loader.state_dict(), seed=1))
    with pytest.raises(DataError, match="fewer than one global batch"):
        build_dataloader(dataset, batch_size=len(dataset), seed=0, world_size=2)


def test_collate_pads_right_to_a_multiple():
    batch = [{"tokens": [5, 6, 7], "labels": [6, 7, -100]}, {"tokens": [9], "labels": [-100]}]
    out = collate_padded(batch, pad_id=0, pad_to_multiple_of=8)
    assert out["tokens"].dtype == torch.long and out["tokens"].shape == (2, 8)
    assert out["tokens"][1].tolist() == [9] + [0] * 7
    assert out["labels"][0].tolist() == [6, 7, -100] + [IGNORE_INDEX] * 5
    assert collate_padded(batch, pad_id=0)["tokens"].shape == (2, 3)


def test_mixture_weights_and_concatenation(tok, tmp_path, text_path):
    instruct = {"_component_": "mtune.data.instruct_dataset",
                "source": str(write_rows(ALPACA_ROWS, tmp_path / "a.jsonl"))}
    text = text_completion_dataset(tok, text_path)
    concat = mixture_dataset(tok, [instruct, text])
    assert len(concat) == len(ALPACA_ROWS) + 50 and concat[len(ALPACA_ROWS)] == text[0]
    mixed = mixture_dataset(tok, [instruct, text], weights=[3, 1], num_samples=401, seed=0)
    # Over an epoch of the shuffled loader every mixture index appears once, so the shares are the weights, exact to
    # one sample (largest-remainder rounding): 401 * 3/4 = 300.75 -> 301 instruction samples, 100 text.
    # Chat-rendered samples start <|begin_of_text|><|start_header_id|>; text samples start with a text token.
    epoch = [s for batch in build_dataloader(mixed, batch_size=4, seed=0, drop_last=False, collate_fn=list)
             for s in batch]
    from_instruct = sum(s["tokens"][1] == tok.start_header_id for s in epoch)
    assert (len(epoch), from_instruct) == (401, 301)
    assert set(mixed.sample_index[i] for i in range(401) if mixed.source_index[i] == 0) == set(range(6))
    packed = text_completion_dataset(tok, text_path, max_seq_len=32, packed=True)
    with pytest.raises(DataError, match="mix packed and unpacked"):
        mixture_dataset(tok, [text, packed])


@pytest.mark.parametrize("kwargs, message", [
    (dict(weights=[1, 1], num_samples=0), r"num_samples must be a whole number of samples >= 1, got 0"),
    (dict(weights=[1, 1], num_samples=-5), r"num_samples must be a whole number of samples >= 1, got -5"),
    (dict(weights=[1, 1], num_samples=2.5), r"num_samples must be a whole number of samples >= 1, got 2.5"),
    (dict(num_samples=10), r"num_samples=10 needs weights \(without them the datasets are concatenated whole\)"),
    (dict(weights=["a", 1]), r"weights must be numbers, got \['a', 1\]"),
])
def test_mixture_counts_and_weights_are_checked_before_anything_is_built(tok, text_path, kwargs, message):
    """num_samples 0 was read as the default, -5 raised ZeroDivisionError, without weights it was ignored, and a
    weight that is not a number raised TypeError: each a one-line DataError now."""
    text = text_completion_dataset(tok, text_path)
    with pytest.raises(DataError, match=r"^mixture_dataset: " + message):
        mixture_dataset(tok, [text, text], **kwargs)
    assert len(mixture_dataset(tok, [text, text], weights=[1, 1], num_samples=3)) == 3


def test_mixture_from_a_config_node(tok, tmp_path, text_path):
    """instantiate() passes the nested dataset nodes unbuilt, and the mixture builds them with the tokenizer."""
    from omegaconf import OmegaConf

    from mtune.config import instantiate

    node = OmegaConf.create({
        "_component_": "mtune.data.mixture_dataset",
        "datasets": [
            {"_component_": "mtune.data.instruct_dataset", "source": str(write_rows(ALPACA_ROWS, tmp_path / "a.jsonl"))},
            {"_component_": "mtune.data.text_completion_dataset", "source": text_path},
        ],
    })
    mixed = instantiate(node, tokenizer=tok)
    assert len(mixed) == len(ALPACA_ROWS) + 50
    assert mixed[len(ALPACA_ROWS)] == text_completion_dataset(tok, text_path)[0]


def test_collate_counts_tokens_before_padding():
    batch = [{"tokens": [5, 6, 7], "labels": [6, 7, -100]}, {"tokens": [9], "labels": [-100]}]
    assert int(collate_padded(batch, pad_id=0, pad_to_multiple_of=8)["num_tokens"]) == 4


def test_collate_pads_packed_fields_and_honours_ignore_index():
    """A length already at the multiple stays; packed padding counts from 0 under a document id of its own; a
    caller's ignore_index labels the padding."""
    batch = [{"tokens": [5, 6, 7, 8], "labels": [6, -1, 8, -1], "input_pos": [0, 1, 0, 1],
              "document_ids": [0, 0, 1, 1]},
             {"tokens": [9, 10], "labels": [10, -1], "input_pos": [0, 1], "document_ids": [0, 0]}]
    out = collate_padded(batch, pad_id=3, ignore_index=-1, pad_to_multiple_of=4)
    assert {k: v.tolist() for k, v in out.items() if k not in ("num_tokens", "longest_document")} == {
        "tokens": [[5, 6, 7, 8], [9, 10, 3, 3]],
        "labels": [[6, -1, 8, -1], [10, -1, -1, -1]],
        "input_pos": [[0, 1, 0, 1], [0, 1, 0, 1]],
        "document_ids": [[0, 0, 1, 1], [0, 0, 1, 1]],
    }


def test_collate_names_the_longest_document_padding_included():
    """``longest_document``: the longest run of one document id in any padded row, the padding a document of its own
    (row 2's 6 padding tokens outrun every real document here); a count by ``itertools.groupby`` over seeded random
    packs for the rest. Unpacked batches have none."""
    from itertools import groupby

    def sample(lengths):
        ids = [i for i, n in enumerate(lengths) for _ in range(n)]
        return {"tokens": [1] * len(ids), "labels": [1] * len(ids), "input_pos": [0] * len(ids), "document_ids": ids}

    assert collate_padded([sample([3, 2]), sample([2])], pad_id=0, pad_to_multiple_of=8)["longest_document"] == 6
    rng = random.Random(0)
    for _ in range(50):
        batch = [sample([rng.randint(1, 40) for _ in range(rng.randint(1, 5))]) for _ in range(rng.randint(1, 4))]
        out = collate_padded(batch, pad_id=0, pad_to_multiple_of=rng.choice([None, 8, 64]))
        runs = [len(list(run)) for row in out["document_ids"].tolist() for _, run in groupby(row)]
        assert out["longest_document"] == max(runs)
    assert "longest_document" not in collate_padded([{"tokens": [5], "labels": [5]}], pad_id=0)


def test_partial_last_batch_is_counted_and_an_epoch_end_moves_the_state_on():
    """drop_last=False: 10 samples in batches of 3 are 4 batches, the last one short; a finished epoch saves as the
    start of the next (a resume must not replay it); a state of another dataset size or shuffle is refused."""
    loader = build_dataloader(list(range(10)), batch_size=3, seed=5, shuffle=False, drop_last=False, collate_fn=list)
    assert len(loader) == 4
    seen = []
    for batch in loader:
        seen.append(batch)
        if len(seen) == 4:
            assert loader.state_dict()["consumed"] == 10
    assert seen == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert loader.state_dict() == {"epoch": 1, "consumed": 0, "num_samples": 10, "seed": 5, "shuffle": 0}
    for key, value in (("num_samples", 11), ("shuffle", 1)):
        with pytest.raises(DataError, match=f"saved with {key}={value}, this run has {key}="):
            loader.load_state_dict(dict(loader.state_dict(), **{key: value}))


class _Samples(list):
    pad_id = 0


def test_mixture_draws_with_its_seed_and_checks_weights_and_nodes(tok):
    """Each seed draws its own subsets (the same again for the same seed), with exact counts; a weight per
    dataset, none negative; a config node needs a _component_."""
    a, b = _Samples({"tokens": [i]} for i in range(20)), _Samples({"tokens": [100 + i]} for i in range(20))

    def mixed(seed):
        return mixture_dataset(tok, [a, b], weights=[2, 1], num_samples=9, seed=seed)

    assert mixed(0).source_index == [0] * 6 + [1] * 3
    assert mixed(0).sample_index == mixed(0).sample_index != mixed(1).sample_index
    assert len(set(mixed(1).sample_index[:6])) == 6  # a subset: no sample twice
    for weights in ([1], [2, -1]):
        with pytest.raises(DataError, match=r"weights must be 2 non-negative numbers"):
            mixture_dataset(tok, [a, b], weights=weights)
    with pytest.raises(DataError, match=r"each entry of datasets needs a _component_, got keys \['source'\]"):
        mixture_dataset(tok, [a, {"source": "x.jsonl"}])
