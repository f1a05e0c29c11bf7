"""MXFP4, the format of the published gpt-oss experts: each run of 32 values along a row is one group of 32 FP4 (E2M1)
codes, two to a byte (``*_blocks [..., groups, 16]`` uint8, the low nibble first), sharing one power-of-two scale
(``*_scales [..., groups]`` uint8, E8M0: ``2 ** (s - 127)``). The checkpoints hold the experts so as ``[n_experts,
out, groups, 16]``: dequantized, ``[n_experts, out, in]``, mtune's :class:`~mtune.modules.expert_linear.ExpertLinear`
rows (transformers transposes them to its ``[n_experts, in, out]``).

FP4 codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 the same values negated. Every code times its scale is
exact in fp32 (a 2-bit mantissa times a power of two), so the one rounding is the cast to ``dtype``: the values equal
transformers' ``convert_moe_packed_tensors`` bit for bit (tests/mtune/models/test_gpt_oss.py).
"""

import torch

__all__ = ["FP4_VALUES", "dequantize_mxfp4"]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each E2M1 code."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
                     ) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in ``dtype`` (see the module
    docstring). Raises ValueError when their leading shapes differ."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks "
                         "must be [..., groups, 16] and scales [..., groups]")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    exponents = scales.to(torch.int32) - 127
    values = table[codes.long()] * torch.exp2(exponents.to(torch.float32))[..., None]
    return values.flatten(-2).to(dtype)
