"""The decoder-only transformer shared by every family: embedding, a stack of blocks, final norm, output head.

Each family picks the stack: :meth:`DecoderArgs.block` builds block ``i`` from the parts in :mod:`mtune.modules`
(Llama's pre-norm block of attention and SwiGLU MLP by default; a family's arguments override :meth:`~DecoderArgs
.attention` or :meth:`~DecoderArgs.block` for another attention, MLP or norm). The decoder reads no family flag.

Module names are Hugging Face's (``embed_tokens``, ``layers[i].self_attn.q_proj``, ``lm_head``...), so checkpoints
map by stripping ``model.`` and adapters target modules by their HF names (experts: ``expert_checkpoint_layout``).
"""

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from mtune.config.keys import ATTENTION_KERNELS
from mtune.modules.attention import Attention
from mtune.modules.expert_layout import ExpertLayout
from mtune.modules.feed_forward import FeedForward
from mtune.modules.kv_cache import KVCache
from mtune.modules.packed_attention import Segments, batch_segments, kernel_for, segments_apply
from mtune.modules.pre_norm_block import TransformerBlock
from mtune.modules.rms_norm import RMSNorm
from mtune.modules.rotary import RotaryEmbedding


@dataclass
class DecoderArgs:
    """Hyper-parameters of a decoder. Each family subclasses this with its own defaults."""

    family: ClassVar[str] = "decoder"
    tokenizer_families: ClassVar[tuple[str, ...]] = ()  # tokenizers.loader.FAMILIES its checkpoints use; (): any
    decoder: ClassVar[type | None] = None  # the decoder's class: None is TransformerDecoder (Gemma 4's subclasses it)
    expert_checkpoint_layout: ClassVar[ExpertLayout] = ExpertLayout.PER_EXPERT  # how its checkpoints hold experts

    vocab_size: int = 32000
    """Rows of ``embed_tokens`` and ``lm_head``."""
    dim: int = 4096
    """Model width (``hidden_size``)."""
    n_layers: int = 32
    """Number of blocks (``num_hidden_layers``)."""
    n_heads: int = 32
    """Query heads (``num_attention_heads``)."""
    n_kv_heads: int = 32
    """Key/value heads (``num_key_value_heads``); fewer than ``n_heads`` is grouped-query attention."""
    head_dim: int | None = None
    """Per-head width; ``None`` means ``dim // n_heads``."""
    intermediate_dim: int = 11008
    """SwiGLU hidden width (``intermediate_size``)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (``rms_norm_eps``)."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    rope_scaling: dict | None = None
    """``None``, or Llama 3.1's ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``."""
    max_seq_len: int = 4096
    """Longest context the model was trained for (``max_position_embeddings``)."""
    tie_embeddings: bool = False
    """``lm_head`` shares its weight with ``embed_tokens`` (``tie_word_embeddings``)."""
    qkv_bias: bool = False
    """``q_proj``, ``k_proj``, ``v_proj`` carry a bias (Qwen2; Llama's ``attention_bias``)."""
    sliding_window: int | None = None
    """Each token attends to at most this many tokens (itself included); ``None`` for full attention."""

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads

    def rope(self) -> RotaryEmbedding:
        """The rotary tables every block shares (a family with partial rotation overrides this)."""
        return RotaryEmbedding(self.head_dim, self.rope_theta, self.rope_scaling)

    def attention_kinds(self) -> dict[str, "LayerKind | tuple[RotaryEmbedding, int | None]"]:
        """Each kind of attention layer by name: its rotary tables and sliding window, a :class:`LayerKind` or a
        pair ``(rope, window)``; several for ``layer_types`` (Gemma 3, 4, Qwen3.5), :meth:`layer_kind` naming each's."""
        return {"attention": (self.rope(), self.sliding_window)}

    def layer_kind(self, layer: int) -> str:  # the key of attention_kinds() that block `layer` uses
        return "attention"

    def embedding(self) -> nn.Module:  # embed_tokens (Gemma's is scaled) and the final norm (Gemma's: 1 + weight)
        return nn.Embedding(self.vocab_size, self.dim)

    def final_norm(self) -> nn.Module:
        return RMSNorm(self.dim, self.norm_eps)

    def attention(self, layer: int) -> nn.Module:
        """The self-attention of block ``layer`` (plain grouped-query attention; families override)."""
        return Attention(self.dim, self.n_heads, self.n_kv_heads, self.head_dim, self.qkv_bias, self.sliding_window)

    def block(self, layer: int) -> nn.Module:
        """Block ``layer``: a pre-norm :class:`TransformerBlock` of :meth:`attention` and a SwiGLU MLP."""
        return TransformerBlock(self.dim, self.norm_eps, self.attention(layer),
                                FeedForward(self.dim, self.intermediate_dim))


