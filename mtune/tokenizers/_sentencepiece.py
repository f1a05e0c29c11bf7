"""Shared base of the sentencepiece families (Llama 2, Mistral)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from mtune.tokenizers.base import Tokenizer, TokenizerError, not_the_file


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece ``tokenizer.model``: ids and specials straight from the model file (``<s>``, ``</s>``;
    ``pad_id`` is the model's pad piece, or ``<unk>`` (0) when it has none: padded positions are never trained)."""

    def __init__(self, path: str | Path, max_seq_len: int | None = None):
        import sentencepiece

        path = Path(path)
        super().__init__([path], max_seq_len)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise TokenizerError(f"{path}: {not_the_file(path) or f'not a sentencepiece model ({e})'}") from None
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self.end_of_turn_id = self._sp.eos_id()
        self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else max(self._sp.unk_id(), 0)
        self.stop_tokens = [self.eos_id]

    def encode_text(self, text: str) -> list[int]:
        # sentencepiece never emits control pieces (<s>, </s>, [INST], ...) for text, so their spellings stay text.
        # It adds its "dummy prefix" space in front, as Llama 2 and Mistral were trained.
        return self._sp.encode(text)

    def piece_id(self, piece: str) -> int | None:
        """Id of ``piece`` in the model, None when absent."""
        i = self._sp.piece_to_id(piece)
        return None if i == self._sp.unk_id() and piece != self._sp.id_to_piece(i) else i

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode(ids)
        # sentencepiece drops control pieces when decoding; spell them out between the decoded runs of text.
        out, run = [], []
        for i in ids:
            if self._sp.is_control(i):
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                out.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)
