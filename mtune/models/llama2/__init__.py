"""Llama 2 (Meta, 2023): multi-head attention (GQA at 70B), RoPE theta 1e4, 32k sentencepiece vocabulary."""

from dataclasses import dataclass

from mtune.modules.transformer import DecoderArgs


@dataclass
class Llama2Args(DecoderArgs):
    family = "llama2"
    # mtune calls a Llama config without Llama 3's 128k vocabulary or rope scaling llama2 (hf_config): such small
    # Llama-architecture models are trained with either tokenizer
    tokenizer_families = ("llama2", "llama3")
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096


LLAMA2_SIZES = {
    "7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_dim=11008),
    "13B": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, intermediate_dim=13824),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_dim=28672),
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=512, max_seq_len=512),
}
