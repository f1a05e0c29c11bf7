"""``mtune plan --fit``: search the memory flags for the configs that fit a device, order them by one cost model,
and write the best as a ready-to-run YAML.

The search space is :data:`KNOBS`, one entry per technique: each names the overrides it can try, how much memory
each choice saves (a level: higher saves more) and whether it applies to a config. Every candidate (one choice per
knob) that the recipe's rules accept is ordered by :func:`step_cost`; candidates are then planned for real
(:func:`~mtune.training.plan.plan_memory`, fake tensors) in that order. Pruning: when a candidate does not
fit, every candidate that saves no more on any knob (each level <= its) cannot fit either and is never planned.
The search stops after ``max_fits`` fitting candidates (the cheapest ones) or ``max_plans`` plans.

The cost model (:func:`step_cost`), in seconds per trained token on a reference GPU: the FLOPs per token that
the performance counter (:mod:`mtune.training.observe.flops`, the numerator of HFU) counts for the candidate's model
(forward, backward, the recomputation of checkpointed blocks), divided by :data:`REFERENCE_FLOPS`; plus the bytes moved between device and host
(:func:`transfer_bytes_per_token`: offloaded activations, optimizer offload's gradients and parameters, weight
offloading's frozen weights; paged optimizer states none while they fit) divided by
:data:`REFERENCE_HOST_BANDWIDTH`. Smaller micro-batches and
8-bit optimizers cost no FLOPs in this model; among equal costs the larger micro-batch and the fewer techniques
win.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from mtune.config import load_config
from mtune.config.errors import ConfigError
from mtune.config.keys import MemoryConfig
from mtune.models import build_model_from_args
from mtune.modules.lora import freeze_base
from mtune.modules.loss import ChunkedCrossEntropyLoss
from mtune.training.memory.apply import apply_memory_techniques
from mtune.training.model_setup import resolve_model_source
from mtune.training.observe.flops import flops_per_token
from mtune.training.plan import MemoryPlan, format_bytes, plan_memory

__all__ = ["Knob", "KNOBS", "Candidate", "search", "step_cost", "model_flops_per_token", "transfer_bytes_per_token",
           "fit_command",
           "REFERENCE_FLOPS", "REFERENCE_HOST_BANDWIDTH"]

log = logging.getLogger(__name__)

REFERENCE_FLOPS = 400e12
"""Sustained bf16 matmul FLOP/s of the reference GPU (an H100 SXM reaches ~400 of its 989 dense TFLOP/s in
training); only ratios between candidates matter."""
REFERENCE_HOST_BANDWIDTH = 25e9
"""Bytes/s between device and host (PCIe 4/5 x16 as measured by bandwidth tests, one direction)."""


@dataclass(frozen=True)
class Knob:
    """One technique in the search: ``choices(cfg)`` lists ``(level, overrides)``; a higher level saves more."""

    name: str
    choices: Callable[[Any], list[tuple[int, dict]]]


def _lora_method(cfg) -> list[tuple[int, dict]]:
    """The frozen base's storage: the model dtype, fp8 (0.5x bf16, ~1% off in logits), NF4 (0.27x, ~20%)."""
    if cfg.get("lora") is None:
        return [(0, {})]
    return [(0, {"lora.quantize_base": False, "weight_storage_dtype": None}),
            (1, {"lora.quantize_base": False, "weight_storage_dtype": "float8_e4m3fn"}),
            (2, {"lora.quantize_base": True, "weight_storage_dtype": None})]


