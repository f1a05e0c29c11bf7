"""How a family's checkpoints lay out its routed experts, and the translation between that layout and mtune's
stacked 3-D parameters (:class:`~mtune.modules.expert_linear.ExpertLinear`: ``experts.<projection>.weight
[n_experts, out, in]``, ``bias [n_experts, out]``).

Each family declares its layout once, ``DecoderArgs.expert_checkpoint_layout`` (read by :func:`expert_layout`);
loading (single-device and FSDP2), saving, merging and exporting read nothing else. The layouts:

* :attr:`ExpertLayout.PER_EXPERT` (Qwen3-MoE, Qwen3.5-MoE; the default): one key per expert and projection,
  ``experts.{e}.gate_proj.weight``, row ``e`` of the stacked parameter (:func:`expert_key`, :func:`stacked_key`).
* :attr:`ExpertLayout.WHOLE_TRANSPOSED` (gpt-oss): each projection whole under its parameter's name, the weight
  transposed, ``experts.gate_up_proj [n_experts, in, out]``, the bias as ``experts.gate_up_proj_bias``
  (:func:`whole_key`, :func:`whole_model_name`); the published checkpoints store those weights as MXFP4
  ``*_blocks`` / ``*_scales`` pairs, named as their weight (:func:`whole_name`).
* :attr:`ExpertLayout.GATE_UP_SIDE_BY_SIDE` (Gemma 4 26B-A4B; transformers 5's modules): ``experts.gate_up_proj
  [n_experts, 2 * hidden, dim]``, the gate rows then the up rows (mtune's ``gate_proj`` and ``up_proj`` stacked
  along dim 1), and ``experts.down_proj [n_experts, dim, hidden]`` (:func:`side_by_side_parts`,
  :func:`join_side_by_side`).

A family whose model has no experts may declare any layout: only expert tensors are translated.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from enum import Enum

import torch
from torch import nn

from mtune.modules.moe import Experts

__all__ = ["MXFP4_BLOCKS", "MXFP4_SCALES", "ExpertLayout", "as_checkpoint_holds", "checkpoint_shape", "expert_key",
           "expert_layout",
           "from_checkpoint", "join_side_by_side", "mxfp4_part", "per_expert", "side_by_side_key", "side_by_side_parts",
           "stacked_key",
           "transposed_in_checkpoint", "whole_key", "whole_model_name", "whole_name"]


class ExpertLayout(str, Enum):
    """The layouts of routed experts in a checkpoint (the module docstring describes each)."""

    PER_EXPERT = "per_expert"
    WHOLE_TRANSPOSED = "whole_transposed"
    GATE_UP_SIDE_BY_SIDE = "gate_up_side_by_side"


def expert_layout(model_or_args) -> ExpertLayout:
    """The layout a model's (its ``args``') or a ``DecoderArgs``' checkpoints hold the experts in:
    ``expert_checkpoint_layout``, which ``DecoderArgs`` declares (per expert unless the family says otherwise); an
    object with neither (a bare module in a test) is per expert, the layout that leaves non-expert tensors as they
    are."""
    args = getattr(model_or_args, "args", model_or_args)
    return ExpertLayout(getattr(args, "expert_checkpoint_layout", ExpertLayout.PER_EXPERT))


# ----------------------------------------------------------------------------------------- one key per expert
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(.+)$")
_STACKED = re.compile(r"^(.*\.experts)\.([A-Za-z_]\w*\..+)$")
_WHOLE = re.compile(r"^(.*\.experts)\.([A-Za-z_]\w*)$")
_SIDE_BY_SIDE_PART = re.compile(r"^(.*\.experts)\.(gate|up|down)_proj\.weight$")
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


def expert_key(name: str, expert: int) -> str:
    """``layers.0.mlp.experts.gate_proj.weight`` and 3 -> ``layers.0.mlp.experts.3.gate_proj.weight`` (adapter
    names too: ``...experts.gate_proj.lora_A.weight`` -> ``...experts.3.gate_proj.lora_A.weight``)."""
    match = _STACKED.match(name)
    return f"{match[1]}.{expert}.{match[2]}"


def stacked_key(name: str) -> tuple[str, int] | None:
    """A per-expert name -> ``(the stacked parameter's name, expert)``; None for any other name."""
    match = _PER_EXPERT.match(name)
    return None if match is None else (f"{match[1]}.{match[3]}", int(match[2]))


def per_expert(name: str, tensor: torch.Tensor):
    """``(name, tensor)`` as a per-expert checkpoint holds it: a stacked projection ``[n_experts, ...]`` (named
    ``...experts.<projection>.weight``) as one ``(per-expert name, tensor[e])`` per expert, anything else as is."""
    if _STACKED.match(name) is None:
        yield name, tensor
        return
    for e, piece in enumerate(tensor.unbind(0)):
        yield expert_key(name, e), piece


# --------------------------------------------------------------------------------- whole and transposed (gpt-oss)
def whole_key(name: str) -> str | None:
    """A stacked projection's tensor as the whole, transposed layout keys it: ``layers.0.mlp.experts.gate_up_proj
    .weight`` -> ``layers.0.mlp.experts.gate_up_proj``, ``...gate_up_proj.bias`` -> ``...gate_up_proj_bias``; None
    for any other name."""
    match = _STACKED.match(name)
    if match is None:
        return None
    projection, _, leaf = match[2].partition(".")
    return {"weight": f"{match[1]}.{projection}", "bias": f"{match[1]}.{projection}_bias"}.get(leaf)


def whole_model_name(key: str) -> str | None:
    """The inverse of :func:`whole_key` (``...experts.down_proj_bias`` -> ``...experts.down_proj.bias``); None for
    a name that is not a whole expert projection."""
    match = _WHOLE.match(key)
    if match is None:
        return None
    projection = match[2]
    if projection.endswith("_bias"):
        return f"{match[1]}.{projection.removesuffix('_bias')}.bias"
    return f"{match[1]}.{projection}.weight"


def whole_name(name: str) -> str | None:
    """A tensor of a whole, transposed checkpoint named as the model's: ``...experts.gate_up_proj`` ->
    ``...experts.gate_up_proj.weight``, ``..._bias`` -> ``.bias``, MXFP4's ``..._blocks`` -> ``.weight``; None for
    MXFP4's ``..._scales`` (read with their blocks); any other name as it is."""
    part = mxfp4_part(name)
    if part == "scales":
        return None
    if part == "blocks":
        name = name.removesuffix(MXFP4_BLOCKS)
    return whole_model_name(name) or name


def mxfp4_part(key: str) -> str | None:
    """``"blocks"`` or ``"scales"`` for the halves of an expert weight's MXFP4 pair (``...experts
    .gate_up_proj_blocks``, ``..._scales``: the published gpt-oss checkpoints), None for any other key."""
    if ".experts." not in key:
        return None
    return "blocks" if key.endswith(MXFP4_BLOCKS) else "scales" if key.endswith(MXFP4_SCALES) else None


def transposed_in_checkpoint(name: str, layout: ExpertLayout) -> bool:
    """Whether the model's tensor ``name`` is held transposed (``[n_experts, in, out]``): a stacked weight in the
    whole, transposed layout (not its MXFP4 form, whose blocks are laid out as the model's rows)."""
    return layout is ExpertLayout.WHOLE_TRANSPOSED and name.endswith(".weight") and whole_key(name) is not None


def checkpoint_shape(name: str, shape: tuple[int, ...], layout: ExpertLayout) -> tuple[int, ...]:
    """The shape ``layout`` holds the model's tensor ``name`` of ``shape`` in: ``[n_experts, in, out]`` where
    :func:`transposed_in_checkpoint`, else ``shape`` itself."""
    return (shape[0], shape[2], shape[1]) if transposed_in_checkpoint(name, layout) else tuple(shape)


def from_checkpoint(name: str, tensor: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """A tensor read for the model's ``name`` (all experts, or a rank's first-dim rows of them) in the model's
    orientation: transposed back (contiguous) where :func:`transposed_in_checkpoint`, else as it is."""
    return tensor.transpose(1, 2).contiguous() if transposed_in_checkpoint(name, layout) else tensor


# ------------------------------------------------------------------------------ gate and up side by side (Gemma 4)
def side_by_side_parts(model: nn.Module) -> dict[str, list[str]]:
    """For a model whose checkpoints hold gate and up side by side: each checkpoint name (``layers.0.experts
    .gate_up_proj``) -> the stacked weights it holds along dim 1 (``[layers.0.experts.gate_proj.weight,
    layers.0.experts.up_proj.weight]``; ``experts.down_proj``: the ``down_proj`` weight alone); empty for other
    layouts."""
    if expert_layout(model) is not ExpertLayout.GATE_UP_SIDE_BY_SIDE:
        return {}
    parts = {}
    for name, m in model.named_modules():
        if isinstance(m, Experts) and hasattr(m, "gate_proj"):  # gpt-oss's fused experts have no gate_proj
            parts[f"{name}.gate_up_proj"] = [f"{name}.gate_proj.weight", f"{name}.up_proj.weight"]
            parts[f"{name}.down_proj"] = [f"{name}.down_proj.weight"]
    return parts


def side_by_side_key(name: str) -> tuple[str, str] | None:
    """A stacked weight as the side-by-side layout holds it: ``...experts.gate_proj.weight`` ->
    ``("...experts.gate_up_proj", "gate")`` (``up`` likewise), ``...experts.down_proj.weight`` ->
    ``("...experts.down_proj", "down")``; None for any other name."""
    match = _SIDE_BY_SIDE_PART.match(name)
    if match is None:
        return None
    return f"{match[1]}.{'down_proj' if match[2] == 'down' else 'gate_up_proj'}", match[2]


def join_side_by_side(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs with every experts' stacked weights as the side-by-side layout holds them:
    ``...experts.gate_proj.weight`` and ``...experts.up_proj.weight`` (the first kept until the second comes) as one
    ``...experts.gate_up_proj``, ``...experts.down_proj.weight`` as ``...experts.down_proj``; others unchanged.
    ValueError naming the experts when one of gate and up never comes."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # by the gate_up_proj key
    for name, tensor in items:
        held = side_by_side_key(name)
        if held is None:
            yield name, tensor
        elif held[1] == "down":
            yield held[0], tensor
        else:
            halves = waiting.setdefault(held[0], {})
            halves[held[1]] = tensor
            if len(halves) == 2:
                del waiting[held[0]]
                yield held[0], torch.cat([halves["gate"], halves["up"]], dim=1)
    if waiting:
        experts = next(iter(waiting)).removesuffix(".gate_up_proj")
        raise ValueError(f"{experts}: only one of gate_proj and up_proj was given, so its fused gate_up_proj "
                         "cannot be written")


# ------------------------------------------------------------------------------------------------------- saving
def as_checkpoint_holds(items: Iterable[tuple[str, torch.Tensor]],
                        layout: ExpertLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` pairs (the model's names, ``model.``-prefixed or not) as ``layout`` holds the experts:
    one key per expert, whole and transposed, or gate and up side by side; every other tensor as it is."""
    if layout is ExpertLayout.GATE_UP_SIDE_BY_SIDE:
        yield from join_side_by_side(items)
        return
    for name, tensor in items:
        if layout is ExpertLayout.PER_EXPERT:
            yield from per_expert(name, tensor)
            continue
        key = whole_key(name)
        if key is None:
            yield name, tensor
        else:
            yield key, tensor.transpose(1, 2) if transposed_in_checkpoint(name, layout) else tensor
