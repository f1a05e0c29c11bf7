"""Gemma 4's block: Gemma's four-norm sandwich, a third residual branch fed by the layer's own input, a scalar; and
the 26B-A4B's, with a mixture of experts beside the dense MLP."""

import torch
from torch import nn

from mtune.modules.feed_forward import gelu_tanh
from mtune.modules.moe import Experts, Router, dispatch, use_grouped
from mtune.modules.rms_norm import FP32RMSNorm, rms_normalize


class PerLayerInputBlock(nn.Module):
    """``h = x + post_attn_norm(attn(input_norm(x)))``, ``h = h + post_ff_norm(mlp(pre_ff_norm(h)))``, then with
    a per-layer input ``p`` (``[b, s, per_layer_dim]``) ``h = h + post_per_layer_input_norm(per_layer_projection(
    gelu_tanh(per_layer_input_gate(h)) * p))``, and the output ``h * layer_scalar``.

    Called ``block(x, cos, sin, mask, cache_pos, segments, per_layer_input, k, v) -> (h, k, v)``, tensors (and
    ``segments``, a tensor and an int; so checkpointing, ``compile`` and FSDP wrap it unchanged): ``k, v`` are the
    keys and values a shared-KV attention reuses (None for a layer that makes its own), and the ones it attended to
    come back out.

    Args:
        attention: a :class:`~mtune.modules.shared_kv_attention.NormedKVAttention` or ``SharedKVAttention``.
        per_layer_dim: width of the per-layer input (``hidden_size_per_layer_input``); 0: no third branch.
    ``layer_scalar`` (``[1]``, ones) is a frozen parameter (transformers keeps it as a buffer; same checkpoint key).
    """

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, mlp: nn.Module, per_layer_dim: int = 0) -> None:
        super().__init__()
        self.input_layernorm = FP32RMSNorm(dim, norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = FP32RMSNorm(dim, norm_eps)
        self.pre_feedforward_layernorm = FP32RMSNorm(dim, norm_eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = FP32RMSNorm(dim, norm_eps)
        if per_layer_dim:
            self.per_layer_input_gate = nn.Linear(dim, per_layer_dim, bias=False)
            self.per_layer_projection = nn.Linear(per_layer_dim, dim, bias=False)
            self.post_per_layer_input_norm = FP32RMSNorm(dim, norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def initializers(self, std: float = 0.02):
        """What ``TransformerDecoder.init_weights`` fills beyond linears and norms: the scalar, with ones."""
        yield "layer_scalar", nn.init.ones_

    def forward(self, x, cos, sin, mask=None, cache_pos=None, segments=None, per_layer_input=None, k=None, v=None):
        attended, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache_pos, segments, k, v)
        h = x + self.post_attention_layernorm(attended)
        h = h + self.post_feedforward_layernorm(self.feed_forward(h))
        if per_layer_input is not None:
            gated = gelu_tanh(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar, k, v

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The MLP branch before ``post_feedforward_layernorm``: ``mlp(pre_feedforward_layernorm(h))``."""
        return self.mlp(self.pre_feedforward_layernorm(h))


class ScaledRouter(nn.Module):
    """Gemma 4's router (a block's ``router``): the block input RMS-normalised without a weight, times ``scale
    [dim]`` and ``dim ** -0.5``, into the :class:`~mtune.modules.moe.Router` ``proj`` (softmax in fp32, the ``top_k`` largest
    renormalised to sum to 1); each chosen expert's weight is then multiplied by its ``per_expert_scale
    [n_experts]``. Both scales start at ones. Returns what :class:`~mtune.modules.moe.Router` does."""

    def __init__(self, dim: int, n_experts: int, top_k: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.proj = Router(dim, n_experts, top_k, norm_topk_prob=True)
        self.scale = nn.Parameter(torch.ones(dim))
        self.per_expert_scale = nn.Parameter(torch.ones(n_experts))

    def initializers(self, std: float = 0.02):
        """What ``TransformerDecoder.init_weights`` fills beyond ``proj``: both scales with ones."""
        yield "scale", nn.init.ones_
        yield "per_expert_scale", nn.init.ones_

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [n, dim]`` -> ``(logits [n, n_experts], weights [n, top_k], experts [n, top_k])``."""
        logits, weights, experts = self.proj(rms_normalize(x, self.eps) * self.scale * self.dim**-0.5)
        return logits, weights * self.per_expert_scale[experts], experts


class PerLayerInputMoEBlock(PerLayerInputBlock):
    """Gemma 4 26B-A4B's block: :class:`PerLayerInputBlock` whose MLP branch is the dense MLP and a mixture of
    experts side by side, both on the attention's output ``h``:

    ``post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h))) + post_feedforward_layernorm_2(experts(
    pre_feedforward_layernorm_2(h)))``, the experts weighted by ``router(h)`` (routed on ``h`` itself, not a normed
    copy: the router norms it its own way), then ``post_feedforward_layernorm`` as in the dense block.

    Args:
        router: a :class:`ScaledRouter` (``router.proj``, ``router.scale``,
            ``router.per_expert_scale``, transformers' names).
        experts: an :class:`~mtune.modules.moe.Experts` (``experts.{gate,up,down}_proj``).
    Attributes:
        expert_compute: ``auto`` (default), ``grouped`` or ``loop``, as :class:`~mtune.modules.moe.MoE`'s.
    """

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, mlp: nn.Module, router: ScaledRouter,
                 experts: Experts, per_layer_dim: int = 0) -> None:
        super().__init__(dim, norm_eps, attention, mlp, per_layer_dim)
        self.router, self.experts = router, experts
        self.post_feedforward_layernorm_1 = FP32RMSNorm(dim, norm_eps)
        self.pre_feedforward_layernorm_2 = FP32RMSNorm(dim, norm_eps)
        self.post_feedforward_layernorm_2 = FP32RMSNorm(dim, norm_eps)
        self.expert_compute = "auto"

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(super().feed_forward(h))
        flat = h.reshape(-1, h.shape[-1])
        _, weights, chosen = self.router(flat)
        rows = self.pre_feedforward_layernorm_2(flat)
        routed = dispatch(self.experts, rows, weights, chosen, use_grouped(self.experts, rows, self.expert_compute))
        return dense + self.post_feedforward_layernorm_2(routed.view(h.shape))