def _checkpointing(cfg) -> list[tuple[int, dict]]:
    """None, then (full fine-tunes) selective_op on every block, block checkpointing of every 2nd block, of every
    block, and with offloading. selective_op keeps ~56% of a block's activations (the matmul outputs), more than
    block checkpointing of every 2nd block keeps; with LoRA on a frozen base it can keep more than no checkpointing
    at all (backward needs none of the frozen matmuls' outputs), so it is searched only for full fine-tunes."""
    n_layers = _args(cfg).n_layers
    block = {"activation_checkpointing_policy": "block", "enable_activation_offloading": False}
    choices = [(0, {"enable_activation_checkpointing": False, **block})]
    if cfg.get("lora") is None:
        choices.append((1, {"enable_activation_checkpointing": True, "activation_checkpointing_every_n_layers": 1,
                            "activation_checkpointing_policy": "selective_op", "enable_activation_offloading": False}))
    if n_layers >= 2:
        choices.append((2, {"enable_activation_checkpointing": True, "activation_checkpointing_every_n_layers": 2,
                            **block}))
    choices.append((3, {"enable_activation_checkpointing": True, "activation_checkpointing_every_n_layers": 1,
                        **block}))
    choices.append((4, {"enable_activation_checkpointing": True, "activation_checkpointing_every_n_layers": 1,
                        **block, "enable_activation_offloading": True}))
    return choices


def _optimizer(cfg) -> list[tuple[int, dict]]:
    choices = [(0, {"optimizer._component_": "torch.optim.AdamW"})]
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return choices
    return choices + [(1, {"optimizer._component_": "bitsandbytes.optim.AdamW8bit"})]


def _optimizer_in_bwd(cfg) -> list[tuple[int, dict]]:
    return [(0, {"optimizer_in_bwd": False}), (1, {"optimizer_in_bwd": True, "clip_grad_norm": None,
                                                   "gradient_accumulation_steps": 1})]


def _loss(cfg) -> list[tuple[int, dict]]:
    return [(0, {"loss._component_": "mtune.modules.loss.CrossEntropyLoss"}),
            (1, {"loss._component_": "mtune.modules.loss.ChunkedCrossEntropyLoss"})]


def _optimizer_offload(cfg) -> list[tuple[int, dict]]:
    """Optimizer states (and the step) in host memory; mostly worth it for full fine-tunes (LoRA's states are
    tiny). The rules drop it where it does not apply (distributed recipes, non-AdamW optimizers, fp16)."""
    return [(0, {"optimizer_offload": None}), (1, {"optimizer_offload": "cpu"})]


_WEIGHT_OFFLOADING = {"block_level": {"type": "block_level", "blocks_per_group": 1, "use_streams": True},
                      "leaf_level": {"type": "leaf_level", "blocks_per_group": 1, "use_streams": True}}


def _weight_offloading(cfg) -> list[tuple[int, dict]]:
    """Frozen weights in host memory, one block (block_level) or one module (leaf_level) on the device at a time;
    only with frozen weights (a lora node)."""
    if cfg.get("lora") is None:
        return [(0, {"weight_offloading": None})]
    return [(0, {"weight_offloading": None}), (1, {"weight_offloading": _WEIGHT_OFFLOADING["block_level"]}),
            (2, {"weight_offloading": _WEIGHT_OFFLOADING["leaf_level"]})]


def _micro_batch(cfg) -> list[tuple[int, dict]]:
    """``batch_size`` halved down to 1, with ``gradient_accumulation_steps`` raised to keep the samples per step."""
    batch, accumulation = int(cfg.batch_size), int(cfg.get("gradient_accumulation_steps") or 1)
    choices, level = [], 0
    while batch >= 1:
        choices.append((level, {"batch_size": batch, "gradient_accumulation_steps": accumulation}))
        if batch % 2:
            break
        batch, accumulation, level = batch // 2, accumulation * 2, level + 1
    return choices


KNOBS: list[Knob] = [
    Knob("lora_method", _lora_method),
    Knob("activation_checkpointing", _checkpointing),
    Knob("optimizer", _optimizer),
    Knob("optimizer_in_bwd", _optimizer_in_bwd),
    Knob("loss", _loss),
    Knob("optimizer_offload", _optimizer_offload),
    Knob("weight_offloading", _weight_offloading),
    Knob("micro_batch", _micro_batch),  # last: the search reads the micro-batch level as levels[-1]
]
"""The techniques searched, in this order. fp8 weight storage is a level of ``lora_method`` and selective_op one of
``activation_checkpointing``; a new technique is one more entry here (before ``micro_batch``)."""


