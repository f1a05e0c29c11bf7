"""Phi-4-mini tokenizer: byte-level BPE from ``tokenizer.json`` (the `tokenizers` library), Phi's chat format::

    <|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{reply}<|end|><|endoftext|>

Each message is its role's control token, its text and ``<|end|>``, with nothing between; the official template
ends a conversation with ``<|endoftext|>`` (the end of the text, not of a turn: not trained) or, for generation,
with ``<|assistant|>``. No default system prompt, no BOS.
"""

from __future__ import annotations

from pathlib import Path

from mtune.tokenizers.base import Message
from mtune.tokenizers.tokenizer_json import TokenizerJson

class Phi4Tokenizer(TokenizerJson):
    """Phi-4-mini ``tokenizer.json``. ``bos_id`` is None; ``eos_id`` = ``pad_id`` = <|endoftext|>;
    ``end_of_turn_id`` = <|end|>; ``stop_tokens`` = [<|endoftext|>, <|end|>]."""

    family = "phi4"
    control_tokens = ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    description = "Phi-4-mini"

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        super().__init__(path, max_seq_len)
        ids = self.control_ids
        self.role_ids = {role: ids[f"<|{role}|>"] for role in ("system", "user", "assistant")}
        self.bos_id = None
        self.eos_id = self.pad_id = ids["<|endoftext|>"]
        self.end_of_turn_id = ids["<|end|>"]
        self.stop_tokens = [self.eos_id, self.end_of_turn_id]

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        trained: list[bool] = []
        for message in messages:
            body = self.encode_text(message.content) + [self.end_of_turn_id]
            tokens += [self.role_ids[message.role]] + body
            trained += [False] + [message.role == "assistant"] * len(body)
        tail = [self.role_ids["assistant"]] if add_generation_prompt else [self.eos_id]
        return tokens + tail, trained + [False]
