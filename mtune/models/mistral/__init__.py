"""Mistral 7B (Mistral AI, 2023): Llama-style with GQA; v0.1 uses a 4096-token sliding attention window."""

from dataclasses import dataclass

from mtune.modules.transformer import DecoderArgs


@dataclass
class MistralArgs(DecoderArgs):
    family = "mistral"
    tokenizer_families = ("mistral",)
    vocab_size: int = 32000
    n_kv_heads: int = 8
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 32768


_7B = dict(dim=4096, n_layers=32, n_heads=32, intermediate_dim=14336)
MISTRAL_SIZES = {
    "7B": {**_7B, "sliding_window": 4096},
    "7B-v0.3": {**_7B, "vocab_size": 32768, "rope_theta": 1000000.0},
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=512,
                 max_seq_len=512, sliding_window=8),
}
