"""``mtune plan``: the peak memory of a training config, predicted before any GPU is touched.

:func:`plan_memory` builds the model, adapters, NF4 weights, optimizer and every memory technique with the
recipe's own setup functions (:func:`~mtune.training.model_setup.setup_model` on the meta device, or
:func:`~mtune.training.model_setup.build_sharded_model` for a distributed recipe, then
:func:`~mtune.training.model_setup.materialize_model` / ``materialize_sharded_model`` and
:func:`~mtune.training.optimizers.build_optimizer` under ``FakeTensorMode`` (`fake_mode.PlannerFakeMode`: a
cheaper cache key, the same tensors); no step of theirs is re-implemented here, and what planning needs differently
is a switch of theirs: ``materialize=False``, no checkpoint, a fake process group), then runs two optimizer steps of
the training loop's own tensor work (:func:`~mtune.training.loop.step_on_tensors`) on fake tensors while the run's
byte tracker (:class:`~mtune.training.planning.tracker.TensorTracker`, as `fake_mode.PlanningTracker`) counts live
bytes by category on the device and on the host. No weight file is read (only the checkpoint's ``config.json``)
and no tensor memory is allocated, so an 8B config plans on a laptop.

- The batch is ``batch_size`` rows of ``tokenizer.max_seq_len`` tokens (packed rows with their document ids when
  ``dataset.packed``), every token trained: the largest batch the config can produce.
- Step 1's optimizer step creates the optimizer state, which may peak higher than any later step (lazy state
  creation; FSDP2's first step) and does not depend on the batch. Step 2 runs ``min(gradient_accumulation_steps,
  2)`` full micro-batches: the second has the first's gradients alive, as every later one does, so the peak of any
  number of micro-batches is seen. The plan is the larger of the two. Gradients that only need to exist (step 1's,
  step 2's first micro-batch's) are made on one device without a forward, each trainable parameter's ``sum`` run
  backward (the same gradients, hooks included: a forward there peaks below step 2's second micro-batch and cost
  a plan about half its time); under FSDP2 by a forward (1 x 16 tokens in step 1), whose backward makes them
  through the reduce-scatter as the run does.
- The compute device is modelled by fake CPU tensors; for a CUDA target the host is a distinct
  :class:`~mtune.training.placement.Placement` host, so offloaded tensors count there, and every device
  storage is rounded up to the caching allocator's 512-byte blocks: the device peak predicts
  ``torch.cuda.max_memory_allocated()``. :data:`CUDA_CONTEXT_BYTES` is added for the whole-GPU figure
  (``nvidia-smi``).
- A distributed recipe's config is planned for rank 0 of ``world_size`` ranks (``--nproc_per_node``): a fake
  process group of that size (no communication), the recipe's own FSDP2 sharding
  (:func:`~mtune.training.distributed.shard_model`) and sharded initialisation, then the same two steps: the
  per-rank shards, FSDP2's all-gather and reduce-scatter buffers and resharding after forward are all live tensors
  the tracker sees. With ``fsdp_cpu_offload`` the shards, their gradients and the optimizer step are laid out on
  the host as FSDP2 keeps them on a GPU machine (:func:`_fsdp_offload_on_host`).
- Optimizers that cannot step on fake tensors (bitsandbytes) are replaced by stand-ins that create the documented
  state layout (:mod:`mtune.training.planning.optimizer_layouts`); preference recipes: `planning.preference`.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings

import torch
import torch.distributed as dist

from mtune.config.errors import ConfigError
from mtune.config.keys import accumulation_steps
from mtune.models import shortened
from mtune.modules.gated_deltanet import planning_recurrence, recurrence_notes
from mtune.training.loop import build_loss, step_on_tensors
from mtune.training.optimizers import build_optimizer, inner_optimizers
from mtune.training.placement import Placement
from mtune.training.precision import autocast, storage_dtype
from mtune.training.memory import phases
from mtune.training.memory.registry import MemoryConfig
from mtune.training.memory.tensor_bytes import plain_parts
from mtune.training.model_setup import (ModelSource, build_sharded_model, materialize_model, materialize_sharded_model,
                                        resolve_model_source, setup_model)
from mtune.training.planning.memory_plan import CUDA_BLOCK_BYTES, CUDA_CONTEXT_BYTES, MemoryPlan, PlanError
from mtune.training.planning.fake_mode import PlanningModes, planning_modes
from mtune.training.planning.replay import fused_nf4_dequantization, replayed_nf4_dequantization
from mtune.training.planning.optimizer_layouts import LAYOUT_STANDINS
from mtune.training.planning.preference import packed_pair_fields, planned_preference, row_length, rows_per_sample

__all__ = ["plan_memory"]

UNSUPPORTED_BY_PLANNER = ("torchao.optim.",)


def _target(device: str) -> torch.device:
    """The device a run of this config computes on: ``auto`` is CUDA when here, else the CPU; ``cuda`` is
    accepted without a GPU (nothing runs on it)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(torch.device(device).type)


