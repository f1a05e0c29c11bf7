"""Phi-4-mini tokenizer: byte-level BPE from ``tokenizer.json`` (the `tokenizers` library), Phi's chat format::

    <|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{reply}<|end|><|endoftext|>

Each message is its role's control token, its text and ``<|end|>``, with nothing between; the official template
ends a conversation with ``<|endoftext|>`` (the end of the text, not of a turn: not trained) or, for generation,
with ``<|assistant|>``. No default system prompt, no BOS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from mtune.tokenizers.base import Message, Tokenizer, TokenizerError

_CONTROL = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


class Phi4Tokenizer(Tokenizer):
    """Phi-4-mini ``tokenizer.json``. ``bos_id`` is None; ``eos_id`` = ``pad_id`` = <|endoftext|>;
    ``end_of_turn_id`` = <|end|>; ``stop_tokens`` = [<|endoftext|>, <|end|>]."""

    family = "phi4"

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        super().__init__([path], max_seq_len)
        spec = json.loads(path.read_text(encoding="utf-8"))
        self._full = HFTokenizer.from_str(json.dumps(spec))
        # Text is encoded by a copy without the added tokens, so "<|end|>" in a message stays text.
        spec["added_tokens"] = []
        self._text = HFTokenizer.from_str(json.dumps(spec))
        ids = {name: self._full.token_to_id(name) for name in _CONTROL}
        missing = [name for name, i in ids.items() if i is None]
        if missing:
            raise TokenizerError(f"{path}: no {', '.join(missing)} token; this does not look like a Phi-4-mini "
                                 "tokenizer.json")
        self.role_ids = {role: ids[f"<|{role}|>"] for role in ("system", "user", "assistant")}
        self.bos_id = None
        self.eos_id = self.pad_id = ids["<|endoftext|>"]
        self.end_of_turn_id = ids["<|end|>"]
        self.stop_tokens = [self.eos_id, self.end_of_turn_id]
        self.vocab_size = self._full.get_vocab_size(with_added_tokens=True)

    def encode_text(self, text: str) -> list[int]:
        return self._text.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._full.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        trained: list[bool] = []
        for message in messages:
            body = self.encode_text(message.content) + [self.end_of_turn_id]
            tokens += [self.role_ids[message.role]] + body
            trained += [False] + [message.role == "assistant"] * len(body)
        tail = [self.role_ids["assistant"]] if add_generation_prompt else [self.eos_id]
        return tokens + tail, trained + [False]
