"""Qwen2 and Qwen2.5 (Alibaba, 2024): GQA, biased q/k/v projections, RoPE theta 1e6, 152k BPE vocabulary.

The small sizes tie the input and output embeddings.
"""

from dataclasses import dataclass

from mtune.modules.transformer import DecoderArgs


@dataclass
class Qwen2Args(DecoderArgs):
    family = "qwen2"
    tokenizer_families = ("qwen2",)
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 32768
    qkv_bias: bool = True


QWEN2_5_SIZES = {
    "0.5B": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_dim=4864, tie_embeddings=True),
    "1.5B": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_dim=8960, tie_embeddings=True),
    "3B": dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, intermediate_dim=11008, tie_embeddings=True),
    "7B": dict(vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_dim=18944,
               max_seq_len=131072),
    "14B": dict(vocab_size=152064, dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, intermediate_dim=13824,
                max_seq_len=131072),
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=512, max_seq_len=512),
}
# Qwen2 shares Qwen2.5's shapes at these sizes.
QWEN2_SIZES = {name: QWEN2_5_SIZES[name] for name in ("0.5B", "1.5B", "7B", "tiny")}
