"""Tokenizers of the supported families and their chat formats.

``load_tokenizer(path, max_seq_len=None)`` returns a :class:`~mtune.tokenizers.base.Tokenizer`; the tokenizer
library of the family in use (tiktoken, sentencepiece, tokenizers) is imported only when that family loads.
"""

from mtune.tokenizers.base import Message, TokenizedConversation, TokenizedText, Tokenizer
from mtune.tokenizers.loader import FAMILIES, detect_tokenizer, load_tokenizer

__all__ = ["FAMILIES", "Message", "TokenizedConversation", "TokenizedText", "Tokenizer", "detect_tokenizer",
           "load_tokenizer"]
