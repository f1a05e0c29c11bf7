"""Qwen3 dense (Alibaba, 2025): Qwen2's decoder without q/k/v biases, plus an RMSNorm over each head's query and
key before RoPE (``q_norm``, ``k_norm``), and a ``head_dim`` of 128 at every size, independent of
``hidden_size / num_attention_heads``. 0.6B, 1.7B and 4B tie the input and output embeddings.
"""

from dataclasses import dataclass

from torch import nn

from mtune.modules.attention import QKNormAttention
from mtune.modules.transformer import DecoderArgs


@dataclass
class Qwen3Args(DecoderArgs):
    family = "qwen3"
    tokenizer_families = ("qwen3",)
    vocab_size: int = 151936
    head_dim: int | None = 128
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960

    def attention(self, layer: int) -> nn.Module:
        return QKNormAttention(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.norm_eps)


# The Hub's config.json of Qwen/Qwen3-<size> (all: 8 KV heads, head_dim 128, rope_theta 1e6, 40960 positions).
QWEN3_SIZES = {
    "0.6B": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, intermediate_dim=3072, tie_embeddings=True),
    "1.7B": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, intermediate_dim=6144, tie_embeddings=True),
    "4B": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, intermediate_dim=9728, tie_embeddings=True),
    "8B": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, intermediate_dim=12288),
    "14B": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, intermediate_dim=17408),
    "32B": dict(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, intermediate_dim=25600),
    # NF4-friendly test shape, tied like the small sizes; 8 heads of 64 make q_proj 512 wide on a 256-wide model,
    # so head_dim is independent of dim / n_heads as in the real sizes.
    "tiny": dict(vocab_size=512, dim=256, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=64, intermediate_dim=512,
                 max_seq_len=512, tie_embeddings=True),
}
