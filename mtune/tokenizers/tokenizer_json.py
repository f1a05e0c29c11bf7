"""The tokenizers read from a checkpoint's own ``tokenizer.json`` with the `tokenizers` library (Qwen2 / Qwen3 /
Qwen3.5, Phi-4, Phi-4-mini, Gemma 3 / 4, gpt-oss): loading, the control tokens a family needs, and text encoded as
text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from mtune.tokenizers.base import Tokenizer, TokenizerError, read_json

__all__ = ["TokenizerJson"]


class TokenizerJson(Tokenizer):
    """A ``tokenizer.json`` tokenizer. A subclass names its ``control_tokens`` (their ids are ``control_ids``, by
    token) and its ``description`` for the one-line error when the file lacks one; it sets ``bos_id``, ``eos_id``,
    ``pad_id``, ``end_of_turn_id`` and ``stop_tokens`` from them and renders its chat format."""

    control_tokens: tuple[str, ...] = ()
    description = ""

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        super().__init__([path], max_seq_len)
        spec = read_json(path)
        try:
            self._full = HFTokenizer.from_str(json.dumps(spec))
        except Exception as e:  # the library raises a bare Exception for a file it cannot read ("Model missing")
            raise TokenizerError(f"{path}: not a tokenizer.json the tokenizers library reads ({e})") from None
        # Text is encoded by a copy without the added tokens (so a control token's text in a message stays text)
        # and without a post-processor (which would add a BOS of its own).
        spec["added_tokens"] = []
        spec["post_processor"] = None
        self._text = HFTokenizer.from_str(json.dumps(spec))
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)
        self.control_ids = {name: self._full.token_to_id(name) for name in self.control_tokens}
        missing = [name for name, i in self.control_ids.items() if i is None]
        if missing:
            raise TokenizerError(f"{path}: no {', '.join(missing)} token; this does not look like a "
                                 f"{self.description} tokenizer.json")

    def encode_text(self, text: str) -> list[int]:
        return self._text.encode(text, add_special_tokens=False).ids

    def encode_text_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        """``encode_text(text)`` and, per token, the index of the first character of ``text`` it covers."""
        encoding = self._text.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._full.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