def _args(cfg):
    return resolve_model_source(cfg.model).args


# ------------------------------------------------------------------------------------------------ cost model
_FLOPS_CACHE: dict = {}


def model_flops_per_token(cfg) -> float:
    """Training FLOPs per token of ``cfg``'s model, recomputation included: the performance counter
    (:func:`mtune.training.observe.flops.flops_per_token`, the numerator of HFU) on the model built on the meta
    device with the config's adapters and checkpointing, at ``tokenizer.max_seq_len``. Cached per distinct
    model/adapter/checkpointing/loss combination (the other knobs cost no FLOPs)."""
    lora = cfg.get("lora")
    selective = cfg.get("activation_checkpointing_policy") == "selective_op"
    memory = MemoryConfig(  # selective_op recomputes only the elementwise ops between matmuls: no matmul FLOPs
        enable_activation_checkpointing=bool(cfg.get("enable_activation_checkpointing")) and not selective,
        activation_checkpointing_every_n_layers=int(cfg.get("activation_checkpointing_every_n_layers") or 1),
        activation_checkpointing_policy=str(cfg.get("activation_checkpointing_policy") or "block"))
    chunked = "Chunked" in str((cfg.get("loss") or {}).get("_component_", ""))
    lora_key = None if lora is None else json.dumps(OmegaConf.to_container(lora, resolve=True), sort_keys=True)
    key = (json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True), lora_key,
           astuple(memory), chunked, cfg.get("dtype") == "fp16", int(cfg.tokenizer.max_seq_len))
    if key not in _FLOPS_CACHE:
        source = resolve_model_source(cfg.model)
        model = build_model_from_args(source.args)  # meta: no memory
        lora_node = None if lora is None else OmegaConf.to_container(lora, resolve=True)
        apply_memory_techniques(model, memory, lora=lora_node)
        if lora is not None:
            freeze_base(model)
        recomputes = chunked and ChunkedCrossEntropyLoss.recomputes_projection(
            model.lm_head, autocast=cfg.get("dtype") == "fp16")
        _FLOPS_CACHE[key] = flops_per_token(model, int(cfg.tokenizer.max_seq_len), memory,
                                            loss_recomputes_projection=recomputes).hardware
    return _FLOPS_CACHE[key]


_PARAMS_CACHE: dict = {}


def _parameter_bytes(cfg) -> tuple[float, float]:
    """``(trainable bytes, frozen bytes)`` of ``cfg``'s model as stored (NF4 ~0.5 byte a weight plus its scales,
    fp8 one byte), from the model built on the meta device."""
    lora = cfg.get("lora")
    lora_key = None if lora is None else json.dumps(OmegaConf.to_container(lora, resolve=True), sort_keys=True)
    key = (json.dumps(OmegaConf.to_container(cfg.model, resolve=True), sort_keys=True), lora_key,
           cfg.get("weight_storage_dtype"), cfg.get("dtype"))
    if key not in _PARAMS_CACHE:
        dtype_bytes = 4 if cfg.get("dtype") == "fp32" else 2
        model = build_model_from_args(_args(cfg))  # meta: no memory
        apply_memory_techniques(model, MemoryConfig(weight_storage_dtype=cfg.get("weight_storage_dtype")),
                                lora=None if lora is None else OmegaConf.to_container(lora, resolve=True))
        if lora is not None:
            freeze_base(model)
        nf4 = bool(lora is not None and lora.get("quantize_base"))
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) * dtype_bytes
        frozen = 0.0
        for p in model.parameters():
            if not p.requires_grad:
                per_weight = 0.53 if nf4 and p.dim() == 2 else p.element_size() if p.dtype.itemsize == 1 else dtype_bytes
                frozen += p.numel() * per_weight
        _PARAMS_CACHE[key] = (float(trainable), frozen)
    return _PARAMS_CACHE[key]


