"""Gemma 4 tokenizer: ``tokenizer.json`` (the `tokenizers` library) and Gemma 4's turn format::

    <bos><|turn>system\\n{system}<turn|>\\n<|turn>user\\n{user}<turn|>\\n<|turn>model\\n{reply}<turn|>\\n

Unlike Gemma 3's, a system message has a turn of its own. The assistant's role is written ``model``; texts are
stripped of surrounding whitespace, and a reply's thought blocks (``<|channel>...<channel|>``) are dropped, as the
official template (google/gemma-4-*-it ``chat_template.jinja``, its text branches) renders earlier replies; the
generation prompt is ``<|turn>model\\n``. Roles alternate user / model after an optional system message.
"""

from __future__ import annotations

from pathlib import Path

from mtune.tokenizers.base import Message, check_alternating
from mtune.tokenizers.gemma3 import Gemma3Tokenizer
from mtune.tokenizers.tokenizer_json import TokenizerJson

THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"


def without_thoughts(reply: str) -> str:
    """``reply`` without its ``<|channel>...<channel|>`` thought blocks, stripped (an unclosed block is kept)."""
    kept = [part.split(THOUGHT_OPEN)[0] if THOUGHT_OPEN in part else part for part in reply.split(THOUGHT_CLOSE)]
    return "".join(kept).strip()


class Gemma4Tokenizer(Gemma3Tokenizer):
    """Gemma 4 ``tokenizer.json``. ``bos_id`` = <bos>, ``eos_id`` = <eos>, ``pad_id`` = <pad>; ``end_of_turn_id`` =
    <turn|>; ``stop_tokens`` = [<eos>, <turn|>]."""

    family = "gemma4"
    control_tokens = ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>")
    description = "Gemma 4"

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        TokenizerJson.__init__(self, path, max_seq_len)
        ids = self.control_ids
        self.bos_id, self.eos_id, self.pad_id = ids["<bos>"], ids["<eos>"], ids["<pad>"]
        self.start_of_turn_id = ids["<|turn>"]
        self.end_of_turn_id = ids["<turn|>"]
        self.stop_tokens = [self.eos_id, self.end_of_turn_id]

    def _turns(self, messages: list[Message]) -> list[tuple[str, str]]:
        """The system message as its own turn; replies without their thought blocks."""
        system, turns = check_alternating(messages, self.family)
        return ([("system", system.strip())] if system is not None else []) + [
            ("model", without_thoughts(m.content)) if m.role == "assistant" else ("user", m.content.strip())
            for m in turns]
