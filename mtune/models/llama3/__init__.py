"""Llama 3, 3.1, 3.2 and 3.3 (Meta, 2024): GQA with 8 KV heads, RoPE theta 5e5, 128k tiktoken vocabulary.

3.1 onwards stretch RoPE to a 128k context with the "llama3" frequency scaling; 3.2's 1B and 3B tie the input and
output embeddings.
"""

from dataclasses import dataclass

from mtune.modules.transformer import DecoderArgs


@dataclass
class Llama3Args(DecoderArgs):
    family = "llama3"
    tokenizer_families = ("llama3",)
    vocab_size: int = 128256
    n_kv_heads: int = 8
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192


def _llama3_scaling(factor: float, original: int = 8192) -> dict:
    return dict(
        rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=original,
    )


_8B = dict(dim=4096, n_layers=32, n_heads=32, intermediate_dim=14336)
_70B = dict(dim=8192, n_layers=80, n_heads=64, intermediate_dim=28672)
_LONG = dict(rope_scaling=_llama3_scaling(8.0), max_seq_len=131072)
# Weight shapes that suit NF4 (every linear's numel divisible by 32768); RoPE scaling from position 64 so tests can
# run past the "original" context cheaply.
_TINY = dict(
    vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=512, max_seq_len=512,
    rope_scaling=_llama3_scaling(8.0, original=64),
)

LLAMA3_SIZES = {"8B": _8B, "70B": _70B, "tiny": _TINY}
LLAMA3_1_SIZES = {
    "8B": {**_8B, **_LONG},
    "70B": {**_70B, **_LONG},
    "405B": dict(dim=16384, n_layers=126, n_heads=128, intermediate_dim=53248, **_LONG),
    "tiny": _TINY,
}
LLAMA3_2_SIZES = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, head_dim=64, intermediate_dim=8192, tie_embeddings=True,
               rope_scaling=_llama3_scaling(32.0), max_seq_len=131072),
    "3B": dict(dim=3072, n_layers=28, n_heads=24, head_dim=128, intermediate_dim=8192, tie_embeddings=True,
               rope_scaling=_llama3_scaling(32.0), max_seq_len=131072),
    "tiny": {**_TINY, "tie_embeddings": True},
}
LLAMA3_3_SIZES = {"70B": {**_70B, **_LONG}, "tiny": _TINY}