def _model_source(cfg, n_layers: int | None = None):
    source = resolve_model_source(cfg.model)  # reads config.json only
    args = source.args if n_layers is None else shortened(source.args, n_layers)
    return ModelSource(source.family, args, None)  # random init under fake tensors: no weight file is read


def _optimizer_node(cfg) -> dict:
    node = dict(cfg.optimizer)
    component = node.get("_component_", "")
    if component.startswith(UNSUPPORTED_BY_PLANNER):
        raise PlanError(f"optimizer._component_={component}: the planner cannot run torchao's low-bit optimizers on "
                        "fake tensors yet; plan with bitsandbytes.optim.AdamW8bit (the same state bytes) instead")
    if component in LAYOUT_STANDINS:
        node["_component_"] = LAYOUT_STANDINS[component]
    return node


def _batch(cfg, vocab_size: int, micro_batches: int, small: bool = False, seq_len: int | None = None) -> list[dict]:
    seq_len = seq_len or cfg.tokenizer.get("max_seq_len")
    if not seq_len:
        raise ConfigError("tokenizer.max_seq_len is null: the planner needs the longest sample length; set it")
    batch_size, seq_len = int(cfg.batch_size) * rows_per_sample(cfg), row_length(cfg, seq_len)  # pairs: 2 rows each
    if small:  # step 1 only creates the optimizer state, whose size does not depend on the batch
        batch_size, seq_len = rows_per_sample(cfg), min(seq_len, 16)
    packed = bool((cfg.get("dataset") or {}).get("packed"))
    batches = []
    for _ in range(micro_batches):
        batch = {"tokens": torch.randint(0, vocab_size, (batch_size, seq_len)),
                 "labels": torch.randint(0, vocab_size, (batch_size, seq_len))}
        if packed:  # two documents per row: the block-causal mask path of a packed run
            half = seq_len // 2
            batch["input_pos"] = torch.cat([torch.arange(half), torch.arange(seq_len - half)]).expand(batch_size, -1)
            batch["document_ids"] = torch.cat([torch.zeros(half, dtype=torch.long),
                                               torch.ones(seq_len - half, dtype=torch.long)]).expand(batch_size, -1)
            batch.update(packed_pair_fields(cfg, batch))  # packed pairs: which response each token is of
        batches.append(batch)
    return batches


def _planned_memory(memory: MemoryConfig, cuda: bool, fsdp_offload: bool) -> tuple[MemoryConfig, list[str]]:
    """The run's memory keys as planned, and notes on what the plan does not model."""
    memory, notes = phases.planned(memory)
    if _managed_states(memory) and not cuda:
        notes.append("paged optimizer states: without CUDA they are ordinary memory, counted on the device")
    if fsdp_offload:
        notes.append("fsdp_cpu_offload: the device copy of one block's shards that FSDP2 makes before gathering "
                     "them (the block's parameters / ranks, for a moment) is not counted")
    return memory, notes


def _fsdp_offload_on_host(model, optimizer, placement: Placement) -> None:
    """``fsdp_cpu_offload`` laid out as on a GPU: FSDP2 keeps each rank's parameter shards, their gradients and the
    optimizer's states and step on the host, copies shards to the device to gather them and each reduce-scattered
    gradient back to the host. The planner's device and host are both the CPU, where FSDP2's ``.to`` copies return
    the tensor itself, so this makes the host side explicit: the shards are marked host, each new gradient is
    copied to the host as FSDP2 copies it (before the tracker's own hook counts it: registered first), and the
    optimizer allocates under the placement's host allocation."""
    def gradient_to_host(param):
        local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        if not placement.on_host(local):  # accumulation adds into the host gradient FSDP2 already made
            param.grad._local_tensor = placement.to_host(local)  # in place of the shard, as FSDP2 swaps it

    for param in model.parameters():
        for part in plain_parts(param):
            placement.mark_host(part)
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(gradient_to_host)
    stepping = contextlib.ExitStack()

    def states_on_host(opt, *_):
        stepping.close()
        for state in opt.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    for part in plain_parts(value):
                        placement.mark_host(part)

    for inner in inner_optimizers(optimizer):
        states_on_host(inner)  # allocated up front (AdamW), beside the shards
        inner.register_step_pre_hook(lambda *_: stepping.enter_context(placement.host_allocation()))
        inner.register_step_post_hook(states_on_host)


