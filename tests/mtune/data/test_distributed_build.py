"""In a distributed run only rank 0 tokenizes; the other ranks wait at the barrier and load its cache file."""

import json
import os
from pathlib import Path
from unittest import mock

import torch.distributed as dist
import torch.multiprocessing as mp

from tests._helpers.data import ALPACA_ROWS, write_rows


def _worker(rank: int, tmp: str, tok_dir: str) -> None:
    os.environ["MTUNE_CACHE_DIR"] = str(Path(tmp) / "cache")
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        from mtune.data import instruct_dataset
        from mtune.tokenizers import load_tokenizer

        tok = load_tokenizer(tok_dir, max_seq_len=64)
        with mock.patch.object(tok, "tokenize_messages", wraps=tok.tokenize_messages) as spy:
            ds = instruct_dataset(tok, str(Path(tmp) / "a.jsonl"), packed=True)
        result = {"calls": spy.call_count, "samples": [ds[i] for i in range(len(ds))]}
        (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_rank_zero_builds_the_others_load(tok, tmp_path):
    write_rows(ALPACA_ROWS, tmp_path / "a.jsonl")
    mp.spawn(_worker, args=(str(tmp_path), str(tok.files[0].parent.parent)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["calls"] for r in ranks] == [len(ALPACA_ROWS), 0]
    assert ranks[0]["samples"] == ranks[1]["samples"] and len(ranks[0]["samples"]) > 0
    assert len(list((tmp_path / "cache" / "data").glob("*.pt"))) == 1
