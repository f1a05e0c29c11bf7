"""The experts' LoRA adapters in PEFT's form, as ``peft`` 0.21 loads them on transformers 5's fused experts.

transformers 5 holds a layer's experts as two 3-D parameters, ``mlp.experts.gate_up_proj [E, 2h, d]`` (gate rows
first) and ``mlp.experts.down_proj [E, d, h]``; peft adapts such parameters through ``target_parameters``
(``lora.ParamWrapper``), with one factor pair per parameter for all experts: ``lora_A.weight [E * R, in]`` (expert
``e``'s A in rows ``e * R`` to ``e * R + R``) and ``lora_B.weight [out, R * E]`` (column ``j * E + e`` is expert
``e``'s column ``j``), delta ``scaling * B_e A_e``. With both parameters adapted peft nests its wrappers: the
``gate_up_proj`` pair is saved under ``experts.base_layer.``, the ``down_proj`` pair under ``experts.``; one alone
is under ``experts.``.

mtune's experts keep gate and up apart, each with its rank-``r`` adapter, so their export is one rank-``2r`` adapter
on ``gate_up_proj``: A stacks ``A_gate`` over ``A_up``, B is block-diagonal (``B_gate`` in the gate rows and first
``r`` columns, ``B_up`` in the up rows and last ``r``), and ``alpha`` doubles with the rank so the scaling stays
``alpha / r`` (``rank_pattern`` / ``alpha_pattern``: ``{"gate_up_proj": 2r}``, ``{"gate_up_proj": 2 alpha}``).
The product is exactly the two adapters' deltas. One of gate / up alone keeps rank ``r`` with zero rows in B for the
other half.

gpt-oss's experts (:class:`~mtune.modules.clamped_experts.ClampedSwiGLUExperts`) are fused in mtune too: their
``gate_up_proj`` adapter is transformers' ``gate_up_proj`` parameter's as it is (the features in the same interleaved
order). transformers holds those parameters ``[E, in, out]`` and marks them ``is_transposed``, so peft keeps the same
factor layout (``lora_A [E * R, in]``, ``lora_B [out, R * E]``).
"""

from __future__ import annotations

import torch
from torch import nn

from mtune.modules.expert_layout import ExpertLayout
from mtune.modules.expert_linear import LoRAExpertLinear
from mtune.modules.moe import Experts

__all__ = ["EXPERT_PATTERN", "adapted_experts", "expert_peft_config", "expert_peft_tensors", "expert_mtune_tensors",
           "peft_modules", "per_expert_factors"]

EXPERT_PATTERN = {"gate_up_proj"}
"""The ``rank_pattern`` / ``alpha_pattern`` keys mtune writes (and reads back) for expert adapters."""


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # a DTensor shard: gathered


def adapted_experts(model: nn.Module) -> list[tuple[str, Experts]]:
    """Every ``Experts`` module of ``model`` with an adapter on any of its projections, by name."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Experts) and any(isinstance(p, LoRAExpertLinear) for p in m.projections())]


def _fused(experts: Experts) -> bool:
    """Whether the experts keep gate and up in one ``gate_up_proj`` (gpt-oss) rather than apart."""
    return not hasattr(experts, "gate_proj")


def _parts(experts: Experts):
    """``(gate_up: [(adapter, first row of its half)], down adapter or None)``; fused experts' ``gate_up_proj``
    adapter is the one half, from row 0."""
    adapters = [p if isinstance(p, LoRAExpertLinear) else None for p in experts.projections()]
    if _fused(experts):
        (gate_up, down) = adapters
        return ([(gate_up, 0)] if gate_up is not None else []), down
    gate, up, down = adapters
    halves = [(p, offset) for p, offset in ((gate, 0), (up, experts.gate_proj.out_features)) if p is not None]
    return halves, down


def _keys(name: str, experts: Experts) -> dict[str, str]:
    """PEFT's key prefix of each adapted parameter of the experts ``name``."""
    halves, down = _parts(experts)
    prefix = f"base_model.model.model.{name}"
    keys = {}
    if halves:
        keys["gate_up_proj"] = f"{prefix}.base_layer" if down is not None else prefix
    if down is not None:
        keys["down_proj"] = prefix
    return keys


