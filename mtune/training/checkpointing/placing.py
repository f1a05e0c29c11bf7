"""A checkpoint's tensors put into a model as they are read, and the names the checkpoint must hold. The experts'
stacked projections (``[n_experts, out, in]``, :class:`~mtune.modules.expert_linear.ExpertLinear`) are held one key
per expert (Qwen3-MoE's and Qwen3.5-MoE's hub layout): each expert's tensor goes into its row. Two families hold
them otherwise: gpt-oss (:func:`fused_experts`) whole and transposed under the parameter's own name; Gemma 4
(:func:`gate_up_experts`) as transformers 5's modules hold them, ``experts.gate_up_proj [n_experts, 2 * hidden,
dim]``, split into ``gate_proj`` and ``up_proj`` on loading and joined again on saving (:func:`fuse_experts`), and
``experts.down_proj``, the ``down_proj`` weight as it is."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from mtune.models.gpt_oss.mxfp4 import dequantize_mxfp4
from mtune.modules.expert_linear import ExpertLinear, checkpoint_tensors, expert_key, fused_model_name
from mtune.modules.moe import Experts

__all__ = ["as_checkpoint_holds", "expected_tensors", "fuse_experts", "fused_experts", "fused_name", "gate_up_experts",
           "held_names", "held_shape", "place", "read_mxfp4"]

_GATE_UP_PART = re.compile(r"^(.*\.experts)\.(gate|up|down)_proj\.weight$")

_BLOCKS, _SCALES = "_blocks", "_scales"


def fused_experts(model_or_args) -> bool:
    """Whether the family's checkpoints hold each expert projection whole and transposed (gpt-oss:
    ``DecoderArgs.fused_expert_checkpoint``) rather than one key per expert (:func:`held_names`)."""
    args = getattr(model_or_args, "args", model_or_args)
    return bool(getattr(args, "fused_expert_checkpoint", False))


def fused_name(name: str) -> str | None:
    """A tensor of a checkpoint holding experts whole (gpt-oss) named as the model's: ``...experts.gate_up_proj`` ->
    ``...experts.gate_up_proj.weight``, ``..._bias`` -> ``.bias``, MXFP4's ``..._blocks`` -> ``.weight``; None for
    MXFP4's ``..._scales`` (read with their blocks, :func:`read_mxfp4`); any other name as it is."""
    if ".experts." in name and name.endswith(_SCALES):
        return None
    if ".experts." in name and name.endswith(_BLOCKS):
        name = name.removesuffix(_BLOCKS)
    return fused_model_name(name) or name


def read_mxfp4(f, key: str, open_file, dtype) -> torch.Tensor | None:
    """The expert weight ``[n_experts, out, in]`` an MXFP4 pair holds, dequantized to ``dtype`` (bf16 when None):
    ``key`` (``..._blocks``) from the open safetensors file ``f``, its ``..._scales`` from ``open_file(name)`` (a
    context manager opening the file that holds it); None when ``key`` is not MXFP4 blocks."""
    if not key.endswith(_BLOCKS) or ".experts." not in key:
        return None
    scales_key = key.removesuffix(_BLOCKS) + _SCALES
    with open_file(scales_key) as g:
        scales = g.get_tensor(scales_key)
    return dequantize_mxfp4(f.get_tensor(key), scales, dtype or torch.bfloat16)


def gate_up_experts(model: nn.Module) -> dict[str, list[str]]:
    """For the experts a checkpoint holds with gate and up side by side (Gemma 4's ``Experts.fused_checkpoint``):
    the checkpoint's name (``layers.0.experts.gate_up_proj``) -> the stacked weights it holds along dim 1
    (``[layers.0.experts.gate_proj.weight, layers.0.experts.up_proj.weight]``; ``down_proj`` alone)."""
    fused = {}
    for name, m in model.named_modules():
        if isinstance(m, Experts) and m.fused_checkpoint:
            fused[f"{name}.gate_up_proj"] = [f"{name}.gate_proj.weight", f"{name}.up_proj.weight"]
            fused[f"{name}.down_proj"] = [f"{name}.down_proj.weight"]
    return fused


