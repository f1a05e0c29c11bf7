"""Phi-4 tokenizers: byte-level BPE from ``tokenizer.json`` (the `tokenizers` library) and each model's chat format.

Phi-4 (14B; Phi-4-reasoning shares the vocabulary, family ``phi4``)::

    <|im_start|>system<|im_sep|>{system}<|im_end|><|im_start|>user<|im_sep|>{user}<|im_end|>
    <|im_start|>assistant<|im_sep|>{reply}<|im_end|>

Phi-4-mini (family ``phi4_mini``)::

    <|system|>{system}<|end|><|user|>{user}<|end|><|assistant|>{reply}<|end|><|endoftext|>

Neither has a default system prompt or a BOS, and nothing stands between messages. Phi-4's template ends a
conversation after the last ``<|im_end|>`` (with ``add_generation_prompt``: ``<|im_start|>assistant<|im_sep|>``);
Phi-4-mini's with ``<|endoftext|>`` (the end of the text, not of a turn: not trained) or ``<|assistant|>``.
"""

from __future__ import annotations

from pathlib import Path

from mtune.tokenizers.base import Message, TokenizerError, checkpoint_chat_template
from mtune.tokenizers.tokenizer_json import TokenizerJson


class Phi4Tokenizer(TokenizerJson):
    """Phi-4 (14B) ``tokenizer.json``. ``bos_id`` is None; ``eos_id`` = ``pad_id`` = <|endoftext|>;
    ``end_of_turn_id`` = <|im_end|>; ``stop_tokens`` = [<|endoftext|>, <|im_end|>].

    Phi-4-reasoning's template (a fixed system prompt and ``<think>`` sections) is not this format: a checkpoint whose
    chat template mentions ``<think>`` is refused rather than rendered without them."""

    family = "phi4"
    control_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>")
    description = "Phi-4"

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        super().__init__(path, max_seq_len)
        template, source = checkpoint_chat_template(Path(path))
        if template and "<think>" in template:
            raise TokenizerError(f"{source}: a Phi-4-reasoning chat template (its system prompt and <think> "
                                 "sections), which mtune does not render; mtune renders Phi-4's own format")
        ids = self.control_ids
        self.bos_id = None
        self.eos_id = self.pad_id = ids["<|endoftext|>"]
        self.end_of_turn_id = ids["<|im_end|>"]
        self.stop_tokens = [self.eos_id, self.end_of_turn_id]

    def _header(self, role: str) -> list[int]:
        return [self.control_ids["<|im_start|>"]] + self.encode_text(role) + [self.control_ids["<|im_sep|>"]]

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        trained: list[bool] = []
        for message in messages:
            header, body = self._header(message.role), self.encode_text(message.content) + [self.end_of_turn_id]
            tokens += header + body
            trained += [False] * len(header) + [message.role == "assistant"] * len(body)
        if add_generation_prompt:
            header = self._header("assistant")
            tokens += header
            trained += [False] * len(header)
        return tokens, trained


class Phi4MiniTokenizer(TokenizerJson):
    """Phi-4-mini ``tokenizer.json``. ``bos_id`` is None; ``eos_id`` = ``pad_id`` = <|endoftext|>;
    ``end_of_turn_id`` = <|end|>; ``stop_tokens`` = [<|endoftext|>, <|end|>]."""

    family = "phi4_mini"
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