def transfer_bytes_per_token(cfg) -> float:
    """Bytes moved between device and host per trained token: offloaded activations (each block's input out and
    back), optimizer offload (each micro-batch's gradients out, the updated parameters back once per step) and
    weight offloading (every frozen weight in for forward and again for backward, a third time for leaf_level's
    recomputation)."""
    args = _args(cfg)
    dtype_bytes = 4 if cfg.get("dtype") == "fp32" else 2
    micro_tokens = int(cfg.batch_size) * int(cfg.tokenizer.max_seq_len)
    step_tokens = micro_tokens * int(cfg.get("gradient_accumulation_steps") or 1)
    moved = 0.0
    if cfg.get("enable_activation_checkpointing") and cfg.get("enable_activation_offloading"):
        moved += 2 * args.n_layers * args.dim * dtype_bytes
    if cfg.get("optimizer_offload") or cfg.get("weight_offloading"):
        trainable, frozen = _parameter_bytes(cfg)
        if cfg.get("optimizer_offload"):
            moved += trainable / micro_tokens + trainable / step_tokens
        offloading = cfg.get("weight_offloading")
        if offloading:
            visits = 3 if offloading.get("type") == "leaf_level" and cfg.get("enable_activation_checkpointing") else 2
            moved += visits * frozen / micro_tokens
    return moved


def step_cost(cfg) -> float:
    """Seconds per trained token on the reference GPU (see the module docstring)."""
    return model_flops_per_token(cfg) / REFERENCE_FLOPS + transfer_bytes_per_token(cfg) / REFERENCE_HOST_BANDWIDTH


# -------------------------------------------------------------------------------------------------- search
@dataclass
class Candidate:
    overrides: dict
    levels: tuple[int, ...]
    cost: float
    cfg: Any = None
    plan: MemoryPlan | None = None
    fits: bool | None = None
    pruned: bool = False
    changes: dict = field(default_factory=dict)


def _apply(cfg, overrides: dict):
    out = copy.deepcopy(cfg)
    for key, value in overrides.items():
        OmegaConf.update(out, key, value, merge=False, force_add=True)
    return out


def _changes(base, cfg, keys: Iterable[str]) -> dict:
    changed = {}
    for key in keys:
        before = OmegaConf.select(base, key, default=None)
        after = OmegaConf.select(cfg, key, default=None)
        if before != after:
            changed[key] = after
    return changed


