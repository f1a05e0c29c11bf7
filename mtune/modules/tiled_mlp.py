"""Tiled MLP: the SwiGLU MLP runs over tiles of the sequence, its intermediates one tile at a time.

An MLP of width ``d`` and hidden width ``h`` keeps about four ``[tokens, h]`` tensors for backward (the gate and up
projections, the SiLU, their product), ``h`` being ~3.5x ``d``: at long context they outgrow every other activation
of a block. :func:`apply_tiled_mlp` replaces each ``FeedForward``'s forward (on the instance, so parameter names and
checkpoint keys do not change) by an autograd function that

- in forward, runs ``down(silu(gate(t)) * up(t))`` tile by tile (``tiles`` row ranges of the flattened
  ``[b * s, d]`` input) into one output, without autograd, and saves only the input ``x`` for backward;
- in backward, recomputes each tile with autograd and backpropagates it at once, adding up the gradients of the
  trainable weights (LoRA's A and B, DoRA's magnitude, or the full weights) and writing the tile's input gradient.

``tiles="auto"`` picks the count per call: a tile of at most ``dim`` tokens (:func:`tile_count`), and no tiling at
all (the plain forward, nothing recomputed) when the micro-batch has at most ``dim`` tokens.

Memory: the MLP's intermediates exist for one tile at a time (``[tokens / tiles, h]``) in forward and backward,
instead of for the whole sequence between forward and backward. Cost: one extra MLP forward per token (the
recompute), i.e. +2 x 3 x d x h FLOPs per token per block, as activation checkpointing of the MLP alone would cost.
With block activation checkpointing the block's recompute calls the tiled forward again: one more MLP forward.

Frozen weights are read once per pass (forward, backward), not once per tile: each projection's forward pre-hooks
(weight offloading brings its group in with them) run once, then its base weight is dequantized once (NF4, fp8) and
every tile uses that copy, so QLoRA dequantizes each weight twice per step (forward, backward) as without tiling,
and weight offloading copies each group in once per pass. The price is the three dequantized weights living
together for the MLP's pass. A frozen plain weight of a module that has forward pre-hooks is copied too
(``leaf_level`` offloading may send it away while the next projection comes in); otherwise it is used in place.

Composes with LoRA/DoRA (incl. dropout: the RNG state is replayed), QLoRA, fp8 storage, activation checkpointing
(``block``; under ``selective_op`` the policy keeps the tiles' matmul outputs, so tiling saves nothing there) and
activation offloading (the saved input is what it moves). Under ``torch.compile`` the tiled MLP runs eagerly (a graph
break per block). Forward hooks other than pre-hooks do not run on the projections.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from mtune.modules.feed_forward import FeedForward, FusedFeedForward
from mtune.modules.fp8_linear import dequantize_fp8, is_fp8_stored
from mtune.modules.lora import LoRALinear
from mtune.modules.nf4_linear import dequantize

__all__ = ["apply_tiled_mlp", "mlp_tiles", "tile_count"]

_ATTRIBUTE = "_mtune_mlp_tiles"


def tile_count(setting: "int | str", tokens: int, dim: int) -> int:
    """The tiles an MLP of width ``dim`` runs ``tokens`` tokens (a micro-batch's ``b * s``) over, for the setting
    ``mlp_tiles``: an int as it is (at most one tile per token), or ``"auto"``: ``ceil(tokens / dim)``, so a tile
    has at most ``dim`` tokens and its ``[tile, hidden]`` intermediates are about the size of one MLP weight
    (ALST's choice); 1 (untiled) whenever the micro-batch has at most ``dim`` tokens."""
    if setting == "auto":
        return max(1, -(-tokens // dim))
    return max(1, min(int(setting), tokens))


def apply_tiled_mlp(model: nn.Module, tiles: "int | str") -> nn.Module:
    """Run every ``FeedForward`` of ``model`` over ``tiles`` sequence tiles (see the module docstring), or with
    ``tiles="auto"`` over :func:`tile_count`'s tiles for each call's tokens (untiled when that is 1). In place;
    returns the model. ``tiles=1`` restores the plain forward. Apply after LoRA / NF4 / fp8 storage and weight
    offloading, before activation checkpointing and compile (any order works; that one reads best)."""
    if tiles != "auto" and (not isinstance(tiles, int) or tiles < 1):
        raise ValueError(f"mlp tiles must be an int >= 1 or 'auto', got {tiles!r}")
    for module in model.modules():
        if not isinstance(module, (FeedForward, FusedFeedForward)):
            continue
        if tiles == 1:
            module.__dict__.pop("forward", None)
            module.__dict__.pop(_ATTRIBUTE, None)
        else:
            module.forward = functools.partial(_tiled_forward, module, tiles)
            setattr(module, _ATTRIBUTE, tiles)
    return model


def mlp_tiles(module: nn.Module, tokens: int | None = None) -> "int | str":
    """The tile setting of a ``FeedForward`` (1 when untiled; ``"auto"`` as set), or with ``tokens`` the tiles a
    call over that many tokens runs."""
    setting = getattr(module, _ATTRIBUTE, 1)
    if tokens is None:
        return setting
    return tile_count(setting, tokens, module.down_proj.out_features)


# ------------------------------------------------------------------------------------------------ projections
def _run_forward_pre_hooks(module: nn.Module, x: torch.Tensor) -> None:
    for hook_id, hook in module._forward_pre_hooks.items():
        if hook_id in module._forward_pre_hooks_with_kwargs:
            hook(module, (x,), {})
        else:
            hook(module, (x,))


def _frozen_dense(module: nn.Module, tensor: torch.Tensor | None, dtype: torch.dtype, hooked: bool):
    if tensor is None or tensor.requires_grad:
        return tensor
    if tensor is module.weight and is_fp8_stored(module):
        return dequantize_fp8(tensor, module.weight_scale, dtype)
    dense = dequantize(tensor)
    return dense.clone() if hooked and dense is tensor else dense


def _projection(module: nn.Module, x: torch.Tensor):
    """``t -> module(t)`` with the module's frozen weights read (and dequantized) now, once, and its pre-hooks run
    once (so offloaded weights are in)."""
    hooked = bool(module._forward_pre_hooks)
    _run_forward_pre_hooks(module, x)
    if isinstance(module, LoRALinear):
        frozen = tuple(_frozen_dense(module, t, x.dtype, hooked) for t in (module.weight, module.bias))
        return functools.partial(module.forward, frozen=frozen)
    if isinstance(module, nn.Linear):  # plain, FrozenNF4Linear, FrozenFp8Linear
        weight, bias = (_frozen_dense(module, t, x.dtype, hooked) for t in (module.weight, module.bias))
        return functools.partial(F.linear, weight=weight, bias=bias)
    return module.forward  # unknown projection: called per tile as it is


def _projections(mlp: FeedForward | FusedFeedForward, x: torch.Tensor):
    if isinstance(mlp, FusedFeedForward):
        return tuple(_projection(m, x) for m in (mlp.gate_up_proj, mlp.down_proj))
    return tuple(_projection(m, x) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


def _swiglu(projections, x: torch.Tensor, activation) -> torch.Tensor:
    if len(projections) == 2:  # a fused gate_up_proj
        gate_up, down = projections
        gate, up = gate_up(x).chunk(2, dim=-1)
        return down(activation(gate) * up)
    gate, up, down = projections
    return down(activation(gate(x)) * up(x))


# ------------------------------------------------------------------------------------------- the function
def _has_active_dropout(mlp: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.training and m.p > 0 for m in mlp.modules())


class _TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mlp: FeedForward, tiles: int, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        bounds = _planned(_tile_bounds(flat.shape[0], tiles), x)
        ctx.mlp, ctx.bounds, ctx.shape = mlp, bounds, x.shape
        ctx.device_type = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
        ctx.rng = _rng_state(x) if _has_active_dropout(mlp) else None
        ctx.save_for_backward(x)
        projections = _projections(mlp, x)
        out = None
        for start, end in bounds:
            y = _swiglu(projections, flat[start:end], mlp.activation)
            if out is None:
                out = y.new_empty(flat.shape[0], y.shape[-1])
            out[start:end] = y
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.mlp.parameters() if p.requires_grad]
        need_x = ctx.needs_input_grad[2]
        flat, grad_flat = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(flat) if need_x else None
        grads: list[torch.Tensor | None] = [None] * len(params)
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=_rng_devices(x), enabled=ctx.rng is not None), \
                torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):
            if ctx.rng is not None:
                _set_rng_state(x, ctx.rng)
            projections = _projections(ctx.mlp, x)
            for start, end in ctx.bounds:
                tile = flat[start:end].detach().requires_grad_(need_x)
                with torch.enable_grad():
                    y = _swiglu(projections, tile, ctx.mlp.activation)
                inputs = ([tile] if need_x else []) + params
                tile_grads = torch.autograd.grad(y, inputs, grad_flat[start:end], allow_unused=True)
                if need_x:
                    grad_x[start:end] = tile_grads[0]
                    tile_grads = tile_grads[1:]
                for i, g in enumerate(tile_grads):
                    if g is not None:
                        grads[i] = g if grads[i] is None else grads[i].add_(g)
        grad_x = grad_x.view(ctx.shape) if need_x else None
        return (None, None, grad_x, *grads)


def _tile_bounds(tokens: int, tiles: int) -> list[tuple[int, int]]:
    tiles = max(1, min(tiles, tokens))
    edges = [tokens * i // tiles for i in range(tiles + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _planned(bounds: list[tuple[int, int]], x: torch.Tensor) -> list[tuple[int, int]]:
    """The tiles to run: all of them, but on fake tensors (``mtune plan``, which counts bytes, not values) only
    enough of them to meet every pattern of allocations the whole loop meets, so the peaks are the same. A tile's
    allocations depend on its size, on the previous tile's (whose output, and in backward its graph and weight
    gradients, live until the next tile replaces them) and, for the first two, on their place (the output and the
    weight gradients are made by the first). So the first two run, then for each pair of consecutive sizes not met
    yet the pair itself, after the last tile kept where that one has the size of the tile before the pair (it stands
    in for it), else joined to it where the join is a pair the loop meets too (else all tiles run). A 128K-token row
    of Llama 3.1 8B has 32 tiles a block, planned as 3 to 5."""
    if not isinstance(x, FakeTensor) or len(bounds) <= 4:
        return bounds
    sizes = [end - start for start, end in bounds]
    later = set(zip(sizes[1:], sizes[2:]))  # (previous, this) for every tile from the third on
    kept, met = [0, 1], set()
    for i in range(2, len(sizes)):
        pair = (sizes[i - 1], sizes[i])
        if pair in met:
            continue
        if kept[-1] != i - 1 and sizes[kept[-1]] != sizes[i - 1]:  # else the kept tile stands in for tile i - 1
            join = (sizes[kept[-1]], sizes[i - 1])
            if join not in later:
                return bounds
            met.add(join)
            kept.append(i - 1)
        met.add(pair)
        kept.append(i)
    return [bounds[i] for i in kept]


def _rng_devices(x: torch.Tensor) -> list:
    return [x.device] if x.device.type == "cuda" else []


def _rng_state(x: torch.Tensor):
    return torch.get_rng_state(), (torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" else None)


def _set_rng_state(x: torch.Tensor, state) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], x.device)


# backward runs autograd itself: kept out of compiled graphs (the lazy form, see packed_attention.segment_attention)
@torch._disable_dynamo
def _tiled_forward(mlp: FeedForward, tiles: "int | str", x: torch.Tensor) -> torch.Tensor:
    tiles = tile_count(tiles, x.numel() // x.shape[-1], x.shape[-1])
    if tiles == 1:  # "auto" on a short micro-batch: the plain forward, nothing recomputed
        return type(mlp).forward(mlp, x)
    params = [p for p in mlp.parameters() if p.requires_grad]
    return _TiledMLP.apply(mlp, tiles, x, *params)
