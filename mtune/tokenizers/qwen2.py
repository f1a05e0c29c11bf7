"""Qwen2 / Qwen2.5 tokenizer: byte-level BPE from ``tokenizer.json`` (the `tokenizers` library), ChatML format::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n{reply}<|im_end|>\\n

When the conversation has no leading system message the official template adds one: Qwen2.5's
"You are Qwen, created by Alibaba Cloud. You are a helpful assistant." (Qwen2's template says "You are a helpful
assistant."; mtune reads which one from the checkpoint's chat template, ``chat_template.jinja`` or
``tokenizer_config.json`` beside ``tokenizer.json``).
"""

from __future__ import annotations

from pathlib import Path

from mtune.tokenizers.base import Message, checkpoint_chat_template
from mtune.tokenizers.tokenizer_json import TokenizerJson

QWEN2_5_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN2_SYSTEM_PROMPT = "You are a helpful assistant."


def default_system_prompt(tokenizer_json: Path) -> str | None:
    """The system prompt the model's own chat template adds, the template read as transformers reads it
    (``chat_template.jinja``, else ``tokenizer_config.json``'s:
    :func:`~mtune.tokenizers.base.checkpoint_chat_template`); Qwen2.5's when the checkpoint has none; None when its
    template adds none."""
    template, _ = checkpoint_chat_template(tokenizer_json)
    if not template:
        return QWEN2_5_SYSTEM_PROMPT
    for prompt in (QWEN2_5_SYSTEM_PROMPT, QWEN2_SYSTEM_PROMPT):
        if prompt in template:
            return prompt
    return None


class Qwen2Tokenizer(TokenizerJson):
    """Qwen2 ``tokenizer.json``. ``bos_id`` is None (Qwen has none, ``add_bos`` adds nothing);
    ``eos_id`` = ``pad_id`` = <|endoftext|>; ``end_of_turn_id`` = <|im_end|>;
    ``stop_tokens`` = [<|endoftext|>, <|im_end|>]. ``system_prompt`` overrides the default system prompt
    (``""`` or None for none)."""

    family = "qwen2"
    control_tokens = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    description = "Qwen2"
    _UNSET = object()

    def __init__(self, path: str | Path, max_seq_len: int | None = None, system_prompt=_UNSET):
        super().__init__(path, max_seq_len)
        ids = self.control_ids
        self.bos_id = None
        self.eos_id = self.pad_id = ids["<|endoftext|>"]
        self.im_start_id = ids["<|im_start|>"]
        self.im_end_id = self.end_of_turn_id = ids["<|im_end|>"]
        self.stop_tokens = [self.eos_id, self.im_end_id]
        self.system_prompt = (default_system_prompt(Path(path)) if system_prompt is self._UNSET
                              else (system_prompt or None))

    def _fingerprint_extra(self) -> str:
        return f"system_prompt={self.system_prompt!r}"

    def _turn(self, role: str, content: str | None) -> tuple[list[int], list[bool]]:
        header = self.encode_text(f"{role}\n")
        if content is None:  # generation prompt
            return [self.im_start_id] + header, [False] * (1 + len(header))
        # Header and content are one text between two control tokens, encoded together as the template's output
        # is; a content starting with a newline can merge with the header's, and that token counts as header.
        body = self.encode_text(f"{role}\n{content}")
        n_header = 0
        while n_header < min(len(header), len(body)) and header[n_header] == body[n_header]:
            n_header += 1
        newline = self.encode_text("\n")
        tokens = [self.im_start_id] + body + [self.im_end_id] + newline
        reply = role == "assistant"  # the reply and its <|im_end|>; not the newline after it
        trained = [False] * (1 + n_header) + [reply] * (len(body) - n_header + 1) + [False] * len(newline)
        return tokens, trained

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        trained: list[bool] = []
        if messages[0].role != "system" and self.system_prompt is not None:
            messages = [Message("system", self.system_prompt)] + list(messages)
        for message in messages:
            ids, mask = self._turn(message.role, message.content)
            tokens += ids
            trained += mask
        if add_generation_prompt:
            ids, mask = self._turn("assistant", None)
            tokens += ids
            trained += mask
        return tokens, trained
