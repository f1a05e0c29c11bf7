"""Packing: no sample sees another (same per-token loss as alone), nothing lost or duplicated, cached on disk."""

from collections import Counter
from unittest import mock

import torch
import torch.nn.functional as F

from mtune.data import IGNORE_INDEX, build_dataloader, instruct_dataset, text_completion_dataset
from mtune.models import build_model
from tests._helpers.data import ALPACA_ROWS, write_rows

ROWS = [dict(r, output=r["output"] + " ok" * i) for i, r in enumerate(ALPACA_ROWS * 3)]


def test_packed_loss_equals_each_sample_alone(tok, tmp_path):
    path = str(write_rows(ROWS, tmp_path / "a.jsonl"))
    alone = instruct_dataset(tok, path, max_seq_len=128)
    packed = instruct_dataset(tok, path, max_seq_len=128, packed=True)
    assert packed.stats["packs"] < len(alone) and len(packed) == packed.stats["packs"]
    torch.manual_seed(0)
    model = build_model("tiny", device="cpu", vocab_size=tok.vocab_size, dim=64, intermediate_dim=128).eval()
    batch = build_dataloader(packed, batch_size=len(packed), seed=0, shuffle=False).__iter__().__next__()
    assert set(batch) == {"tokens", "labels", "input_pos", "document_ids", "longest_document", "num_tokens"}
    assert batch["tokens"].shape == (len(packed), 128)
    with torch.no_grad():
        logits = model(batch["tokens"], input_pos=batch["input_pos"], document_ids=batch["document_ids"])
        packed_loss = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        # Samples are packed in order: walk the packs' documents and match them to the samples one by one.
        i = 0
        for row in range(len(packed)):
            for doc in batch["document_ids"][row].unique():
                where = batch["document_ids"][row] == doc
                if (batch["labels"][row][where] == IGNORE_INDEX).all():
                    continue  # the pack's padding
                sample = alone[i]
                i += 1
                assert batch["tokens"][row][where].tolist() == sample["tokens"]
                assert batch["input_pos"][row][where].tolist() == list(range(len(sample["tokens"])))
                tokens, labels = torch.tensor([sample["tokens"]]), torch.tensor([sample["labels"]])
                own = F.cross_entropy(model(tokens).transpose(1, 2), labels, reduction="none")[0]
                torch.testing.assert_close(packed_loss[row][where], own, rtol=0, atol=2e-5)
    assert i == len(alone)


def test_an_epoch_of_packs_holds_every_sample_once(tok, tmp_path):
    lines = [f"line {i}: " + "word " * (i % 11) for i in range(40)]
    (tmp_path / "t.txt").write_text("\n".join(lines))
    alone = text_completion_dataset(tok, str(tmp_path / "t.txt"), max_seq_len=32)
    packed = text_completion_dataset(tok, str(tmp_path / "t.txt"), max_seq_len=32, packed=True)
    stats = packed.stats
    assert stats["padding"] == stats["packs"] * 32 - stats["tokens"] and stats["padding"] < stats["padding_unpacked"]
    seen = Counter()
    for batch in build_dataloader(packed, batch_size=3, seed=1, drop_last=False):
        for row in range(batch["tokens"].shape[0]):
            ids = batch["document_ids"][row]
            for doc in ids.unique():
                where = ids == doc
                if not (batch["labels"][row][where] == IGNORE_INDEX).all():
                    seen[tuple(batch["tokens"][row][where].tolist())] += 1
    assert seen == Counter(tuple(alone[i]["tokens"]) for i in range(len(alone)))


def test_cache_is_reused_and_invalidated(tok, tmp_path, caplog):
    path = write_rows(ROWS, tmp_path / "a.jsonl")
    first = instruct_dataset(tok, str(path), max_seq_len=64, packed=True)
    assert len(list((tmp_path / "mtune-cache" / "data").glob("instruct-*.pt"))) == 1

    def builds(**kwargs):
        with mock.patch.object(tok, "tokenize_messages", wraps=tok.tokenize_messages) as spy:
            ds = instruct_dataset(tok, str(path), **{"max_seq_len": 64, "packed": True, **kwargs})
        return ds, spy.call_count

    again, calls = builds()
    assert calls == 0 and all(torch.equal(again.fields[k], first.fields[k]) for k in first.fields)
    assert builds(max_seq_len=48)[1] == len(ROWS)
    assert builds(train_on_input=True)[1] == len(ROWS)
    assert builds(packed=False)[1] == len(ROWS)
    assert builds(cache=False)[1] == len(ROWS)
    write_rows(ROWS[:-1], path)  # new contents, same file name
    changed, calls = builds()
    assert calls == len(ROWS) - 1 and changed.stats["samples"] == len(ROWS) - 1


def test_pack_samples_lays_out_each_pack_exactly():
    """Hand-written packs: a sample that exactly fills the rest of a pack joins it; each pack's document ids restart
    at 0; the padding counts its positions from 0 as a document of its own, labelled IGNORE_INDEX; the stats."""
    from mtune.data.packing import pack_samples

    tokens = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10]]
    labels = [[2, 3, -100], [5, 6, 7, -100], [9, -100], [-100]]
    packs, stats = pack_samples(tokens, labels, max_seq_len=7, pad_id=0)
    assert packs == {
        "tokens": [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 0, 0, 0, 0]],
        "labels": [[2, 3, -100, 5, 6, 7, -100], [9, -100, -100, -100, -100, -100, -100]],
        "input_pos": [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 0, 1, 2, 3]],
        "document_ids": [[0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 2, 2, 2, 2]],
    }
    assert stats == {"packs": 2, "padding": 2 * 7 - 10, "padding_unpacked": 4 * 7 - 10}
