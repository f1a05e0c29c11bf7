"""What a Gated DeltaNet layer carries between forwards while generating, and its recurrence a token at a time.

A DeltaNet layer needs no KV cache: everything later tokens read of earlier ones is in two tensors of fixed size,
the causal convolution's last ``taps - 1`` inputs and each value head's ``[k_head_dim, v_head_dim]`` state. So a
decoding step costs the same at token 10 and at token 100,000 (no attention over a growing cache), and the state's
memory does not grow with the context: ``b x (channels x (taps - 1))`` values in the model's dtype plus ``b x
n_v_heads x k_head_dim x v_head_dim`` fp32 values per layer (Qwen3.5 9B: 24 layers of 32 x 128 x 128 fp32, 48 MiB
a row, and 1.1 MiB of bf16 convolution inputs; ``test_qwen3_5.py`` counts them).

The prompt runs the chunked form from the carried state (:func:`~mtune.modules.gated_deltanet
.chunked_gated_delta_rule` with ``state``); calls of a few tokens (:data:`STEPPED_UP_TO`) run
:func:`gated_delta_steps`, the rule itself; both update the state in place. Both are PyTorch on every device:
flash-linear-attention's kernel serves training only.
"""

import torch
import torch.nn.functional as F
from torch import nn

STEPPED_UP_TO = 8
"""Calls of at most this many tokens (a generated token, a short draft) step the recurrence token by token; longer
ones (a prompt) run the chunked form from the carried state."""


class DeltaNetState(nn.Module):
    """The decoding state of one Gated DeltaNet layer for ``batch_size`` rows, zero at the start.

    Buffers: ``conv`` ``[b, channels, taps - 1]`` in ``dtype``, the convolution's last inputs (zeros: its own left
    padding, so a zero state is a fresh sequence); ``recurrent`` ``[b, n_v_heads, k_head_dim, v_head_dim]`` fp32,
    each value head's state (zeros: nothing written yet).
    """

    def __init__(self, batch_size: int, channels: int, taps: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("conv", torch.zeros(batch_size, channels, taps - 1, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("recurrent", torch.zeros(batch_size, n_v_heads, k_head_dim, v_head_dim,
                                                      dtype=torch.float32, device=device), persistent=False)

    def reset(self) -> None:
        """Back to a fresh sequence: both buffers zeroed, kept allocated."""
        self.conv.zero_()
        self.recurrent.zero_()

    def convolve(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Depthwise causal convolution of ``x`` ``[b, channels, s]`` by ``weight`` ``[channels, 1, taps]``, the
        taps before ``x`` reading the carried inputs, which become the last ``taps - 1`` of them. Returns ``[b,
        channels, s]`` in ``x``'s dtype."""
        if x.shape[0] != self.conv.shape[0]:
            raise ValueError(f"a batch of {x.shape[0]} rows against a Gated DeltaNet state set up for "
                             f"{self.conv.shape[0]}: call setup_caches with this batch size")
        joined = torch.cat([self.conv.to(x.dtype), x], dim=-1)
        self.conv.copy_(joined[..., joined.shape[-1] - self.conv.shape[-1]:])
        return F.conv1d(joined, weight, groups=x.shape[1])


def gated_delta_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      state: torch.Tensor) -> torch.Tensor:
    """The gated delta rule a token at a time from ``state``, which it updates in place.

    Args:
        q, k: ``[b, heads, s, k_head_dim]``, already normalised and (``q``) scaled.
        v: ``[b, heads, s, v_head_dim]``.
        g, beta: ``[b, heads, s]``, log decays (<= 0) and write strengths.
        state: ``[b, heads, k_head_dim, v_head_dim]`` fp32: per token, decayed by ``exp(g)``, then written
            ``k (beta (v - S^T k))^T`` (the correction of what it predicts for ``k``), then read by ``q``.

    Returns:
        ``[b, heads, s, v_head_dim]`` fp32.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    outputs = []
    for t in range(q.shape[2]):
        state.mul_(g[:, :, t, None, None].exp())
        key = k[:, :, t, None]  # [b, heads, 1, k_head_dim]
        delta = beta[:, :, t, None, None] * (v[:, :, t, None] - key @ state)
        state.add_(key.transpose(-1, -2) @ delta)
        outputs.append(q[:, :, t, None] @ state)
    return torch.cat(outputs, dim=2)