def search(cfg, schema, *, device_memory: int, host_memory: int | None = None, knobs: list[Knob] | None = None,
           max_fits: int = 5, max_plans: int = 40, progress: Callable[[str], None] | None = None,
           world_size: int = 1) -> list[Candidate]:
    """Every candidate of ``knobs`` over ``cfg`` that ``schema``'s rules accept, cheapest first, each planned or
    pruned as the module docstring says. Returns them all (``fits`` None where never planned)."""
    knobs = KNOBS if knobs is None else knobs
    options = [knob.choices(cfg) for knob in knobs]
    candidates = []
    for combo in itertools.product(*options):
        overrides: dict = {}
        for _, choice in combo:
            overrides.update(choice)
        variant = _apply(cfg, overrides)
        if schema is not None and any(rule(variant) for rule in schema.rules):
            continue
        keys = sorted({k for _, choice in combo for k in choice})
        candidates.append(Candidate(overrides, tuple(level for level, _ in combo), step_cost(variant), variant,
                                    changes=_changes(cfg, variant, keys)))
    # cheapest first; among equals the larger micro-batch (lower level), then the fewer techniques
    candidates.sort(key=lambda c: (round(c.cost, 15), c.levels[-1], sum(c.levels)))
    failed: list[tuple[int, ...]] = []
    state = {"fits": 0, "plans": 0}

    def dominated(levels) -> bool:
        return any(all(a <= b for a, b in zip(levels, fail)) for fail in failed)

    def plan(candidate: Candidate) -> None:
        candidate.plan = plan_memory(candidate.cfg, device_memory=device_memory, host_memory=host_memory,
                                     world_size=world_size)
        state["plans"] += 1
        spare = candidate.plan.fits()
        candidate.fits = spare["device"] >= 0 and (spare["host"] is None or spare["host"] >= 0)
        if progress is not None:
            progress(f"  plan {state['plans']}: {_describe(candidate.changes)}: "
                     f"{format_bytes(candidate.plan.device_total_bytes)} {'fits' if candidate.fits else 'does not fit'}")
        if not candidate.fits:
            failed.append(candidate.levels)

    # Candidates of equal cost and micro-batch form a tier: its most-saving member is planned first, and when that
    # does not fit, every member it dominates is pruned at once.
    for _, tier in itertools.groupby(candidates, key=lambda c: (round(c.cost, 15), c.levels[-1])):
        tier = list(tier)
        top = max(tier, key=lambda c: sum(c.levels))
        for candidate in [top] + [c for c in tier if c is not top]:
            if state["fits"] >= max_fits or state["plans"] >= max_plans:
                return candidates
            if candidate.plan is not None:
                continue
            if dominated(candidate.levels):
                candidate.pruned, candidate.fits = True, False
                continue
            plan(candidate)
        state["fits"] += sum(1 for c in tier if c.fits)
    return candidates


def _describe(changes: dict) -> str:
    return " ".join(f"{k}={_yaml(v)}" for k, v in changes.items()) or "(as configured)"


def _yaml(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def fit_command(cfg, *, recipe: str, config_path: Path, overrides: list[str], schema, device_memory: int | None,
                host_memory: int | None, world_size: int, output: Path) -> int:
    """``mtune plan --fit``: print the fitting configs cheapest first and write the best to ``output``."""
    if device_memory is None:
        raise ConfigError("--fit needs --device-memory SIZE (the memory of the device to fit, e.g. 24GiB)")
    print(f"mtune plan --fit: {recipe} with {config_path} into {format_bytes(device_memory)}")
    candidates = search(cfg, schema, device_memory=device_memory, host_memory=host_memory, progress=print,
                        world_size=world_size)
    fitting = [c for c in candidates if c.fits]
    planned = sum(1 for c in candidates if c.plan is not None)
    pruned = sum(1 for c in candidates if c.pruned)
    print(f"{len(candidates)} candidates, {planned} planned, {pruned} pruned without planning")
    if not fitting:
        print(f"nothing fits in {format_bytes(device_memory)}: a smaller model, a shorter tokenizer.max_seq_len or "
              "a larger device")
        return 1
    base = fitting[0].cost
    print(f"\n{'#':>2} {'cost':>6} {'device':>11} {'host':>10}  changes")
    for i, c in enumerate(fitting, 1):
        print(f"{i:>2} {c.cost / base:>5.2f}x {format_bytes(c.plan.device_total_bytes):>11} "
              f"{format_bytes(c.plan.host_peak_bytes):>10}  {_describe(c.changes)}")
    best = fitting[0]
    write_config(config_path, overrides, best.changes, output)
    print(f"\nbest written to {output}; run it with:\n  mtune run {recipe} --config {output}")
    if "clip_grad_norm" in best.changes:
        print("note: optimizer_in_bwd steps each weight during backward, so gradient clipping is off in it")
    return 0


def write_config(config_path: Path, overrides: list[str], changes: dict, output: Path) -> Path:
    """The user's config with their overrides and the fit's changes, interpolations kept, as YAML."""
    cfg = load_config(config_path, overrides)
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    header = (f"# Written by `mtune plan --fit` from {config_path}; changed: {_describe(changes)}\n")
    output = Path(output)
    output.write_text(header + OmegaConf.to_yaml(cfg))
    return output
