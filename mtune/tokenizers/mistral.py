"""Mistral tokenizer (sentencepiece, v3 control tokens) with Mistral's instruct format::

    <s>[INST]▁{user}[/INST]▁{reply}</s>[INST]▁{system}\\n\\n{last user}[/INST]

``[INST]`` and ``[/INST]`` are control tokens of the v3 tokenizer (ids 3 and 4), never produced by text. As in
mistral-common, the system prompt is prepended to the last user message. Replies are stripped of surrounding
whitespace, as the official template does.
"""

from __future__ import annotations

from pathlib import Path

from mtune.tokenizers._sentencepiece import SentencePieceTokenizer
from mtune.tokenizers.base import Message, TokenizerError, check_alternating


class MistralTokenizer(SentencePieceTokenizer):
    """Mistral v3 ``tokenizer.model`` (sentencepiece with ``[INST]``/``[/INST]`` control pieces)."""

    family = "mistral"

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        super().__init__(path, max_seq_len)
        inst, end_inst = self.piece_id("[INST]"), self.piece_id("[/INST]")
        if inst is None or end_inst is None or not (self._sp.is_control(inst) and self._sp.is_control(end_inst)):
            raise TokenizerError(
                f"{path}: no [INST]/[/INST] control tokens; mtune supports Mistral's v3 sentencepiece tokenizer "
                "(Mistral-7B-Instruct-v0.3 and later); for an older model use a v3 tokenizer.model"
            )
        self.inst_id, self.end_inst_id = inst, end_inst

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        # add_generation_prompt adds nothing: a prompt already ends with [/INST].
        system, turns = check_alternating(messages, "Mistral")
        last_user = max(i for i, m in enumerate(turns) if m.role == "user")
        tokens, trained = [self.bos_id], [False]
        for i, message in enumerate(turns):
            if message.role == "user":
                text = message.content
                if i == last_user and system is not None:
                    text = f"{system}\n\n{text}"
                ids = [self.inst_id] + self.encode_text(text) + [self.end_inst_id]
                tokens += ids
                trained += [False] * len(ids)
            else:
                ids = self.encode_text(message.content.strip()) + [self.eos_id]
                tokens += ids
                trained += [True] * len(ids)
        return tokens, trained
