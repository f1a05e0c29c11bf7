"""Make a tiktoken rank file from a byte-level BPE trained with the `tokenizers` library.

tiktoken has no trainer. A byte-level BPE trained by `tokenizers` assigns ids in merge order (the 256 byte symbols
first, then each merge as it was learnt), which is exactly what tiktoken's ranks mean, so the conversion only has to
turn each token's GPT-2 printable spelling back into its bytes. mtune uses this for its built-in tiny model and its
tests; the tokenizer libraries are imported only when a function here is called.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from pathlib import Path


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level table read backwards: printable stand-in character -> the byte it spells."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def train_byte_level_bpe(lines: Iterable[str], vocab_size: int, pattern: str) -> str:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens on ``lines``, pre-splitting text with the regex
    ``pattern`` (e.g. Llama 3's). Returns the trained tokenizer as ``tokenizer.json`` text (no added tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(lines, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus only supports {tok.get_vocab_size()} BPE tokens, not vocab_size={vocab_size}; "
                         "give more varied text or a smaller vocab_size")
    return tok.to_str()


def bpe_to_tiktoken(tokenizer_json: str | dict) -> str:
    """The text of a tiktoken rank file (``<base64 bytes> <rank>`` per line, ranks 0..n-1) for a byte-level BPE
    ``tokenizer.json`` (text or parsed dict) whose ids are in merge order, as `tokenizers`' trainer leaves them.
    Added tokens are not included: Llama 3 places its special tokens after the ranks itself."""
    spec = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    vocab: dict[str, int] = spec["model"]["vocab"]
    byte_of = byte_level_alphabet()
    ranks = sorted(vocab.items(), key=lambda kv: kv[1])
    if [rank for _, rank in ranks] != list(range(len(ranks))):
        raise ValueError("tokenizer.json ids are not 0..n-1; a tiktoken rank file needs consecutive ranks")
    lines = []
    for token, rank in ranks:
        try:
            raw = bytes(byte_of[ch] for ch in token)
        except KeyError as err:
            raise ValueError(f"token {token!r} is not byte-level BPE (character {err} has no byte)") from None
        lines.append(f"{base64.b64encode(raw).decode()} {rank}")
    return "\n".join(lines) + "\n"


def write_tiktoken_file(tokenizer_json: str | dict, path: str | Path) -> Path:
    """Write :func:`bpe_to_tiktoken`'s rank file to ``path`` (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(bpe_to_tiktoken(tokenizer_json))
    return path
