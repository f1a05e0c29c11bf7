"""Rotary position embeddings (RoPE), with Llama 3.1's frequency scaling, Phi-3/4's LongRoPE, YaRN (gpt-oss) and
partial rotation."""

import math

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) for rotary embeddings.

    Args:
        head_dim: the rotated width of a head (all of it but under partial rotation); rotated in two halves (the
            "rotate half" layout Hugging Face checkpoints use).
        theta: the base wavelength (``rope_theta``).
        scaling: ``None`` for plain RoPE, or Llama 3.1's ``{"rope_type": "llama3", "factor",
            "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``: long wavelengths are
            stretched by ``factor``, short ones kept, and the band between is interpolated smoothly. (LongRoPE's
            two sets of frequencies: :func:`longrope_inv_freq`.) Gemma 4's ``{"rope_type": "proportional",
            "partial_rotary_factor": p}`` (``factor`` optional): the first ``p * head_dim / 2`` frequencies of the
            whole head's spectrum, the rest zero (those feature pairs pass unrotated), all divided by ``factor``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or scaling["rope_type"] == "longrope":
        return inv_freq
    if scaling["rope_type"] == "proportional":
        rotated = int(scaling["partial_rotary_factor"] * head_dim // 2)
        inv_freq = torch.cat([inv_freq[:rotated], inv_freq.new_zeros(head_dim // 2 - rotated)])
        return inv_freq / scaling.get("factor", 1.0)
    if scaling["rope_type"] == "linear":  # positions divided by ``factor`` (Gemma 3's global layers)
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling, device)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    stretched = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, stretched)


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict, device=None) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies whose wavelength fits ``beta_fast`` times or more into the original context
    ``original_max_position_embeddings`` are kept, those fitting ``beta_slow`` times or fewer are divided by
    ``factor``, and a linear ramp over the dimensions between blends the two. With ``truncate`` (YaRN's default;
    gpt-oss sets it false) the ramp's ends are rounded out to whole dimensions. ``cos`` and ``sin`` are then scaled
    by :func:`yarn_attention_factor`."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    base = theta**exponents
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times into the context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.get("beta_fast") or 32.0), dim_of(scaling.get("beta_slow") or 1.0)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the original frequency, 0: divided by factor
    return (1.0 / (factor * base)) * (1 - kept) + (1.0 / base) * kept


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's scale of ``cos`` and ``sin``: ``attention_factor`` when given, else ``0.1 ln(factor) + 1`` (or the
    ratio of two such terms with ``mscale`` and ``mscale_all_dim``), 1 for ``factor <= 1``."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


def longrope_inv_freq(head_dim: int, theta: float, scaling: dict, positions: torch.Tensor) -> torch.Tensor:
    """LongRoPE (Phi-3, Phi-4): the base frequencies divided per dimension by ``short_factor``, or by
    ``long_factor`` once the row reaches past ``original_max_position_embeddings`` (its largest position + 1, as
    transformers decides; chosen on the device, without a host sync)."""
    inv_freq = rope_inv_freq(head_dim, theta, None, device=positions.device)
    short = torch.tensor(scaling["short_factor"], dtype=torch.float32, device=positions.device)
    long = torch.tensor(scaling["long_factor"], dtype=torch.float32, device=positions.device)
    beyond = positions.max() + 1 > scaling["original_max_position_embeddings"]
    return inv_freq / torch.where(beyond, long, short)


class RotaryEmbedding(nn.Module):
    """Computes ``cos, sin`` tables for given token positions.

    Holds no state: the inverse frequencies are recomputed on the positions' device at each call (``head_dim / 2``
    numbers), so a model built on the meta device needs nothing restored after ``to_empty``.

    Args:
        head_dim: the rotated width of each head: the whole head, or its first part under partial rotation (Phi-4:
            0.75 of it; attention passes the rest through, see :func:`apply_rotary`).
        theta: ``rope_theta``.
        scaling: see :func:`rope_inv_freq`; LongRoPE's (``rope_type: longrope``, with ``short_factor``,
            ``long_factor``, ``original_max_position_embeddings`` and ``attention_factor``) also scales ``cos`` and
            ``sin`` by ``attention_factor``; YaRN's (``rope_type: yarn``: ``factor``, ``beta_fast``, ``beta_slow``,
            ``original_max_position_embeddings``, ``truncate``) by :func:`yarn_attention_factor`.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.longrope = scaling is not None and scaling["rope_type"] == "longrope"
        self.scale = (yarn_attention_factor(scaling) if scaling is not None and scaling["rope_type"] == "yarn"
                      else None)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` LongTensor ``[b, s]`` -> ``cos, sin`` of shape ``[b, s, head_dim]`` in ``dtype``, the angles
        repeated over the two halves; ``sin``'s first half is negated (the sign of the rotation, applied once here
        instead of in every layer: see :func:`apply_rotary`)."""
        if self.longrope:
            inv_freq = longrope_inv_freq(self.head_dim, self.theta, self.scaling, positions)
        else:
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, device=positions.device)
        angles = positions.float()[..., None] * inv_freq
        sin = angles.sin()
        if self.longrope:
            scale = self.scaling["attention_factor"]
            return ((torch.cat([angles, angles], dim=-1).cos() * scale).to(dtype),
                    (torch.cat([-sin, sin], dim=-1) * scale).to(dtype))
        if self.scale is not None:  # YaRN: cos and sin scaled in fp32 before the cast, as transformers does
            return ((torch.cat([angles, angles], dim=-1).cos() * self.scale).to(dtype),
                    (torch.cat([-sin, sin], dim=-1) * self.scale).to(dtype))
        return torch.cat([angles, angles], dim=-1).cos().to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, heads, s, head_dim]`` by the angles in ``cos, sin`` ``[b, s, head_dim]`` as
    :class:`RotaryEmbedding` returns them (``sin``'s first half negated): with ``x = [x1, x2]`` by halves,
    ``[x1 cos - x2 sin, x2 cos + x1 sin]``, computed as ``x * cos + [x2, x1] * sin``: a roll and a fused
    multiply-add (1.5x faster forward + backward on CPU than negating and concatenating halves in every layer).

    Tables narrower than ``x`` (partial rotation) rotate its first ``cos.shape[-1]`` features and pass the rest."""
    width = cos.shape[-1]
    if width != x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :width], cos, sin), x[..., width:]], dim=-1)
    return torch.addcmul(x * cos[:, None], x.roll(x.shape[-1] // 2, dims=-1), sin[:, None])
