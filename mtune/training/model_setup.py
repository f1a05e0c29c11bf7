"""Build the model a config names, apply the memory techniques and load its weights, without ever holding a
second copy of the model in memory: build on the meta device -> memory techniques (LoRA/DoRA and NF4 first;
:func:`mtune.training.memory.phases.prepare_model`) -> stream the base weights from the Hugging Face checkpoint
into the meta model one tensor at a time (quantizing each frozen NF4 or fp8-stored weight as it arrives), or draw
them at random -> initialise adapters, or load the saved PEFT adapter of ``lora.adapter_dir``. The FSDP2 path
(:func:`setup_sharded_model`) shards between the techniques and the weights; each rank loads or draws its rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mtune.models import build_model_from_args
from mtune.modules.transformer import TransformerDecoder
from mtune.training.checkpointing.adapter_check import check_adapter
from mtune.training.checkpointing.hf import load_hf_checkpoint
from mtune.training.checkpointing.manifest import check_before_loading
from mtune.training.checkpointing.peft import load_peft_adapter
from mtune.training.checkpointing.sharded import load_hf_checkpoint_sharded
from mtune.training.distributed import shard_model
from mtune.training.memory import phases
from mtune.training.memory.registry import LoraConfig, MemoryConfig
from mtune.training.model_source import ModelSource, resolve_model_source
from mtune.training.placement import Placement
from mtune.training.shards import as_param_like, assign_tensors, full_shape, local_rows

__all__ = ["ModelSource", "resolve_model_source", "setup_model", "materialize_model", "setup_sharded_model",
           "build_sharded_model", "materialize_sharded_model", "init_weights_sharded"]

log = logging.getLogger(__name__)


def _with_lora(memory: MemoryConfig, lora: LoraConfig | Mapping[str, Any] | None) -> MemoryConfig:
    """``memory`` with the ``lora`` node given beside it (callers that hold the two apart)."""
    return memory if lora is None else memory.replace(lora=lora)


def setup_model(
    source: ModelSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    lora: LoraConfig | Mapping[str, Any] | None = None,
    memory: MemoryConfig = MemoryConfig(),
    materialize: bool = True,
    placement: Placement | None = None,
    trainable: bool = True,
    verify_checksums: bool = False,
):
    """Build, transform and load the model. Returns ``(model, activation_context)``: the context to enter around
    forward and backward (activation offloading), or None.

    ``memory`` is the run's memory settings (``MemoryConfig.from_config(cfg)``, the ``lora`` node included; the
    default applies none); ``lora`` a ``lora`` node given beside it (None: ``memory``'s). With
    ``materialize=False`` the model stays on the meta device (planning, or FSDP sharding before the weights are
    loaded). ``placement`` is where offloaded tensors go (default: ``device`` and the CPU). ``trainable=False``
    freezes every weight first (generation), so ``weight_offloading`` may move all of them. With ``lora.adapter_dir``
    the adapters then load that saved PEFT adapter, its files checked first when ``verify_checksums`` (against the
    checksums of the mtune checkpoint holding it: `check_before_loading`)."""
    memory = _with_lora(memory, lora)
    placement = placement or Placement(device)
    model = build_model_from_args(source.args, dtype=dtype)  # on the meta device
    if not trainable:
        model.requires_grad_(False)
    step_context = phases.prepare_model(model, memory, placement)
    if not materialize:
        return model, step_context
    adapter_dir = memory.lora.adapter_dir if memory.lora is not None else None  # continue from a saved adapter
    if adapter_dir:
        if verify_checksums:
            check_before_loading(adapter_dir)
        check_adapter(adapter_dir, model)  # on the meta model: one that does not fit fails before the weights load
    materialize_model(model, source, device=device, dtype=dtype, memory=memory, trainable=trainable)
    if adapter_dir:
        load_peft_adapter(model, adapter_dir)
        log.info("adapter: loaded %s", adapter_dir)
    return model, step_context


def materialize_model(model: TransformerDecoder, source: ModelSource, *, device: torch.device, dtype: torch.dtype,
                      lora: LoraConfig | Mapping[str, Any] | None = None, memory: MemoryConfig = MemoryConfig(),
                      trainable: bool = True) -> None:
    """The second half of :func:`setup_model`: weights for the meta model (loaded, or random without a
    checkpoint), each module handed to the techniques as its weights arrive (NF4 / fp8 storage, offloading to the
    host), then what follows once all are in (fresh adapters and a frozen base). ``mtune plan`` runs this under
    ``FakeTensorMode`` with ``source.checkpoint_dir=None``, so it reads no weight file and allocates nothing."""
    memory = _with_lora(memory, lora)
    load_weights(model, source, device=device, dtype=dtype,
                 after_tensor=lambda module: phases.on_weights(model, module, memory),
                 not_in_checkpoint=phases.added(memory))
    phases.after_weights(model, memory)
    if not trainable:
        model.requires_grad_(False)  # adapters too (they stay on the device: weights are offloaded frozen on arrival)
    log.info("model: %s", parameter_summary(model, source.family, memory))


def parameter_summary(model: nn.Module, family: str, memory: MemoryConfig) -> str:
    """``llama3, 2.6M base parameters + 0.26M adapter = 2.8M, 0.26M trainable (9.29%)`` (no adapter part for a
    full fine-tune): the base model's size as a checkpoint or a README gives it, and what training adds (the
    parameters ``memory``'s techniques add, `mtune.training.memory.phases.added`)."""
    total = sum(p.numel() for p in model.parameters())
    is_added = phases.added(memory)
    adapter = sum(p.numel() for name, p in model.named_parameters() if is_added(name))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counts = (f"{(total - adapter) / 1e6:.1f}M base parameters + {adapter / 1e6:.2f}M adapter = {total / 1e6:.1f}M"
              if adapter else f"{total / 1e6:.1f}M parameters")
    return f"{family}, {counts}, {trainable / 1e6:.2f}M trainable ({100 * trainable / max(total, 1):.2f}%)"


def load_weights(model: TransformerDecoder, source: ModelSource, *, device: torch.device, dtype: torch.dtype,
                 after_tensor=lambda module: None, not_in_checkpoint=lambda name: False) -> None:
    """Give a meta-device model its weights on ``device``: stream the base checkpoint in one tensor at a time (each
    placed straight from the file, then ``after_tensor(module)``: NF4 weights quantized on arrival, so the
    full-precision model never exists at once), or initialise randomly when there is no checkpoint. Parameters
    for which ``not_in_checkpoint(name)`` holds (adapters) are left uninitialised."""
    if source.checkpoint_dir is None:
        _random_weights(model, device, after_tensor, not_in_checkpoint)
        log.info("model: random weights (no checkpoint_dir)")
        return
    load_hf_checkpoint(model, source.checkpoint_dir, dtype=dtype, device=device,
                       not_in_checkpoint=not_in_checkpoint, after_tensor=after_tensor)
    _materialize_meta_tensors(model, device)
    log.info("model: loaded %s", source.checkpoint_dir)


@torch.no_grad()
def _random_weights(model: TransformerDecoder, device: torch.device, after_tensor, not_in_checkpoint) -> None:
    """A random base checkpoint from torch's RNG as it stands: `TransformerDecoder.init_weights`' values for the model
    without what techniques add (``not_in_checkpoint``: adapters, left for their technique), so they depend on the
    model and seed only (``reference: copy`` draws the policy's). Each module is allocated at its first draw and
    handed to ``after_tensor`` after its last, so an offloaded or NF4 base never exists whole on the device. Tied
    embeddings are tied after all are drawn (``after_tensor`` skips them: the final offload moves them)."""
    fills = [(name, fill) for name, fill in model.initializers() if not not_in_checkpoint(name)]
    owner = [name.rpartition(".")[0] for name, _ in fills]
    last = {module: i for i, module in enumerate(owner)}
    tied = {"embed_tokens", "lm_head"} if model.args.tie_embeddings else set()
    for i, (name, fill) in enumerate(fills):
        module = model.get_submodule(owner[i])
        if any(t.is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            module.to_empty(device=device, recurse=False)
        fill(module.get_parameter(name.rpartition(".")[2]))
        if last[owner[i]] == i and owner[i] not in tied:
            after_tensor(module)
    _materialize_meta_tensors(model, device)  # buffers of modules without parameters
    model.tie_weights()


def _materialize_meta_tensors(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) what a base checkpoint does not hold: adapter parameters and any buffers."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, nn.Parameter(torch.empty_like(param, device=device),
                                                   requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)  # keeps its persistence


def setup_sharded_model(
    source: ModelSource,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    lora: LoraConfig | Mapping[str, Any] | None = None,
    memory: MemoryConfig = MemoryConfig(),
    fsdp_reshard_after_forward: bool,
):
    """:func:`setup_model` for FSDP2: build on meta, apply the memory techniques, shard every block and the root
    (:func:`build_sharded_model`), then load each rank's rows of the checkpoint (or random weights) and initialise
    the adapters (:func:`materialize_sharded_model`). No rank holds the full model; see
    :mod:`mtune.training.distributed`. ``fsdp_reshard_after_forward`` is the config's key of that name; the
    techniques give FSDP2 their options (CPU offload). Returns ``(model, activation_context)``."""
    memory = _with_lora(memory, lora)
    model, offload = build_sharded_model(source, device=device, dtype=dtype, memory=memory,
                                         fsdp_reshard_after_forward=fsdp_reshard_after_forward)
    materialize_sharded_model(model, source, device=device, dtype=dtype, seed=seed, memory=memory)
    return model, offload


def build_sharded_model(source: ModelSource, *, device: torch.device, dtype: torch.dtype,
                        lora: LoraConfig | Mapping[str, Any] | None = None, memory: MemoryConfig = MemoryConfig(),
                        fsdp_reshard_after_forward: bool, placement: Placement | None = None):
    """The first half of :func:`setup_sharded_model`: the model on the meta device with its memory techniques
    (offloading between ``device`` and the host, or ``placement``), every block and the root sharded (FSDP2
    ``fully_shard``). Returns ``(model, activation_context)``."""
    memory = _with_lora(memory, lora)
    placement = placement or Placement(device)
    model, offload = setup_model(source, device=device, dtype=dtype, memory=memory, materialize=False,
                                 placement=placement)
    shard_model(model, reshard_after_forward=fsdp_reshard_after_forward,
                **phases.sharding_options(memory, placement))
    return model, offload


def materialize_sharded_model(model: TransformerDecoder, source: ModelSource, *, device: torch.device | str,
                              dtype: torch.dtype, seed: int, lora: LoraConfig | Mapping[str, Any] | None = None,
                              memory: MemoryConfig = MemoryConfig()) -> None:
    """The second half of :func:`setup_sharded_model`: each rank's rows of the checkpoint (or of random weights,
    without ``source.checkpoint_dir``), then fresh adapters. ``mtune plan`` runs this under ``FakeTensorMode``."""
    # Every rank draws the same full tensors from the same RNG stream, then keeps its rows; the draws are those of
    # setup_model on one device (the base weights, then the adapters' own), so the values do not depend on the ranks.
    memory = _with_lora(memory, lora)
    torch.manual_seed(seed)
    if source.checkpoint_dir is not None:
        load_hf_checkpoint_sharded(model, source.checkpoint_dir, dtype=dtype, device=device,
                                   arrives_whole=phases.arrives_whole(memory),
                                   not_in_checkpoint=phases.added(memory))
        log.info("model: loaded %s, sharded", source.checkpoint_dir)
    else:
        init_weights_sharded(model, device, arrives_whole=phases.arrives_whole(memory),
                             not_in_checkpoint=phases.added(memory))
    phases.after_weights(model, memory, sharded=True)


@torch.no_grad()
def init_weights_sharded(model: TransformerDecoder, device: torch.device | str,
                         arrives_whole: Callable[[nn.Module, str], Callable | None] | None = None,
                         not_in_checkpoint: Callable[[str], bool] = lambda name: False) -> nn.Module:
    """Random weights for a sharded meta model, by the model's own :meth:`~TransformerDecoder.initializers`: each
    full tensor is filled on every rank from the same RNG state (call ``torch.manual_seed`` first) and each rank
    keeps its rows, so the values equal one device's random weights (:func:`setup_model`) whatever the number of
    ranks. A weight for which ``arrives_whole(module, leaf)`` names a function (QLoRA's NF4 bases) is stored whole
    and split by it. Parameters a technique adds (``not_in_checkpoint(name)``: adapters) are neither drawn nor filled
    (as on one device): their own initialisation follows (`mtune.training.memory.phases.after_weights`)."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens: it is kept once
    tensors = {}
    for name, fill in model.initializers():
        if not_in_checkpoint(name):
            continue
        param = model.get_parameter(name)
        full = torch.empty(full_shape(model, name, param), dtype=param.dtype, device=device)
        fill(full)  # every draw one device makes (a tied lm_head again): its RNG stream
        if name not in params:
            continue
        module_name, _, leaf = name.rpartition(".")
        store = arrives_whole(model.get_submodule(module_name), leaf) if arrives_whole else None
        local = store(full, param) if store is not None else local_rows(full, param)
        tensors[name] = as_param_like(local, param)
    assign_tensors(model, tensors)
    return model