class LayerKind(NamedTuple):
    """What the blocks of one kind need computed once per forward: rotary tables (``rope``; None for a layer that
    uses none), a sliding ``window`` (None: all earlier tokens), and whether the layer is ``recurrent`` (linear
    attention: it reads no mask, and packed documents reach it as segment boundaries, whatever the attention
    kernel setting, so its state restarts at each). ``sinks``: sink logits (gpt-oss), which varlen cannot take."""

    rope: RotaryEmbedding | None
    window: int | None = None
    recurrent: bool = False
    sinks: bool = False


class TransformerDecoder(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and output projection.

    Build on the meta device and materialise later to avoid allocating weights twice::

        with torch.device("meta"):
            model = TransformerDecoder(args)
        model.to_empty(device="cuda"); model.init_weights()   # or load a checkpoint into it

    Attributes:
        attention_kernel: one of :data:`ATTENTION_KERNELS`, for packed batches and rows longer than the sliding
            window: ``auto`` (default), ``segments`` or the ``dense_mask`` fallback, all equal up to round-off.
        attention_kernels_run: the attention kernels the forwards so far ran (``sdpa_causal``, ``dense_mask``,
            ``sdpa_per_segment``, ``varlen_flash``, ``kv_cache_mask``), for a run's log and results.
    """

    def __init__(self, args: DecoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = args.embedding()
        self.layers = nn.ModuleList(args.block(i) for i in range(args.n_layers))
        self.norm = args.final_norm()
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        # rotary tables and window per kind of layer, computed once per forward; the tables hold no state
        self.kinds = {name: LayerKind(*kind) for name, kind in args.attention_kinds().items()}
        self.layer_kinds = [args.layer_kind(i) for i in range(args.n_layers)]
        self.rope = next((kind.rope for kind in self.kinds.values() if kind.rope is not None), None)
        self._next_pos = 0  # decoding position while caches are enabled
        self.attention_kernel = "auto"
        self.attention_kernels_run: set[str] = set()
        self.tie_weights()

    # ---------------------------------------------------------------- weights
    def tie_weights(self) -> None:
        """Share ``embed_tokens.weight`` with ``lm_head`` when ``args.tie_embeddings`` (re-run after assigning)."""
        if self.args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def initializers(self, std: float = 0.02) -> Iterator[tuple[str, Callable[[torch.Tensor], object]]]:
        """``(parameter name, fill)`` for every parameter, in the order :meth:`init_weights` draws from torch's RNG:
        normal(0, std) for linear and embedding weights (adapters' included), zeros for biases, ones for norms.
        ``fill(t)`` fills a tensor of the parameter's full shape in place; a tied ``lm_head.weight`` is listed (drawn)
        twice. The sharded setup fills full tensors with these and keeps each rank's rows: a single device's values."""
        normal = functools.partial(nn.init.normal_, std=std)
        for name, module in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, (nn.Linear, nn.Embedding)):
                yield f"{prefix}weight", normal
                if getattr(module, "bias", None) is not None:
                    yield f"{prefix}bias", nn.init.zeros_
            elif isinstance(module, RMSNorm):
                yield f"{prefix}weight", module.initial_fill
            if hasattr(module, "initializers") and module is not self:  # a block's own parameters (Gated DeltaNet)
                for name, fill in module.initializers(std):
                    yield f"{prefix}{name}", fill

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random initialisation by :meth:`initializers`, e.g. after ``to_empty``."""
        for name, fill in self.initializers(std):
            fill(self.get_parameter(name))
        self.tie_weights()

    # ----------------------------------------------------------------- caches
    def setup_caches(self, batch_size: int, max_seq_len: int, dtype: torch.dtype | None = None) -> None:
        """Allocate each layer's cache for generation: keys and values per attention layer, a state of constant size
        per recurrent layer (its mixer's ``setup_state``); positions then continue from the last call."""
        param = self.embed_tokens.weight
        dtype = dtype or param.dtype
        for mixer, slot in self._cache_slots():
            if slot == "kv_cache":
                mixer.kv_cache = KVCache(batch_size, max_seq_len, mixer.n_kv_heads, mixer.head_dim, dtype, param.device)
            else:
                mixer.setup_state(batch_size, dtype, param.device)
        self._next_pos = 0

    def _cache_slots(self) -> Iterator[tuple[nn.Module, str]]:  # each block's mixer and its cache's attribute
        for layer, kind in zip(self.layers, self.layer_kinds):
            mixer = getattr(layer, getattr(layer, "mixer_name", "self_attn"))
            yield mixer, "decoding_state" if self.kinds[kind].recurrent else "kv_cache"

    def caches_are_enabled(self) -> bool:
        return any(getattr(mixer, slot) is not None for mixer, slot in self._cache_slots())

    def reset_caches(self) -> None:
        """Empty the caches (keeping them allocated; recurrent states zeroed) so the next call starts at position 0."""
        for mixer, slot in self._cache_slots():
            if getattr(mixer, slot) is not None:
                getattr(mixer, slot).reset()
        self._next_pos = 0

    def remove_caches(self) -> None:
        for mixer, slot in self._cache_slots():
            setattr(mixer, slot, None)
        self._next_pos = 0

    # ---------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, return_hidden: bool = False, last_only: bool = False,
                longest_document: int | None = None) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` in the model's dtype (or hidden states ``[b, s, dim]`` with ``return_hidden``).

        Args:
            tokens: LongTensor ``[b, s]``. Right padding needs no mask: attention is causal.
            input_pos: LongTensor ``[b, s]``, each token's position within its own document (packed batches), or
                its absolute position when decoding with a cache. Default ``0..s-1`` (continuing from the previous
                call when caches are enabled).
            document_ids: LongTensor ``[b, s]`` for packed sequences: a token attends only to earlier tokens with
                the same id (each document one run of equal ids in its row, as packing writes them).
            return_hidden: return the final-norm hidden states, for losses that apply ``lm_head`` chunk by chunk.
            last_only: the last position's alone, ``[b, 1, ...]`` (a prompt's next token: the head skips the rest).
            longest_document: a bound on ``document_ids``' documents' lengths, known on the host (the collator's),
                by which the varlen kernel sizes its work. Default the row length.
        """
        b, s = tokens.shape
        caching = self.caches_are_enabled()
        if input_pos is None:
            start = self._next_pos if caching else 0
            input_pos = torch.arange(start, start + s, device=tokens.device).expand(b, s)
        h = self.embed_tokens(tokens)
        inputs = {}  # per kind of layer: cos, sin, mask, cache_pos, segments
        for name, kind in self.kinds.items():
            rope = (None, None) if kind.rope is None else kind.rope(input_pos, h.dtype)
            inputs[name] = (*rope, *self._attention_layout(input_pos, document_ids, caching, kind, longest_document))
        stream, h = [h], None  # handed over in a list the callee empties: no frame here holds the embeddings
        h = self.run_layers(stream, tokens, inputs, last_only)
        if caching:
            self._next_pos = int(input_pos[0, -1]) + 1
        h = self.norm(h[:, -1:] if last_only else h)
        return h if return_hidden else self.lm_head(h)

    def run_layers(self, stream: list[torch.Tensor], tokens: torch.Tensor, inputs: dict[str, tuple],
                   last_only: bool = False) -> torch.Tensor:
        """``[h]`` (``[b, s, dim]``, popped) through every block with its kind's ``inputs`` (``tokens``, ``last_only``:
        for subclasses; ``[b, s, dim]`` comes back all the same)."""
        h = stream.pop()
        for layer, kind in zip(self.layers, self.layer_kinds):
            h = layer(h, *inputs[kind])
        return h

    def _attention_layout(self, input_pos, document_ids, caching, kind=LayerKind(None), longest_document=None
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None, Segments | None]:
        """What each block of ``kind`` needs besides rotary tables, once per forward: ``(mask, cache_pos, segments)``.

        Plain causal rows: all None (SDPA's causal fast path). Packed rows, or rows longer than the sliding window:
        :class:`~mtune.modules.packed_attention.Segments` or a dense mask, as ``attention_kernel`` says (recurrent
        layers: packed rows' segments). Decoding with a KV cache: a mask against the cache and the cache slots."""
        b, s = input_pos.shape
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention_kernel={self.attention_kernel!r}: use one of {ATTENTION_KERNELS}")
        packed, window = document_ids is not None, kind.window
        if kind.recurrent:
            return None, None, batch_segments(document_ids, b, s, None, longest_document) if packed else None
        if not caching and segments_apply(self.attention_kernel, s) and (packed or (window is not None and s > window)):
            device = input_pos.device
            dtype = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                     else self.embed_tokens.weight.dtype)
            self.attention_kernels_run.add(kernel_for(device, dtype, window, kind.sinks))
            return None, None, batch_segments(document_ids, b, s, device, longest_document)
        mask, cache_pos = self._mask(input_pos, document_ids, caching, window)
        self.attention_kernels_run.add("kv_cache_mask" if caching else "sdpa_causal" if mask is None else "dense_mask")
        return mask, cache_pos, None

    def _mask(self, input_pos, document_ids, caching, window=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Boolean attention mask ``[b, 1, s, kv_len]`` (None means SDPA's causal fast path) and cache slots."""
        if caching:
            if document_ids is not None:
                raise ValueError("document_ids (packed sequences) cannot be combined with a KV cache")
            cache_len = next(m.kv_cache for m, slot in self._cache_slots() if slot == "kv_cache").k.shape[2]
            q_pos = input_pos[:, None, :, None]
            k_pos = torch.arange(cache_len, device=input_pos.device)
            mask = k_pos <= q_pos
            if window is not None:
                mask = mask & (k_pos > q_pos - window)
            return mask, input_pos[0]
        s = input_pos.shape[1]
        if document_ids is None and (window is None or s <= window):
            return None, None
        idx = torch.arange(s, device=input_pos.device)
        mask = idx[None, :] <= idx[:, None]
        if window is not None and s > window:
            mask = mask & (idx[None, :] > idx[:, None] - window)
        mask = mask[None, None]
        if document_ids is not None:
            mask = mask & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
        return mask, None
