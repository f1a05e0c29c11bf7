"""Gemma 3 tokenizer: ``tokenizer.json`` (the `tokenizers` library) and Gemma's turn format::

    <bos><start_of_turn>user\\n{system}\\n\\n{user}<end_of_turn>\\n<start_of_turn>model\\n{reply}<end_of_turn>\\n

The assistant's role is written ``model``; a system message has no turn of its own but goes in front of the first
user message; texts are stripped of surrounding whitespace; roles alternate user / model after an optional system
message, as the official template requires.
"""

from __future__ import annotations

from pathlib import Path

from mtune.tokenizers.base import Message, check_alternating
from mtune.tokenizers.tokenizer_json import TokenizerJson


class Gemma3Tokenizer(TokenizerJson):
    """Gemma 3 ``tokenizer.json``. ``bos_id`` = <bos>, ``eos_id`` = <eos>, ``pad_id`` = <pad>; ``end_of_turn_id`` =
    <end_of_turn>; ``stop_tokens`` = [<eos>, <end_of_turn>]."""

    family = "gemma3"
    control_tokens = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>")
    description = "Gemma 3"

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        super().__init__(path, max_seq_len)
        ids = self.control_ids
        self.bos_id, self.eos_id, self.pad_id = ids["<bos>"], ids["<eos>"], ids["<pad>"]
        self.start_of_turn_id = ids["<start_of_turn>"]
        self.end_of_turn_id = ids["<end_of_turn>"]
        self.stop_tokens = [self.eos_id, self.end_of_turn_id]

    def _turn(self, role: str, text: str | None) -> tuple[list[int], list[bool]]:
        header = self.encode_text(f"{role}\n")
        if text is None:  # generation prompt
            return [self.start_of_turn_id] + header, [False] * (1 + len(header))
        # Header and text are one text between two control tokens, encoded together as the template's output is;
        # tokens shared with the header alone count as header.
        body = self.encode_text(f"{role}\n{text}")
        n_header = 0
        while n_header < min(len(header), len(body)) and header[n_header] == body[n_header]:
            n_header += 1
        newline = self.encode_text("\n")
        reply = role == "model"  # the reply and its <end_of_turn>; not the newline after it
        tokens = [self.start_of_turn_id] + body + [self.end_of_turn_id] + newline
        trained = [False] * (1 + n_header) + [reply] * (len(body) - n_header + 1) + [False] * len(newline)
        return tokens, trained

    def _turns(self, messages: list[Message]) -> list[tuple[str, str]]:
        """``(role, text)`` of each turn, ``user`` or ``model``: the system message opens the first user turn."""
        system, turns = check_alternating(messages, self.family)
        texts = [m.content.strip() for m in turns]
        if system is not None:
            texts[0] = system + "\n\n" + texts[0]
        return [("model" if m.role == "assistant" else "user", text) for m, text in zip(turns, texts)]

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        tokens, trained = [self.bos_id], [False]
        for role, text in self._turns(messages) + ([("model", None)] if add_generation_prompt else []):
            ids, mask = self._turn(role, text)
            tokens += ids
            trained += mask
        return tokens, trained
