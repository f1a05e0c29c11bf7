"""FLOPs per token of a training step, for a model as configured: the numerator of MFU and HFU.

Counted per sequence position of a ``[batch, seq_len]`` batch (a multiply-add is 2 FLOPs; elementwise work, norms,
softmax and the embedding lookup are left out, as in every published MFU figure):

- **forward**: ``2 * in * out`` for every linear layer (the output projection included), plus attention's two
  matmuls, ``QK^T`` and ``PV``: ``4 * seq_len * n_heads * head_dim`` per token and layer, counted over the full row
  (a causal or block-causal mask does not halve it: the dense-mask kernels compute the masked half too). Packed rows
  under the ``segments`` kernel (`mtune.modules.packed_attention`: ``attention_kernel=segments``, or ``auto`` above
  256 tokens a row) compute each document against itself only: there the row length is replaced by the
  token-weighted mean document length, ``sum(L_i²) / sum(L_i)`` over the micro-batch's documents (the padding tail
  of a pack counted as one document), i.e. ``4 * L_i² * n_heads * head_dim`` per document and layer: the same
  full-square convention, per document. Sliding windows are not taken off (the full row, or document, is counted).
- **backward**: for each linear, the input gradient (``2 * in * out``) when something below it trains, and the
  weight gradient (``2 * in * out``) when its weight trains; frozen base weights (LoRA, NF4) cost one, not two. A LoRA
  adapter (``A: in -> r``, ``B: r -> out``) adds its forward ``2r(in + out)``, its weight gradients ``2r(in + out)``,
  the gradient into ``B``'s input ``2r * out``, and ``2r * in`` into its layer's input when that input needs one.
  Attention backward is twice its forward whenever any of q, k, v needs a gradient. Which inputs need a gradient is
  followed through the model as autograd does: in a LoRA model the embedding is frozen, so the first block's
  q/k/v projections compute no input gradient.
- **recompute**: forward work done again in backward: each block that activation checkpointing wraps runs its
  forward again (up to the last tensor backward needs: all but ``down_proj``'s matmul, as
  ``torch.utils.checkpoint`` stops early; ``selective_op`` keeps every matmul and attention output, so its blocks
  recompute nothing counted); the tiled MLP (``mlp_tiles``, when a micro-batch runs over more than one tile) runs
  each block's MLP forward once more in backward (``gate``, ``up`` and ``down``, adapters included), and a block
  checkpointed under ``block`` then recomputes its MLP whole (``down_proj`` included: the tiled MLP's forward is one
  op to the checkpoint); and the chunked cross-entropy loss's output projection when it runs twice
  (``ChunkedCrossEntropyLoss.recomputes_projection``: a LoRA/NF4 head, one with hooks other than weight
  offloading's, or fp16 autocast; a plain head's gradients are computed with its forward, so its loss recomputes
  nothing).

``model = forward + backward`` gives MFU (model FLOPs utilisation); ``hardware = model + recompute`` gives HFU. For
a full fine-tune this is the familiar ``6N + 3A`` (``N`` matmul weights incl. the output projection, ``A`` attention
FLOPs per token of the forward), for LoRA about ``4N + 3A`` plus the adapters.

Not counted: DoRA's per-step weight norm (``||W + sBA||``, a cost per step, not per token), padding (MFU is computed
from non-padding tokens/s, so padded positions lower it, as they should), flash attention's internal recomputation of
the scores in backward (an implementation detail of the kernel, not a recomputation the run chose).

    fpt = flops_per_token(model, seq_len=2048, memory=MemoryConfig.from_config(cfg))
    mfu = fpt.model * tokens_per_second_per_device / peak_flops
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from mtune.modules.expert_linear import LoRAExpertLinear
from mtune.modules.lora import LoRALinear
from mtune.modules.moe import MoE
from mtune.modules.packed_attention import document_boundaries, segments_apply
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig

__all__ = ["FlopsPerToken", "StepFlops", "flops_per_token", "mean_document_length", "utilization"]


@dataclass(frozen=True)
class FlopsPerToken:
    """FLOPs of one training step divided by the positions in its batch, by kind (see the module docstring).

    ``parts`` splits ``model`` by where the work happens: ``linear`` (the blocks' projections, base weights),
    ``adapters`` (LoRA A/B), ``attention`` (QK^T and PV), ``output`` (the output projection ``lm_head``).
    """

    forward: float
    backward: float
    recompute: float
    seq_len: int
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def model(self) -> float:
        """Forward + backward: the numerator of MFU (recomputation not counted)."""
        return self.forward + self.backward

    @property
    def hardware(self) -> float:
        """Model FLOPs + recomputation: the numerator of HFU."""
        return self.model + self.recompute


@dataclass
class _Tally:
    forward: float = 0.0
    backward: float = 0.0
    recompute: float = 0.0
    last: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, fwd: float, bwd: float) -> None:
        self.forward += fwd
        self.backward += bwd
        self.parts[part] = self.parts.get(part, 0.0) + fwd + bwd


def _linear(tally: _Tally, linear: nn.Linear, input_grad: bool, part: str) -> bool:
    """Adds one linear layer's FLOPs per token; returns whether its output needs a gradient. Its last matmul's
    forward FLOPs go to ``tally.last`` (see :func:`_block`)."""
    fin, fout = linear.in_features, linear.out_features
    weight_grad = bool(linear.weight.requires_grad)
    base = 2.0 * fin * fout
    tally.add(part, base, base * (input_grad + weight_grad))
    tally.last = base
    adapter_trains = False
    if isinstance(linear, (LoRALinear, LoRAExpertLinear)):
        r = linear.rank
        a_grad, b_grad = linear.lora_a.weight.requires_grad, linear.lora_b.weight.requires_grad
        adapter_trains = a_grad or b_grad
        fwd = 2.0 * r * (fin + fout)
        bwd = 2.0 * r * (fin * a_grad + fout * b_grad)  # the adapters' weight gradients
        if adapter_trains or input_grad:
            bwd += 2.0 * r * fout  # gradient into B's input (A's output)
        if input_grad:
            bwd += 2.0 * r * fin  # gradient through A into the layer's input
        tally.add("adapters", fwd, bwd)
        tally.last = 2.0 * r * fout  # B runs after the base matmul
    return input_grad or weight_grad or adapter_trains


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _present(module: nn.Module, *names: str) -> list[nn.Module]:
    """The submodules of ``module`` by these names that it has (not None: Gemma 4's global layers set no ``v_proj``)."""
    return [getattr(module, name) for name in names if getattr(module, name, None) is not None]


def _linear_attention(tally: _Tally, mixer: nn.Module, x: bool) -> bool:
    """Adds a Gated DeltaNet (:class:`~mtune.modules.gated_deltanet.GatedDeltaNet`); returns whether its output
    needs a gradient. Its core is counted as the recurrence's model FLOPs, independent of the sequence length: per
    token and value head, reading the state's prediction for the key, writing the correction and reading the output,
    ``2 * k_head_dim * v_head_dim`` each (the chunked form's in-chunk matmuls are implementation, as attention's
    masked half is); the causal convolution ``2 * taps`` per channel."""
    grad = any([_linear(tally, m, x, "linear")
                for m in _present(mixer, "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]) or _trains(mixer)
    conv = 2.0 * mixer.conv1d.kernel_size[0] * mixer.conv_width
    core = 6.0 * mixer.n_v_heads * mixer.k_head_dim * mixer.v_head_dim
    tally.add("attention", conv + core, 2.0 * (conv + core) * grad)
    return _linear(tally, mixer.out_proj, grad, "linear")


def _block(tally: _Tally, block: nn.Module, stream_grad: bool, seq_len: float, checkpointed: str | None,
           tiled: bool = False) -> bool:
    """Adds one transformer block; returns whether the residual stream after it needs a gradient.

    A checkpointed block's recomputation stops once every tensor backward needs is back (torch.utils.checkpoint's
    early stop): the last matmul, ``down_proj``'s (its adapter's ``B`` under LoRA), feeds only the residual add,
    which saves nothing, so it is not run again. Under ``selective_op`` the block keeps every matmul and attention
    output, so what it recomputes is elementwise only: no counted FLOPs. ``tiled``: the MLP runs over tiles, its
    forward once more in backward (and whole in a ``block`` recompute)."""
    start = tally.forward
    mlp = block.mlp
    x = stream_grad or _trains(block.input_layernorm)
    if hasattr(block, "linear_attn"):
        h = _linear_attention(tally, block.linear_attn, x) or stream_grad
    else:
        attn = block.self_attn
        # separate q/k/v projections, or one fused qkv_proj (Phi-4); each counted as it runs
        attn_grad = any([_linear(tally, m, x, "linear")
                         for m in _present(attn, "q_proj", "k_proj", "v_proj", "qkv_proj")])
        core = 4.0 * seq_len * attn.n_heads * attn.head_dim
        tally.add("attention", core, 2.0 * core * attn_grad)
        h = _linear(tally, attn.o_proj, attn_grad, "linear") or stream_grad
    x = h or _trains(block.post_attention_layernorm)
    mlp_start = tally.forward
    down = _moe(tally, mlp, x) if isinstance(mlp, MoE) else _mlp(tally, mlp, x)
    if hasattr(block, "experts"):  # Gemma 4 26B-A4B's experts beside the dense MLP, routed on the same input
        routed = _linear(tally, block.router.proj, x, "linear") or x
        for _ in range(block.router.proj.top_k):
            routed = _mlp(tally, block.experts, x) or routed
        down = down or routed
    if hasattr(block, "per_layer_input_gate"):  # Gemma 4's third branch, fed by the stream and the layer's input
        gate = _linear(tally, block.per_layer_input_gate, h or down, "linear")
        down = _linear(tally, block.per_layer_projection, gate, "linear") or down
    if checkpointed == "block":
        tally.recompute += tally.forward - start - (0.0 if tiled else tally.last)
    if tiled:
        tally.recompute += tally.forward - mlp_start
    return h or down


def _mlp(tally: _Tally, mlp: nn.Module, x: bool) -> bool:
    gate_up = any([_linear(tally, m, x, "linear") for m in _present(mlp, "gate_proj", "up_proj", "gate_up_proj")])
    return _linear(tally, mlp.down_proj, gate_up, "linear")


def _moe(tally: _Tally, moe: MoE, x: bool) -> bool:
    """A token's share of a mixture of experts: the router, ``top_k`` experts (alike in shape and adapters), and
    the shared expert if any (with Qwen3.5-MoE's ``dim -> 1`` gate on it). Its output needs a gradient where any of
    them trains or the input needs one (the routing weights depend on the input)."""
    grad = _linear(tally, moe.router_layer, x, "linear") or x
    for _ in range(moe.top_k):
        grad = _mlp(tally, moe.experts, x) or grad  # each expert's slice of the stacked projections
    if moe.shared_expert is not None:
        grad = _mlp(tally, moe.shared_expert, x) or grad
    for gate in _present(moe, "shared_expert_gate"):
        grad = _linear(tally, gate, x, "linear") or grad
    return grad


def flops_per_token(model: nn.Module, seq_len: int, memory: Any | None = None, *,
                    loss_recomputes_projection: bool = False, tokens: int | None = None,
                    attention_len: float | None = None) -> FlopsPerToken:
    """FLOPs per token of one training step (forward, backward, recomputation) of ``model`` at ``seq_len``.

    Args:
        model: an mtune ``TransformerDecoder`` as the run trains it (on any device, meta included): LoRA/QLoRA
            applied and ``requires_grad`` set, so frozen weights and adapters are seen.
        seq_len: the padded length of the sequences (attention's row length), e.g. ``tokenizer.max_seq_len`` for
            packed data.
        memory: the run's ``MemoryConfig``: what its techniques make backward recompute (checkpointed blocks,
            tiled MLPs). None: nothing recomputed.
        loss_recomputes_projection: the loss runs the output projection's forward twice (a checkpointed chunked
            loss: ``ChunkedCrossEntropyLoss.recomputes_projection(model.lm_head)``).
        tokens: the micro-batch's tokens (``batch_size * seq_len``), which decide ``mlp_tiles=auto``'s tile count;
            default one row, ``seq_len``.
        attention_len: the keys each query is counted against (see the module docstring); default ``seq_len``.
    """
    if seq_len < 1:
        raise ValueError(f"flops_per_token: seq_len must be >= 1, got {seq_len}")
    attention_len = seq_len if attention_len is None else attention_len
    tally = _Tally()
    stream = bool(model.embed_tokens.weight.requires_grad)
    for projection in _present(model, "per_layer_model_projection"):  # Gemma 4's per-layer inputs, from the embedding
        _linear(tally, projection, stream, "linear")
    recompute = phases.recompute(memory or MemoryConfig(), len(model.layers), tokens or seq_len, model.args.dim)
    for block, checkpointed, tiled in zip(model.layers, recompute.checkpoint, recompute.mlp_tiled):
        stream = _block(tally, block, stream, attention_len, checkpointed, tiled)
    before = tally.forward
    _linear(tally, model.lm_head, stream or _trains(model.norm), "output")
    if loss_recomputes_projection:
        tally.recompute += tally.forward - before
    return FlopsPerToken(forward=tally.forward, backward=tally.backward, recompute=tally.recompute,
                         seq_len=int(seq_len), parts=tally.parts)


def utilization(flops_per_token: float, tokens_per_second: float, peak_flops: float) -> float:
    """Achieved FLOP/s over the device's peak: ``flops_per_token * tokens_per_second / peak_flops`` (0-1), with
    tokens/s of one device. 0 when the peak is unknown (``peak_flops <= 0``)."""
    if peak_flops <= 0:
        return 0.0
    return flops_per_token * tokens_per_second / peak_flops


def mean_document_length(document_ids) -> float:
    """``sum(L_i²) / sum(L_i)`` over the documents of a packed batch's ``document_ids`` ``[b, s]`` (each run of
    equal ids in a row one document): the keys a query is counted against under the segments kernel."""
    b, s = document_ids.shape
    lengths = document_boundaries(document_ids, b, s).diff().double()
    return float((lengths * lengths).sum()) / (b * s)


class StepFlops:
    """Model and hardware FLOPs of one rank's training step, from its micro-batches: each batch's tokens before
    padding times the FLOPs per token at its padded length (attention grows with it; packed rows under the segments
    kernel: with their documents' lengths, see the module docstring). Counts are memoised per shape; checkpointing
    and MLP tiles are read from ``memory`` (the run's `MemoryConfig`; None: nothing recomputed), the attention
    kernel from the model, so build it after ``setup_model``.

    ``step_flops(micro_batches) -> (model_flops, hardware_flops)``.
    """

    def __init__(self, model: nn.Module, *, loss_recomputes_projection: bool = False, memory: Any | None = None):
        self.model, self.loss_recomputes_projection, self.memory = model, loss_recomputes_projection, memory
        self._per_shape: dict[tuple, FlopsPerToken] = {}

    def per_token(self, seq_len: int, tokens: int | None = None, attention_len: float | None = None) -> FlopsPerToken:
        key = (seq_len, tokens or seq_len, attention_len)
        if key not in self._per_shape:
            self._per_shape[key] = flops_per_token(
                self.model, seq_len, self.memory, loss_recomputes_projection=self.loss_recomputes_projection,
                tokens=tokens, attention_len=attention_len)
        return self._per_shape[key]

    def attention_len(self, batch: dict) -> float | None:
        """The keys a query of ``batch`` counts against: under the segments kernel its packed documents'
        :func:`mean_document_length`; None (the row) otherwise, the dense mask computing the whole row."""
        segments = segments_apply(getattr(self.model, "attention_kernel", "dense_mask"), batch["tokens"].shape[-1])
        return mean_document_length(batch["document_ids"]) if segments and "document_ids" in batch else None

    def __call__(self, micro_batches: list[dict]) -> tuple[float, float]:
        model_flops = hardware_flops = 0.0
        for batch in micro_batches:
            tokens = batch["tokens"]
            n, s = int(batch.get("num_tokens", tokens.numel())), int(tokens.shape[-1])
            fpt = self.per_token(s, tokens.numel())
            model_hw, attention_len = (fpt.model, fpt.hardware), self.attention_len(batch)
            if attention_len is not None:  # FLOPs are affine in the attention length: between 0 and the row's s
                empty, share = self.per_token(s, tokens.numel(), 0.0), attention_len / s
                model_hw = tuple(e + share * (f - e) for e, f in zip((empty.model, empty.hardware), model_hw))
            model_flops += model_hw[0] * n
            hardware_flops += model_hw[1] * n
        return model_flops, hardware_flops
