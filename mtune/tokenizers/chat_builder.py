"""A chat template's output built piece by piece, as ids and trained flags, for the families whose templates mix
text and control tokens in many places (gpt-oss, Qwen3, Qwen3.5).

A template's output is one string that the checkpoint's tokenizer cuts at its added tokens and encodes piece by
piece; :class:`ChatBuilder` does the same from the pieces a renderer adds: consecutive text pieces are encoded
together (so a header and the reply after it tokenize as the template's output does), a control token ends the
text before it. A token is trained when the first character it covers was added as trained: a token that merges
the end of an untrained header with the start of a reply counts as header.
"""

from __future__ import annotations

from bisect import bisect_right


class ChatBuilder:
    """Collects ``text(...)`` and ``token(...)`` pieces; ``result()`` gives ``(ids, trained)``. ``tokenizer``: a
    :class:`~mtune.tokenizers.tokenizer_json.TokenizerJson` (its ``encode_text_with_starts``)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.tokens: list[int] = []
        self.trained: list[bool] = []
        self._pending: list[str] = []
        self._starts: list[int] = []  # character offset in the pending text where each piece starts
        self._flags: list[bool] = []
        self._length = 0

    def text(self, text: str, trained: bool = False) -> None:
        """Append ``text`` (encoded as text: control-token spellings inside it stay text)."""
        if text:
            self._pending.append(text)
            self._starts.append(self._length)
            self._flags.append(trained)
            self._length += len(text)

    def token(self, token_id: int, trained: bool = False) -> None:
        """Append one control token, ending the text before it."""
        self._flush()
        self.tokens.append(token_id)
        self.trained.append(trained)

    def result(self) -> tuple[list[int], list[bool]]:
        self._flush()
        return self.tokens, self.trained

    def _flush(self) -> None:
        if not self._pending:
            return
        text = "".join(self._pending)
        if all(flag == self._flags[0] for flag in self._flags):  # one flag for the whole run: no offsets needed
            ids = self._tokenizer.encode_text(text)
            self.trained.extend([self._flags[0]] * len(ids))
        else:
            ids, starts = self._tokenizer.encode_text_with_starts(text)
            self.trained.extend(self._flags[bisect_right(self._starts, start) - 1] for start in starts)
        self.tokens.extend(ids)
        self._pending, self._starts, self._flags, self._length = [], [], [], 0
