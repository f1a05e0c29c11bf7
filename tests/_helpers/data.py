"""Test helpers for mtune.data: a deterministic byte-level chat tokenizer, file writers for every supported
format, and a tiny attention model that honours `input_pos` / `document_ids`."""

from __future__ import annotations

import csv
import json
from collections import namedtuple
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

try:
    from mtune.tokenizers.base import TokenizedConversation
except ImportError:  # until mtune.tokenizers lands
    TokenizedConversation = namedtuple("TokenizedConversation", "tokens trained truncated")


class ByteChatTokenizer:
    """Byte-level ids (byte + 7) with a tiny chat format: `<bos> (<role> text <eot>)*`.

    Special ids: pad 0, bos 1, eos 2, role headers system 3 / user 4 / assistant 5, end-of-turn 6. Assistant
    text and its `<eot>` are trained; headers, bos and other turns are not. Counts `tokenize_messages` / `encode`
    calls in `calls` (to prove the cache skips tokenization).
    """

    pad_id, bos_id, eos_id, eot_id = 0, 1, 2, 6
    headers = {"system": 3, "user": 4, "assistant": 5}
    offset = 7
    vocab_size = 256 + 7

    def __init__(self, max_seq_len: int | None = None):
        self.max_seq_len = max_seq_len
        self.stop_tokens = [self.eos_id, self.eot_id]
        self.calls = 0

    def fingerprint(self) -> str:
        return "bytechat-v1"

    def _bytes(self, text: str) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        self.calls += 1
        return [self.bos_id] * add_bos + self._bytes(text) + [self.eos_id] * add_eos

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - self.offset for i in ids if i >= self.offset).decode("utf-8", errors="replace")

    def tokenize_messages(self, messages, max_seq_len=None, add_generation_prompt=False):
        self.calls += 1
        tokens, trained = [self.bos_id], [False]
        for m in messages:
            body = self._bytes(m.content) + [self.eot_id]
            tokens += [self.headers[m.role]] + body
            trained += [False] + [m.role == "assistant"] * len(body)
        if add_generation_prompt:
            tokens.append(self.headers["assistant"])
            trained.append(False)
        limit = max_seq_len or self.max_seq_len
        truncated = bool(limit) and len(tokens) > limit
        if truncated:
            tokens, trained = tokens[:limit], trained[:limit]
        return TokenizedConversation(tokens, trained, truncated)


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


class TinyDocModel(nn.Module):
    """One causal self-attention block over token + learned position embeddings (positions from `input_pos`),
    with a block-causal mask from `document_ids`: enough to show whether packed documents leak into each other.
    TEMPORARY stand-in until mtune.modules.TransformerDecoder lands."""

    def __init__(self, vocab_size: int, dim: int = 32, max_pos: int = 128):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, dim)
        self.embed_pos = nn.Embedding(max_pos, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.lm_head = nn.Linear(dim, vocab_size)

    def forward(self, tokens, input_pos=None, document_ids=None):
        b, s = tokens.shape
        pos = input_pos if input_pos is not None else torch.arange(s).expand(b, s)
        x = self.embed_tokens(tokens) + self.embed_pos(pos)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s)
        if document_ids is not None:
            mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])
        attn = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=mask[:, None])
        return self.lm_head(x + attn[:, 0])
