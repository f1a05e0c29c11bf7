"""What a candidate config costs, for ``mtune plan --fit``: seconds per trained token on a reference GPU.

:func:`step_cost` adds the FLOPs per token that the performance counter (:mod:`mtune.training.observe.flops`, the
numerator of HFU) counts for the candidate's model (forward, backward, the recomputation of checkpointed blocks and
of a checkpointed chunked loss), divided by :data:`REFERENCE_FLOPS`, and the bytes every technique moves between
device and host per token (each technique's ``transfer_bytes_per_token``: offloaded activations, optimizer
offload's gradients and parameters, weight offloading's frozen weights), divided by
:data:`REFERENCE_HOST_BANDWIDTH`. Smaller micro-batches and 8-bit optimizers cost no FLOPs in this model.

Bytes follow the storage dtype (`mtune.training.precision.storage_dtype`): ``dtype=fp16`` stores fp32
weights and keeps an fp32 residual stream under fp16 autocast, so its weights and offloaded block inputs count 4
bytes an element, like fp32.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, NamedTuple

import torch
from omegaconf import OmegaConf

from mtune.config.keys import accumulation_steps
from mtune.models import build_model_from_args
from mtune.modules.fp8_linear import has_fp8_storage
from mtune.modules.lora import has_nf4_weight
from mtune.modules.loss import ChunkedCrossEntropyLoss
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.technique import Footprint, ModelFacts
from mtune.training.precision import storage_dtype
from mtune.training.model_setup import resolve_model_source
from mtune.training.observe.flops import flops_per_token

__all__ = ["one_search", "step_cost", "step_costs", "StepCost", "model_flops_per_token", "transfer_bytes_per_token",
           "model_facts", "device_floor", "REFERENCE_FLOPS", "REFERENCE_HOST_BANDWIDTH", "MICRO_BATCH_OVERHEAD_S",
           "HOST_ADAMW_SECONDS_PER_PARAM", "is_cuda_target"]

REFERENCE_FLOPS = 400e12
"""Sustained bf16 matmul FLOP/s of the reference GPU; only ratios between candidates matter. Cited, waiting for a lent
GPU to measure it (benchmarks/results/README.md): an H100 SXM's datasheet gives 989 dense bf16 TFLOP/s, and Meta
reports 38-43% BF16 MFU (about 380-430 TFLOP/s a GPU) training Llama 3 on H100s ("The Llama 3 Herd of Models",
arXiv:2407.21783, section 3.3.4)."""
REFERENCE_HOST_BANDWIDTH = 25e9
"""Bytes/s between device and host, one direction. Cited, waiting for a lent GPU (benchmarks/results/README.md):
PCIe 4.0 x16 carries 16 GT/s a lane, about 31.5 GB/s a direction after 128b/130b encoding (PCI-SIG), of which pinned
copies reach about 80% (NVIDIA's ``bandwidthTest`` sample measures this); PCIe 5.0 hosts reach about twice as much,
so the figure is conservative there."""
MICRO_BATCH_OVERHEAD_S = 0.02
"""Seconds each micro-batch costs beyond its FLOPs: kernel launches, Python and the small-matmul inefficiency of a
forward and backward (the GPU's lower efficiency at small micro-batches, as one constant). Stated, not yet measured
on a GPU: an 8B model's 32 blocks x ~40 kernels x ~15 us. ``benchmarks/planner_constants.py`` counts the kernels:
102 non-view aten ops per block in forward and backward (benchmarks/results/planner_constants.json), so the same
reasoning gives ~0.05 s; the GPU suite is to measure the intercept of step time against micro-batch tokens."""
HOST_ADAMW_SECONDS_PER_PARAM = 1.2e-9
"""Seconds per parameter of torch's fused AdamW step on the host CPU (``optimizer_offload: cpu``), bf16 parameters:
measured by ``benchmarks/host_adamw.py`` on this project's 2-core x86_64 machine, 1.234e-9 s/param
(benchmarks/results/host_adamw.json; docs/plan.md)."""


def _node_key(node) -> str | None:
    return None if node is None else json.dumps(OmegaConf.to_container(node, resolve=True), sort_keys=True)


_SEARCH_CACHE: ContextVar[dict | None] = ContextVar("mtune_search_cache", default=None)
"""The cache of the search running in this context (:func:`one_search`); None outside a search."""


@contextlib.contextmanager
def one_search() -> Iterator[None]:
    """Inside, the meta model, FLOPs and parameter bytes are computed once per distinct model and parameter
    settings and shared by every candidate of the search (``--fit`` plans hundreds); they are dropped when the
    search ends. Outside a search every call computes its own. Nested searches share the outer one's."""
    if _SEARCH_CACHE.get() is not None:
        yield
        return
    token = _SEARCH_CACHE.set({})
    try:
        yield
    finally:
        _SEARCH_CACHE.reset(token)


def _once(kind: str, key: tuple, compute: Callable[[], Any]) -> Any:
    cache = _SEARCH_CACHE.get()
    if cache is None:
        return compute()
    if (kind, key) not in cache:
        cache[(kind, key)] = compute()
    return cache[(kind, key)]


def _meta_model(cfg):
    """``cfg``'s model on the meta device (no memory) with the parameters its techniques decide (adapters, a frozen
    base, fp8 storage): 0.1-0.3 CPU-s for an 8B model, built once per search for each model and such settings and
    shared by the FLOPs and bytes below, which only read it."""
    memory = MemoryConfig.from_config(cfg)

    def build():
        model = build_model_from_args(resolve_model_source(cfg.model).args)
        phases.shape_parameters(model, memory)
        return model

    return _once("meta model", (_node_key(cfg.model), phases.parameter_settings(memory)), build)


def model_flops_per_token(cfg) -> float:
    """Training FLOPs per token of ``cfg``'s model, recomputation included: the performance counter
    (:func:`mtune.training.observe.flops.flops_per_token`, the numerator of HFU) on the model built on the meta
    device with the config's adapters, at ``tokenizer.max_seq_len``, with the blocks checkpointed as the config
    says (``selective_op`` recomputes only the elementwise ops between matmuls: no counted FLOPs) and the MLP
    tiled as ``mlp_tiles`` says for the micro-batch's tokens. Within a search, computed once per distinct
    model/adapter/checkpointing/tiling/loss combination (the other techniques cost no FLOPs)."""
    memory = MemoryConfig.from_config(cfg)
    args = resolve_model_source(cfg.model).args
    chunked = "Chunked" in memory.run.loss_component
    fp16 = memory.run.dtype == "fp16"
    tokens = memory.run.micro_batch_tokens
    seq_len = int(cfg.tokenizer.max_seq_len)

    def count() -> float:
        model = _meta_model(cfg)  # adapters; checkpointing and tiles are read from ``memory``
        recomputes = chunked and ChunkedCrossEntropyLoss.recomputes_projection(model.lm_head, autocast=fp16)
        return flops_per_token(model, seq_len, memory, loss_recomputes_projection=recomputes, tokens=tokens).hardware

    key = (_node_key(cfg.model), phases.parameter_settings(memory),
           phases.recompute(memory, args.n_layers, tokens, args.dim), chunked, fp16, seq_len)
    return _once("flops", key, count)


def _parameter_bytes(cfg) -> tuple[float, float, float]:
    """``(trainable bytes, frozen bytes, frozen bytes inside the blocks)`` of ``cfg``'s model as stored, from the
    model built on the meta device: a
    technique's `Footprint.frozen_bytes_per_weight` (NF4 about 0.516 with its scales) for the frozen 2-D weights
    inside the blocks and the modules stored so (`has_nf4_weight`: NF4 experts, a QLoRA head), one byte for the
    weights fp8 storage converts on loading (`has_fp8_storage`; the meta model still holds them in the model
    dtype) and for weights already fp8, the rest (the embedding, an output projection without adapters) in the
    storage dtype."""
    memory = MemoryConfig.from_config(cfg)
    stored = phases.frozen_bytes_per_weight(memory)

    def count() -> tuple[float, float]:
        dtype_bytes = storage_dtype(str(cfg.get("dtype"))).itemsize
        model = _meta_model(cfg)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) * dtype_bytes
        frozen, in_blocks_bytes, seen = 0.0, 0.0, set()
        for module_name, module in model.named_modules():
            in_blocks, nf4 = module_name.startswith("layers."), has_nf4_weight(module)
            fp8 = module.weight_storage_dtype.itemsize if has_fp8_storage(module) else None  # stored on loading
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad or id(p) in seen:  # a tied weight once
                    continue
                seen.add(id(p))
                converted = stored is not None and name == "weight" and (nf4 or (in_blocks and p.dim() == 2))
                nbytes = p.numel() * (stored if converted else fp8 if fp8 and name == "weight"
                                      else p.element_size() if p.dtype.itemsize == 1 else dtype_bytes)
                frozen += nbytes
                in_blocks_bytes += nbytes if in_blocks else 0.0
        return float(trainable), frozen, in_blocks_bytes

    return _once("parameter bytes",
                 (_node_key(cfg.model), phases.parameter_settings(memory), stored, cfg.get("dtype")), count)


def is_cuda_target(cfg) -> bool:
    """Whether ``cfg`` computes on a CUDA device (``auto``: whether this machine has one)."""
    device = str(cfg.get("device") or "auto")
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def model_facts(cfg, world_size: int = 1) -> ModelFacts:
    """The shape, stored bytes and tokens per micro-batch and per step (of one rank) of ``cfg``'s model, sharded
    over ``world_size`` ranks."""
    args = resolve_model_source(cfg.model).args
    trainable, frozen, frozen_in_blocks = _parameter_bytes(cfg)
    micro_tokens = int(cfg.batch_size) * int(cfg.tokenizer.max_seq_len)
    numel = int(trainable / storage_dtype(str(cfg.get("dtype"))).itemsize)
    return ModelFacts(n_layers=args.n_layers, dim=args.dim, trainable_bytes=trainable, frozen_bytes=frozen,
                      residual_bytes=storage_dtype(str(cfg.get("dtype"))).itemsize,
                      micro_batch_tokens=micro_tokens,
                      step_tokens=micro_tokens * accumulation_steps(cfg),
                      cuda=is_cuda_target(cfg), trainable_numel=numel, world_size=world_size,
                      frozen_block_bytes=frozen_in_blocks)


def _first(footprints: list[Footprint], field: str):
    """The first technique's answer (not None) for ``field``: the rules let at most one technique name it."""
    return next((value for f in footprints if (value := getattr(f, field)) is not None), None)


def device_floor(cfg, world_size: int = 1) -> tuple[dict[str, float], dict[str, float]]:
    """Bytes that ``cfg`` must hold whatever its activations, as ``({what: device bytes}, {what: host bytes})``:
    the weights (where the techniques' footprints keep them), the optimizer states where they live (device, host,
    or managed memory: neither budget's floor), and the full set of gradients unless a technique frees them during
    backward. Sharded over ``world_size`` ranks (FSDP2). ``--fit`` refuses a candidate whose floor exceeds a budget
    without planning it."""
    facts = model_facts(cfg, world_size)
    memory = MemoryConfig.from_config(cfg)
    footprints = phases.footprints(memory, facts)
    device: dict[str, float] = {}
    host: dict[str, float] = {}
    trainable = f"{memory.run.dtype} trainable weights" if memory.lora is None else "adapters"
    weights_on_host = _first(footprints, "trainable_weights_home") == "host"
    (host if weights_on_host else device)[trainable] = facts.trainable_bytes
    home = _first(footprints, "frozen_weights_home")
    waiting = {"host": facts.frozen_bytes, "host_blocks": facts.frozen_in_blocks}.get(home, 0.0)  # on the host
    for where, nbytes in ((host, waiting), (device, facts.frozen_bytes - waiting)):
        if nbytes:
            where["frozen weights"] = nbytes
    state_bytes = (_first(footprints, "state_bytes_per_element") or 0.0) * facts.trainable_numel
    home = _first(footprints, "states_home")
    name = f"optimizer states ({memory.run.optimizer_component.rsplit('.', 1)[-1]})"
    if home == "host":
        host[name] = state_bytes
        if weights_on_host:  # the weights stepped there are the ones counted above
            host["gradients"] = facts.trainable_bytes
        else:
            host["host copies and gradients"] = 2 * facts.trainable_bytes
    elif home is None:
        device[name] = state_bytes
    if home != "host" and not any(f.frees_gradients for f in footprints):
        device["gradients"] = facts.trainable_bytes
    return ({k: v / world_size for k, v in device.items()}, {k: v / world_size for k, v in host.items()})


def transfer_bytes_per_token(cfg, world_size: int = 1) -> float:
    """Bytes moved between device and host per trained token (of one rank): every technique's own count."""
    footprints = phases.footprints(MemoryConfig.from_config(cfg), model_facts(cfg, world_size))
    return sum(f.transfer_bytes_per_token for f in footprints)


class StepCost(NamedTuple):
    seconds_per_token: float
    """`step_cost`."""
    transfer_bytes_per_token: float
    """`transfer_bytes_per_token`."""


def step_costs(cfg, paged_bytes: float = 0.0, world_size: int = 1) -> StepCost:
    """`step_cost` and `transfer_bytes_per_token` from one reading of the techniques' footprints (``--fit`` asks
    both of every candidate)."""
    facts = model_facts(cfg, world_size)
    footprints = phases.footprints(MemoryConfig.from_config(cfg), facts)
    compute = model_flops_per_token(cfg) / REFERENCE_FLOPS
    moved_bytes = sum(f.transfer_bytes_per_token for f in footprints)
    transfers = moved_bytes / REFERENCE_HOST_BANDWIDTH
    moved = max(compute, transfers) if facts.cuda else compute + transfers
    host_step = sum(f.host_step_elements for f in footprints) * HOST_ADAMW_SECONDS_PER_PARAM
    paging = 2.0 * paged_bytes / REFERENCE_HOST_BANDWIDTH
    seconds = moved + MICRO_BATCH_OVERHEAD_S / facts.micro_batch_tokens + (host_step + paging) / facts.step_tokens
    return StepCost(seconds, moved_bytes)


def step_cost(cfg, paged_bytes: float = 0.0, world_size: int = 1) -> float:
    """Seconds per trained token on the reference GPU (see the module docstring): compute, and the transfers
    (overlapped with compute on CUDA, where they run on side streams: the larger of the two counts), plus what
    overlaps nothing: each micro-batch's fixed overhead, the host optimizer step of optimizer offload, and the
    traffic of ``paged_bytes`` of managed optimizer state the device cannot keep resident (about twice a step).
    Under FSDP2 over ``world_size`` ranks: one rank's tokens, transfers and host step (communication is not
    priced: it is the same for every candidate of one world size, but for fsdp_cpu_offload's host copies)."""
    return step_costs(cfg, paged_bytes, world_size).seconds_per_token