def _managed_states(memory: MemoryConfig) -> bool:  # optimizer states in CUDA managed memory (paged optimizers)
    return any(f.states_home == "managed" for f in phases.footprints(memory))


@contextlib.contextmanager
def _fake_process_group(world_size: int):
    """Rank 0 of a fake process group of ``world_size`` ranks (no communication), for the recipe's own sharding."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _quiet_setup():
    """Setup's own INFO lines are about a run, not a plan (warnings still show): a level, which the mtune
    logger's children inherit (they do not inherit ``disabled``)."""
    logger = logging.getLogger("mtune")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def plan_memory(cfg, *, device_memory: int | None = None, host_memory: int | None = None,
                fake: bool = True, world_size: int = 1, n_layers: int | None = None,
                seq_len: int | None = None) -> MemoryPlan:
    """Plan ``cfg`` (a training config with its recipe's defaults filled in). With ``fake=False`` the same
    steps run on real tensors (tests compare the two). ``n_layers`` plans the model with that many blocks instead
    of its own (``--fit`` extrapolates per layer from two such plans). ``seq_len``: plan rows of this many tokens
    instead of ``tokenizer.max_seq_len`` (``mtune plan --from-data``: the longest batch the data makes,
    `mtune.training.planning.data_lengths`)."""
    sharded = "fsdp_reshard_after_forward" in cfg  # a distributed recipe's config
    if world_size != 1 and not sharded:
        raise PlanError(f"--nproc_per_node {world_size}: recipe {cfg.get('recipe')} runs on one device; plan a "
                        "*_distributed recipe's config for several ranks")
    if fake and sharded and dist.is_initialized():
        raise PlanError("plan a distributed config from a process without a process group (the planner makes a "
                        "fake one of the given world size)")
    start = time.perf_counter()
    target = _target(str(cfg.device))
    cuda = target.type == "cuda"
    cpu = torch.device("cpu")
    placement = Placement("cpu", "cpu", distinct=target.type != "cpu")
    memory = MemoryConfig.from_config(cfg)
    # FSDP2 keeps the shards on the host (fsdp_cpu_offload), with host and device apart
    fsdp_offload = sharded and placement.distinct and any(
        f.trainable_weights_home == "host" for f in phases.footprints(memory))
    memory, notes = _planned_memory(memory, cuda, fsdp_offload)
    dtype = storage_dtype(str(cfg.dtype))
    source = _model_source(cfg, n_layers)
    modes = planning_modes(fake=fake, compiled=phases.compiles(memory))  # its fake mode takes meta tensors in
    group = _fake_process_group(world_size) if sharded and not dist.is_initialized() else contextlib.nullcontext()
    with _quiet_setup(), group:
        if sharded:  # the run's own setup, split where the weights come in: they are made under fake tensors
            model, activation_context = build_sharded_model(
                source, device=cpu, dtype=dtype, memory=memory, placement=placement,
                fsdp_reshard_after_forward=cfg.fsdp_reshard_after_forward)
        else:
            model, activation_context = setup_model(source, device=cpu, dtype=dtype, memory=memory,
                                                    materialize=False, placement=placement)
        modes.compile_as_planned(model)
        with planning_recurrence(target), modes.fake_mode or contextlib.nullcontext(), warnings.catch_warnings():
            # torchao's NF4 all-gather compares storage pointers, which fake tensors lack: harmless here
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            if sharded:
                materialize_sharded_model(model, source, device=cpu, dtype=dtype, seed=int(cfg.get("seed") or 0),
                                          memory=memory)
            else:
                materialize_model(model, source, device=cpu, dtype=dtype, memory=memory)
            optimizer = build_optimizer(_optimizer_node(cfg), model, memory, placement=placement, target_device=target)
            if fsdp_offload:
                _fsdp_offload_on_host(model, optimizer, placement)
            managed = cuda and _managed_states(memory)
            if managed:  # paged states: CUDA managed memory, outside the allocator (counted apart, on the host)
                for inner in inner_optimizers(optimizer):
                    inner.managed = placement
            peaks = _two_steps(cfg, model, optimizer, activation_context, placement, modes, target, world_size,
                               source.args.vocab_size, seq_len, planned_preference(
                                   cfg, model, source, dtype=dtype, memory=memory, placement=placement,
                                   autocast=lambda: autocast(str(cfg.dtype), target)), sharded=sharded)
    params = list(model.parameters())
    managed_bytes = peaks.category_peak["host"]["optimizer_state"] if managed else 0
    return MemoryPlan(
        target=str(target), world_size=world_size,
        device_peak_bytes=peaks.peak["device"], host_peak_bytes=peaks.peak["host"],
        device=peaks.category_peak["device"], host=peaks.category_peak["host"], at_peak=peaks.at_peak,
        batch={"batch_size": int(cfg.batch_size), "seq_len": int(seq_len or cfg.tokenizer.max_seq_len),
               "accumulation": accumulation_steps(cfg)},
        parameters={"total": sum(p.numel() for p in params),
                    "trainable": sum(p.numel() for p in params if p.requires_grad)},
        predicts="torch.cuda.max_memory_allocated()" if cuda else "peak_tensor_gib (live tensor bytes)",
        cuda_context_bytes=CUDA_CONTEXT_BYTES if cuda else 0, device_memory=device_memory, host_memory=host_memory,
        seconds=time.perf_counter() - start, notes=notes + recurrence_notes(model, target), managed_bytes=managed_bytes,
    )


