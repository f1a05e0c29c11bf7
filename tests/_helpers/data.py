"""Test helpers for mtune.data: a real tiny tokenizer, sample rows, and writers for every supported format."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def tiny_tokenizer(tmp_dir, family: str = "llama3", max_seq_len: int | None = 64):
    """A real mtune tokenizer of `family` over tiny trained files written into `tmp_dir/<family>-tok`."""
    from mtune.tokenizers import load_tokenizer
    from tests._helpers.tokenizers import write_tokenizer_files

    path = Path(tmp_dir) / f"{family}-tok"
    write_tokenizer_files(path, family)
    return load_tokenizer(path, max_seq_len=max_seq_len)


ALPACA_ROWS = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Name a colour.", "input": "", "output": "Blue, like the sky."},
    {"instruction": "Say hello in French.", "input": "", "output": "Bonjour"},
    {"instruction": "Reverse the word.", "input": "stressed", "output": "desserts"},
    {"instruction": "Is 7 prime?", "input": "", "output": "Yes, 7 is prime."},
    {"instruction": "Capital of Japan?", "input": "", "output": "Tokyo"},
]


def write_rows(rows: list[dict], path: Path) -> Path:
    """Write `rows` to `path` in the format its suffix names (.json array, .jsonl, .parquet, .csv)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        raise ValueError(path)
    return path
