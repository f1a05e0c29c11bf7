"""Llama 2 chat tokenizer (sentencepiece), with Meta's chat format::

    <s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {reply} </s><s>[INST] {user} [/INST]

Each user/assistant pair is one sentencepiece sequence, as Meta's reference ``chat_completion`` encodes it; user
and reply texts are stripped of surrounding whitespace, as the official template does.
"""

from __future__ import annotations

from mtune.tokenizers._sentencepiece import SentencePieceTokenizer
from mtune.tokenizers.base import Message, check_alternating


class Llama2Tokenizer(SentencePieceTokenizer):
    """Llama 2 ``tokenizer.model``: bos ``<s>`` = 1, eos ``</s>`` = 2 (also the end of an assistant turn)."""

    family = "llama2"

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
        # add_generation_prompt adds nothing: a prompt already ends with [/INST].
        system, turns = check_alternating(messages, "Llama 2")
        tokens: list[int] = []
        trained: list[bool] = []
        for i in range(0, len(turns), 2):
            user = turns[i].content
            if i == 0 and system is not None:
                user = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}"
            prompt = [self.bos_id] + self.encode_text(f"[INST] {user.strip()} [/INST]")
            tokens += prompt
            trained += [False] * len(prompt)
            if i + 1 < len(turns):
                # The reply's leading space is sentencepiece's dummy prefix, so splitting the pair here yields the
                # same pieces as encoding "[INST] ... [/INST] {reply} " in one go.
                reply = self.encode_text(f"{turns[i + 1].content.strip()} ") + [self.eos_id]
                tokens += reply
                trained += [True] * len(reply)
        return tokens, trained
