"""Gemma 4's decoder: per-layer input embeddings, and keys and values handed from earlier layers to later ones.

Per-layer embeddings (PLE): besides ``embed_tokens``, a second table ``embed_tokens_per_layer`` (``[per_layer_vocab,
n_layers * p]``, scaled by ``sqrt(p)``) gives each token ``p`` features per layer; a projection of the token
embeddings (``per_layer_model_projection``, ``[n_layers * p, dim]``, scaled by ``1 / sqrt(dim)``, then
``per_layer_projection_norm`` over each layer's ``p``) is added and the sum divided by ``sqrt(2)``. Block ``i``
takes slice ``i`` as its per-layer input (:class:`~mtune.modules.per_layer_block.PerLayerInputBlock`).

Shared keys and values: block ``i`` with ``args.kv_source(i) = j`` attends to the keys and values block ``j`` made;
the decoder keeps those of each source block until the forward ends (they are live anyway: the later layers' backward
needs them) and hands them over as tensors, so blocks stay callable with tensors only.

Generation with a KV cache: only the layers that make keys and values get a cache. A source layer writes the new
tokens' keys (normed, rotated) and values (normed) into it and hands on the whole cache, which the reusing layers
attend to under the mask of their kind (sliding or global: the same as their source's), exactly as in training,
where the source hands on the keys and values of the whole sequence.
"""

import torch
from torch import nn

from mtune.modules.rms_norm import FP32RMSNorm
from mtune.modules.sandwich_block import ScaledEmbedding
from mtune.modules.softcap import SoftcappedLinear
from mtune.modules.transformer import TransformerDecoder


class PerLayerInputDecoder(TransformerDecoder):
    """:class:`TransformerDecoder` for blocks called ``block(h, cos, sin, mask, cache_pos, segments,
    per_layer_input, k, v) -> (h, k, v)``. ``args`` adds ``per_layer_dim`` (0: no per-layer inputs),
    ``per_layer_vocab_size``, ``kv_source(i)`` (the block whose keys and values block ``i`` reuses, or None) and
    ``final_logit_softcap`` (the head's :class:`~mtune.modules.softcap.SoftcappedLinear`; None: a plain head).
    With caches set up (generation, task evaluation), the reusing layers have none of their own: they attend to their
    source layer's cache, handed over as in training."""

    def __init__(self, args) -> None:
        super().__init__(args)
        p = args.per_layer_dim
        if p:
            self.embed_tokens_per_layer = ScaledEmbedding(args.per_layer_vocab_size, args.n_layers * p, p**0.5)
            self.per_layer_model_projection = nn.Linear(args.dim, args.n_layers * p, bias=False)
            self.per_layer_projection_norm = FP32RMSNorm(p, args.norm_eps)
        self.kv_sources = [args.kv_source(i) for i in range(args.n_layers)]
        # the first of the trailing layers that reuse others' keys and values (n_layers: none)
        self.reusing_from = next(i for i in range(args.n_layers, 0, -1) if self.kv_sources[i - 1] is None)
        if args.final_logit_softcap is not None:
            self.lm_head = SoftcappedLinear(args.dim, args.vocab_size, args.final_logit_softcap)
            self.tie_weights()

    def _cache_slots(self):
        """`TransformerDecoder._cache_slots` but the reusing layers': they keep no cache and read their source's, so
        setup_caches gives a KV cache (of each layer's own head count and size) only to the layers that make keys
        and values."""
        return (slot for slot, source in zip(super()._cache_slots(), self.kv_sources) if source is None)

    def per_layer_inputs(self, tokens: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor | None:
        """``[b, s, n_layers, p]`` from the tokens ``[b, s]`` and their scaled embeddings ``[b, s, dim]``."""
        if not self.args.per_layer_dim:
            return None
        b, s = tokens.shape
        shape = (b, s, self.args.n_layers, self.args.per_layer_dim)
        projected = self.per_layer_model_projection(embedded) * self.args.dim**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + self.embed_tokens_per_layer(tokens).reshape(shape)) * 2.0**-0.5

    def run_layers(self, stream: list[torch.Tensor], tokens: torch.Tensor, inputs: dict[str, tuple],
                   last_only: bool = False) -> torch.Tensor:
        """As `TransformerDecoder.run_layers`; a prompt asked for its last position alone (``last_only``) with caches
        set up runs the reusing layers at the end of the stack on that position only: they write no cache, and no
        later layer reads them (``[b, 1, dim]`` comes back)."""
        h = stream.pop()
        per_layer = self.per_layer_inputs(tokens, h)
        sources = set(self.kv_sources)
        kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_kinds)):
            if i == self.reusing_from and last_only and self.caches_are_enabled() and h.shape[1] > 1:
                h = h[:, -1:]
                per_layer = None if per_layer is None else per_layer[:, -1:]
                inputs = {name: _last_position(*args) for name, args in inputs.items()}
            k, v = kept.get(self.kv_sources[i], (None, None))
            h, k, v = layer(h, *inputs[kind], None if per_layer is None else per_layer[:, :, i], k, v)
            if i in sources:
                kept[i] = (k, v)
        return h


def _last_position(cos, sin, mask, cache_pos, segments) -> tuple:
    """A kind's attention inputs (`TransformerDecoder.forward`: rotations ``[b, s, d]``, the cache mask ``[b, 1, s,
    cache_len]``, the cache slots ``[s]``) for the last position's query alone."""
    return (cos[:, -1:], sin[:, -1:], None if mask is None else mask[:, :, -1:],
            None if cache_pos is None else cache_pos[-1:], segments)