def expert_peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's ``lora_A`` / ``lora_B`` tensors of every expert adapter (gathered when sharded: every rank calls)."""
    tensors = {}
    for name, experts in adapted_experts(model):
        halves, down = _parts(experts)
        keys = _keys(name, experts)
        factors = {}
        if halves and _fused(experts):
            factors["gate_up_proj"] = _full(halves[0][0].lora_a.weight), _full(halves[0][0].lora_b.weight)
        elif halves:
            r = halves[0][0].rank
            a = torch.cat([_full(p.lora_a.weight) for p, _ in halves], dim=1)  # [E, R, d]
            b = a.new_zeros(experts.n_experts, 2 * experts.gate_proj.out_features, a.shape[1])
            for i, (p, offset) in enumerate(halves):
                b[:, offset:offset + p.out_features, i * r:(i + 1) * r] = _full(p.lora_b.weight)
            factors["gate_up_proj"] = a, b
        if down is not None:
            factors["down_proj"] = _full(down.lora_a.weight), _full(down.lora_b.weight)
        for param, (a, b) in factors.items():
            tensors[f"{keys[param]}.lora_A.weight"] = a.reshape(-1, a.shape[-1])
            tensors[f"{keys[param]}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)
    return tensors


def expert_peft_config(model: nn.Module) -> dict:
    """The ``adapter_config.json`` fields the expert adapters add: ``target_parameters`` (``mlp.experts.gate_up_proj``
    / ``mlp.experts.down_proj``), and ``rank_pattern`` / ``alpha_pattern`` when ``gate_up_proj`` has rank ``2r``.
    Empty without expert adapters."""
    targets, fields = set(), {}
    for name, experts in adapted_experts(model):
        halves, _ = _parts(experts)
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name  # layers.0.mlp.experts -> mlp.experts
        targets.update(f"{suffix}.{param}" for param in _keys(name, experts))
        if len(halves) == 2 and not _fused(experts):
            r, alpha = halves[0][0].rank, halves[0][0].alpha
            fields.update(rank_pattern={"gate_up_proj": 2 * r}, alpha_pattern={"gate_up_proj": 2 * alpha})
    return {"target_parameters": sorted(targets), **fields} if targets else {}


def expert_mtune_tensors(tensors: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The expert adapters of a PEFT state dict (as :func:`expert_peft_tensors` writes it) in mtune's names and
    shapes, for ``model``'s adapted experts; the entries used are removed from ``tensors``. Raises ValueError naming
    the key when one is missing or the gate_up adapter is not block-diagonal (not two separate adapters)."""
    out = {}
    for name, experts in adapted_experts(model):
        halves, down = _parts(experts)
        keys = _keys(name, experts)
        n = experts.n_experts
        for param, prefix in keys.items():
            try:
                a, b = tensors.pop(f"{prefix}.lora_A.weight"), tensors.pop(f"{prefix}.lora_B.weight")
            except KeyError as e:
                raise ValueError(f"adapter lacks {e.args[0]} (the experts of {name} are adapted)") from None
            a = a.reshape(n, -1, a.shape[-1])  # [E, R, in]
            b = b.reshape(b.shape[0], -1, n).permute(2, 0, 1)  # [E, out, R]
            if param == "down_proj" or _fused(experts):
                out[f"{name}.{param}.lora_a.weight"], out[f"{name}.{param}.lora_b.weight"] = a, b
                continue
            rest = b.clone()
            r = halves[0][0].rank
            for i, (p, offset) in enumerate(halves):
                which = "gate_proj" if offset == 0 else "up_proj"
                rows, cols = slice(offset, offset + p.out_features), slice(i * r, (i + 1) * r)
                out[f"{name}.{which}.lora_a.weight"] = a[:, cols]
                out[f"{name}.{which}.lora_b.weight"] = b[:, rows, cols]
                rest[:, rows, cols] = 0
            if rest.any():
                raise ValueError(f"{prefix}.lora_B.weight: gate_up_proj's adapter is not separate gate and up "
                                 "adapters (non-zero off its diagonal blocks): mtune cannot load it")
    return out


def peft_modules(config: dict, model_modules=()) -> list[str]:
    """``lora.modules`` of an ``adapter_config.json``: ``target_modules`` and, for experts' ``target_parameters``, the
    projections mtune adapts: ``gate_up_proj`` of rank 2r is gate_proj and up_proj; of rank r, the one of them
    ``model_modules`` has; ``down_proj``. ValueError for what mtune does not write."""
    modules = set(config.get("target_modules") or [])
    halves = {"gate_proj", "up_proj"}
    for target in config.get("target_parameters") or []:
        param, rank = target.rpartition(".")[2], (config.get("rank_pattern") or {}).get("gate_up_proj", config["r"])
        if param == "down_proj" or (param == "gate_up_proj" and "gate_up_proj" in model_modules):
            modules.add(param)  # fused experts (gpt-oss): gate_up_proj's adapter is mtune's as it is
        elif param == "gate_up_proj" and rank == 2 * config["r"]:
            modules.update(halves)
        elif param == "gate_up_proj" and rank == config["r"] and len(halves & set(model_modules)) == 1:
            modules.update(halves & set(model_modules))
        else:
            raise ValueError(f"target_parameters {target!r} (rank {rank}): mtune reads the expert adapters it writes "
                             "(gate_up_proj of rank 2r; of rank r into a model adapting gate_proj or up_proj, not "
                             "both; down_proj)")
    return sorted(modules)


def per_expert_factors(parts: dict[str, dict[str, torch.Tensor]], config: dict,
                       layout: ExpertLayout = ExpertLayout.PER_EXPERT) -> dict[str, tuple]:
    """The expert adapters among ``parts`` (module name -> ``{"a": lora_A, "b": lora_B}``, as read from an adapter
    file: ``layers.0.mlp.experts`` / ``layers.0.mlp.experts.base_layer``) as ``(A [R, in], B [out, R], scaling)`` per
    expert and projection, named as the model's per-expert modules (``layers.0.mlp.experts.3.gate_proj``), for
    merging into a base checkpoint of ``layout``; those entries are removed from ``parts``. Exact whatever B's blocks
    hold: the gate's delta is the gate rows of B times A. A whole, transposed layout's family (gpt-oss) keeps gate
    and up in one projection, as peft's parameter: its ``gate_up_proj`` adapter stays whole
    (``layers.0.mlp.experts.3.gate_up_proj``)."""
    targets = {t.rpartition(".")[2] for t in config.get("target_parameters") or []}
    out = {}
    for name in [n for n in parts if targets and n.endswith((".experts", ".experts.base_layer"))]:
        param = "gate_up_proj" if name.endswith(".base_layer") or targets == {"gate_up_proj"} else "down_proj"
        base, p = name.removesuffix(".base_layer"), parts.pop(name)
        rank = (config.get("rank_pattern") or {}).get(param, config["r"])
        scaling = (config.get("alpha_pattern") or {}).get(param, config["lora_alpha"]) / rank
        n = p["a"].shape[0] // rank
        a = p["a"].reshape(n, rank, -1)
        b = p["b"].reshape(p["b"].shape[0], rank, n).permute(2, 0, 1)
        h = b.shape[1] // 2
        if param == "down_proj" or layout is ExpertLayout.WHOLE_TRANSPOSED:
            rows = {param: slice(None)}
        else:
            rows = {"gate_proj": slice(0, h), "up_proj": slice(h, None)}
        out.update((f"{base}.{e}.{proj}", (a[e], b[e, part], scaling)) for e in range(n) for proj, part in rows.items())
    return out