def _every_gradient(model) -> None:
    """Gradients without a forward (step 1's, step 2's first micro-batch's): each trainable parameter's ``sum`` run
    backward, so every gradient is made as backward makes it (hooks included: optimizer-in-backward steps there)."""
    torch.autograd.backward([p.sum() for p in model.parameters() if p.requires_grad])


def _two_steps(cfg, model, optimizer, activation_context, placement, modes: PlanningModes, target, world_size,
               vocab_size, seq_len=None, preference=None, sharded=False):
    """The training loop's own tensor work for two optimizer steps (see the module docstring) under the byte
    tracker, after a preference run's precompute pass; returns the largest of their peaks. ``sharded``: FSDP2."""
    loss_fn = preference.loss if preference else build_loss(cfg.get("loss"))
    tracker = modes.tracker(placement, model=model, optimizers=inner_optimizers(optimizer),
                            device_alignment=CUDA_BLOCK_BYTES if target.type == "cuda" else 1,
                            fake_mode=modes.fake_mode)
    accumulation, dtype_name = accumulation_steps(cfg), str(cfg.dtype)
    first = lambda: _batch(cfg, vocab_size, 1, seq_len=seq_len)[0]  # noqa: E731
    peaks = preference.before_steps(tracker, first) if preference else None  # reference copy, precompute pass
    # per step: (micro-batches with a forward, whether gradients are made first without one): the module docstring
    steps = ((1, False), (min(accumulation, 2), False)) if sharded else ((0, True), (1, accumulation > 1))
    for step, (micro_batches, gradients_first) in enumerate(steps):
        with tracker, replayed_nf4_dequantization(tracker, fused=fused_nf4_dequantization(target)), \
                activation_context if activation_context is not None else contextlib.nullcontext():
            if gradients_first:  # before the batch is made: a run holds one micro-batch's input on the device
                _every_gradient(model)
            batches = _batch(cfg, vocab_size, micro_batches, small=step == 0, seq_len=seq_len)
            tokens = micro_batches * batches[0]["tokens"].numel() if batches else 1
            step_on_tensors(model, batches, loss_fn, optimizer, denominator=torch.tensor(float(tokens)) / world_size,
                            device=torch.device("cpu"), autocast=lambda: autocast(dtype_name, target),
                            clip_grad_norm=cfg.get("clip_grad_norm"))
            del batches
        interval = tracker.take_interval()
        peaks = interval if peaks is None else peaks.merge(interval)
    return peaks