def fuse_experts(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs with every experts' stacked weights as :func:`gate_up_experts` checkpoints hold them:
    ``...experts.gate_proj.weight`` and ``...experts.up_proj.weight`` (the first kept until the second comes) as one
    ``...experts.gate_up_proj``, ``...experts.down_proj.weight`` as ``...experts.down_proj``; others unchanged.
    ValueError naming the experts when one of gate and up never comes."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in items:
        match = _GATE_UP_PART.match(name)
        if match is None:
            yield name, tensor
        elif match[2] == "down":
            yield f"{match[1]}.down_proj", tensor
        else:
            halves = waiting.setdefault(match[1], {})
            halves[match[2]] = tensor
            if len(halves) == 2:
                del waiting[match[1]]
                yield f"{match[1]}.gate_up_proj", torch.cat([halves["gate"], halves["up"]], dim=1)
    if waiting:
        raise ValueError(f"{next(iter(waiting))}: only one of gate_proj and up_proj was given, so its fused "
                         "gate_up_proj cannot be written")


def as_checkpoint_holds(items: Iterable[tuple[str, torch.Tensor]], *, gate_up: bool,
                        whole: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf key, tensor)`` pairs as the family's checkpoints hold its experts: gate and up side by side
    (``gate_up``, Gemma 4: :func:`fuse_experts`), whole and transposed (``whole``, gpt-oss), or one key per expert
    (:func:`~mtune.modules.expert_linear.checkpoint_tensors`); every other tensor as it is."""
    for key, tensor in fuse_experts(items) if gate_up else items:
        yield from checkpoint_tensors(key, tensor, whole)


def expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name; a tied lm_head appears once, as embed_tokens."""
    expected = dict(model.named_parameters())
    expected.update((k, v) for k, v in model.state_dict(keep_vars=True).items() if k not in expected)
    if getattr(getattr(model, "args", None), "tie_embeddings", False):
        expected.pop("lm_head.weight", None)
    return expected


def held_names(model: nn.Module, expected: dict[str, torch.Tensor]) -> set[str]:
    """The names a checkpoint holds for ``expected`` (the model's tensors by name): each stacked projection as one
    name per expert (``experts.3.gate_proj.weight``), anything else as is."""
    experts = {f"{name}.{leaf}": m.n_experts for name, m in model.named_modules() if isinstance(m, ExpertLinear)
               for leaf in ("weight", "bias")}
    gate_up = {part: key for key, parts in gate_up_experts(model).items() for part in parts}
    held = set()
    for name in expected:
        if name in gate_up:
            held.add(gate_up[name])
        else:
            held.update([expert_key(name, e) for e in range(experts[name])] if name in experts else [name])
    return held


@torch.no_grad()
def _place_expert(model: nn.Module, name: str, expert: int, tensor: torch.Tensor, dtype, device,
                  arrived: dict[str, int]) -> bool:
    """Put one expert's tensor into row ``expert`` of the stacked parameter ``name`` (allocated at its first
    expert when on meta); returns whether every expert has now arrived."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, leaf)
    if current.is_meta or (dtype is not None and current.dtype != dtype):
        value = torch.empty(current.shape, dtype=dtype or tensor.dtype, device=device if current.is_meta
                            else current.device)
        setattr(module, leaf, nn.Parameter(value, requires_grad=current.requires_grad))
        current = getattr(module, leaf)
    current[expert].copy_(tensor)
    arrived[name] = arrived.get(name, 0) + 1
    return arrived[name] == current.shape[0]


def held_shape(name: str, slot: tuple[str, int] | None, expected: dict[str, torch.Tensor],
               gate_up: dict[str, list[str]]) -> tuple[int, ...]:
    """The shape the checkpoint's tensor ``name`` must have: its parameter's, one expert's row of it (``slot``), or
    a :func:`gate_up_experts` tensor's (``[n_experts, the parts' rows together, in]``)."""
    if name in gate_up:
        first = expected[gate_up[name][0]].shape
        return first[0], sum(expected[part].shape[1] for part in gate_up[name]), first[2]
    return tuple(expected[name].shape) if slot is None else tuple(expected[slot[0]].shape[1:])


def place(model: nn.Module, name: str, slot: tuple[str, int] | None, tensor: torch.Tensor, dtype, device,
          arrived: dict[str, int], gate_up: dict[str, list[str]]) -> list[str]:
    """Put a tensor read as ``name`` into the model (``slot``: the stacked parameter and expert it is a row of; a
    name in ``gate_up``: the stacked weights it holds side by side along dim 1); returns the parameters it made
    whole (a stacked one once its last expert has arrived)."""
    if name in gate_up:
        sizes = [model.get_parameter(part).shape[1] for part in gate_up[name]]
        for part, piece in zip(gate_up[name], tensor.split(sizes, dim=1)):
            _place(model, part, piece.contiguous(), dtype, device)
        return gate_up[name]
    if slot is None:
        _place(model, name, tensor, dtype, device)
        return [name]
    return [slot[0]] if _place_expert(model, *slot, tensor, dtype, device, arrived) else []


@torch.no_grad()
def _place(model: nn.Module, name: str, tensor: torch.Tensor, dtype, device) -> None:
    """Put ``tensor`` into the parameter ``name``: assigned if the model is on meta, copied otherwise."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = getattr(module, leaf)
    if current.is_meta or (dtype is not None and current.dtype != dtype):
        # copy=True: safetensors hands out tensors backed by the file's memory map; the model must own its memory.
        target = device if current.is_meta else current.device
        value = tensor.to(device=target, dtype=dtype or tensor.dtype, copy=True)
        if isinstance(current, nn.Parameter):
            value = nn.Parameter(value, requires_grad=current.requires_grad)
        setattr(module, leaf, value)
    else:
        current.copy_(tensor)
