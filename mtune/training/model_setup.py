"""Build the model a config names, apply the memory techniques and load its weights, without ever holding a
second copy of the model in memory.

Order: build on the meta device -> memory techniques (LoRA/DoRA and NF4 first; see
:func:`mtune.training.memory.apply.apply_memory_techniques`) -> stream the base weights from the Hugging Face
checkpoint straight into the meta model, one tensor at a time (quantizing each frozen NF4 or fp8-stored weight as it arrives), or
initialise randomly -> initialise adapters (the recipe may then load a saved PEFT adapter). The FSDP2 path
(:func:`setup_sharded_model`) shards between the memory techniques and the weights, and each rank loads or draws
only its rows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch.distributed.tensor import DTensor

from mtune.config.errors import ConfigError
from mtune.errors import PathNotFoundError
from mtune.models import build_model_from_args, model_args
from mtune.modules.lora import LoRALinear, freeze_base, has_nf4_weight, is_adapter_param, reset_lora_parameters
from mtune.modules.fp8_linear import quantize_fp8_weight_
from mtune.modules.nf4_linear import is_nf4, quantize_nf4
from mtune.modules.transformer import DecoderArgs, TransformerDecoder
from mtune.training.checkpointing.hf import load_hf_checkpoint, load_hf_config
from mtune.training.checkpointing.manifest import check_before_loading
from mtune.training.checkpointing.sharded import (
    as_param_like,
    assign_tensors,
    load_hf_checkpoint_sharded,
    local_rows,
)
from mtune.training.distributed import shard_model
from mtune.training.memory.apply import apply_memory_techniques
from mtune.training.memory.placement import Placement
from mtune.training.memory.registry import LoraConfig, MemoryConfig
from mtune.training.memory.weight_offloading import offloaded_weights_materialized, weight_offloader

__all__ = ["ModelSource", "resolve_model_source", "setup_model", "materialize_model", "setup_sharded_model",
           "build_sharded_model", "materialize_sharded_model", "init_weights_sharded", "reset_adapters_sharded"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """Where a config's model comes from: a Hugging Face checkpoint directory, or a named size with random
    weights (then ``checkpoint_dir`` is None)."""

    family: str
    args: DecoderArgs
    checkpoint_dir: Path | None


def resolve_model_source(model_cfg: Mapping[str, Any], verify_checksums: bool = False) -> ModelSource:
    """Read ``model.checkpoint_dir`` (its ``config.json``) or ``model.family`` + ``model.size``. With
    ``verify_checksums``, a ``checkpoint_dir`` inside an mtune checkpoint (``final/model``) must match the checksums
    saved with it (see :func:`mtune.training.checkpointing.manifest.check_before_loading`)."""
    checkpoint_dir = model_cfg.get("checkpoint_dir")
    size = model_cfg.get("size")
    if checkpoint_dir and size:
        raise ConfigError("model: set either checkpoint_dir (load weights) or size (random weights), not both")
    if checkpoint_dir:
        path = Path(checkpoint_dir)
        if not (path / "config.json").is_file():
            raise PathNotFoundError(
                f"model.checkpoint_dir={checkpoint_dir}: no config.json there; download the model first "
                f"(mtune download <repo> --output-dir {checkpoint_dir})"
            )
        family, args = load_hf_config(path)
        if verify_checksums:
            check_before_loading(path)
        return ModelSource(family, args, path)
    if size:
        family = model_cfg.get("family")
        if not family:
            raise ConfigError("model.size needs model.family (e.g. model.family=llama3_2 model.size=1B)")
        return ModelSource(family, model_args(family, size), None)
    raise ConfigError("model: set checkpoint_dir (a Hugging Face model directory) or family + size")


def _quantize_when_loaded(module: nn.Module) -> None:
    # Quantize each frozen base weight as soon as its tensor arrives (NF4 for QLoRA, or fp8 storage): the whole model
    # never exists in bf16.
    if has_nf4_weight(module) and not is_nf4(module.weight) and not module.weight.is_meta:
        module.weight = quantize_nf4(module.weight)
    quantize_fp8_weight_(module)


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
):
    """Build, transform and load the model. Returns ``(model, activation_context)``: the activation-offloading
    context to enter around forward and backward, or None.

    ``lora`` is the config's ``lora`` node (None for a full fine-tune); ``memory`` the run's memory keys
    (``MemoryConfig.from_config(cfg)``; the default applies none). With ``materialize=False`` the model stays on
    the meta device (planning, or FSDP sharding before the weights are loaded). ``placement`` is where offloaded
    tensors go (default: ``device`` and the CPU). ``trainable=False`` freezes every weight first (generation), so
    ``weight_offloading`` may move all of them.
    """
    model = build_model_from_args(source.args, dtype=dtype)  # on the meta device
    if not trainable:
        model.requires_grad_(False)
    offload = apply_memory_techniques(model, memory, lora=lora, placement=placement or Placement(device))
    if not materialize:
        return model, offload
    materialize_model(model, source, device=device, dtype=dtype, lora=lora, trainable=trainable)
    return model, offload


def materialize_model(model: TransformerDecoder, source: ModelSource, *, device: torch.device, dtype: torch.dtype,
                      lora: LoraConfig | Mapping[str, Any] | None = None, trainable: bool = True) -> None:
    """The second half of :func:`setup_model`: weights for the meta model (loaded, or random without a
    checkpoint; frozen weights go to host memory as they arrive when ``weight_offloading`` hooked the model), then
    fresh adapters and a frozen base. ``mtune plan`` runs this under ``FakeTensorMode`` with
    ``source.checkpoint_dir=None``, so it reads no weight file and allocates nothing."""
    offloader = weight_offloader(model)

    def after_tensor(module: nn.Module) -> None:
        _quantize_when_loaded(module)
        if offloader is not None:
            offloader.offload_module(module)  # frozen weights leave the device as soon as they arrive

    load_weights(model, source, device=device, dtype=dtype, after_tensor=after_tensor)
    if lora is not None:
        dora = any(isinstance(m, LoRALinear) and m.magnitude is not None for m in model.modules())
        with offloaded_weights_materialized(model) if dora else contextlib.nullcontext():
            reset_lora_parameters(model)  # adapters start at zero update; NF4 bases are already quantized
        freeze_base(model)
    if offloader is not None:
        offloader.offload()  # what loading did not move: random initialisation
    if not trainable:
        model.requires_grad_(False)  # adapters too (they stay on the device: weights are offloaded frozen on arrival)
    log.info("model: %s", parameter_summary(model, source.family))


def parameter_summary(model: nn.Module, family: str) -> str:
    """``llama3, 2.6M base parameters + 0.26M adapter = 2.8M, 0.26M trainable (9.29%)`` (no adapter part for a
    full fine-tune): the base model's size as a checkpoint or a README gives it, and what training adds."""
    total = sum(p.numel() for p in model.parameters())
    adapter = sum(p.numel() for name, p in model.named_parameters() if is_adapter_param(name))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    counts = (f"{(total - adapter) / 1e6:.1f}M base parameters + {adapter / 1e6:.2f}M adapter = {total / 1e6:.1f}M"
              if adapter else f"{total / 1e6:.1f}M parameters")
    return f"{family}, {counts}, {trainable / 1e6:.2f}M trainable ({100 * trainable / max(total, 1):.2f}%)"


def load_weights(model: TransformerDecoder, source: ModelSource, *, device: torch.device, dtype: torch.dtype,
                 after_tensor=_quantize_when_loaded) -> None:
    """Give a meta-device model its weights on ``device``: stream the base checkpoint in one tensor at a time (each
    placed straight from the file, then ``after_tensor(module)``: NF4 weights quantized on arrival, so the
    full-precision model never exists at once), or initialise randomly when there is no checkpoint. Adapter
    parameters are left uninitialised."""
    if source.checkpoint_dir is None:
        _random_weights(model, device, after_tensor)
        log.info("model: random weights (no checkpoint_dir)")
        return
    load_hf_checkpoint(model, source.checkpoint_dir, dtype=dtype, device=device,
                       not_in_checkpoint=is_adapter_param, after_tensor=after_tensor)
    _materialize_meta_tensors(model, device)
    log.info("model: loaded %s", source.checkpoint_dir)


@torch.no_grad()
def _random_weights(model: TransformerDecoder, device: torch.device, after_tensor) -> None:
    """`TransformerDecoder.init_weights`'s values (the same draws in the same order), one module at a time: each
    module is allocated when its first parameter is drawn and handed to ``after_tensor`` after its last, so an
    offloaded or NF4 base never exists whole on the device, as when a checkpoint streams in. Tied embeddings are
    tied after all are drawn (``after_tensor`` skips them: the final offload moves them)."""
    fills = list(model.initializers())
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
    fsdp_cpu_offload: bool,
):
    """:func:`setup_model` for FSDP2: build on meta, apply the memory techniques, shard every block and the root
    (:func:`build_sharded_model`), then load each rank's rows of the checkpoint (or random weights) and initialise
    the adapters (:func:`materialize_sharded_model`). No rank holds the full model; see
    :mod:`mtune.training.distributed`. ``fsdp_reshard_after_forward`` and ``fsdp_cpu_offload`` are the config's keys
    of those names. Returns ``(model, activation_context)``."""
    model, offload = build_sharded_model(source, device=device, dtype=dtype, lora=lora, memory=memory,
                                         fsdp_reshard_after_forward=fsdp_reshard_after_forward,
                                         fsdp_cpu_offload=fsdp_cpu_offload)
    materialize_sharded_model(model, source, device=device, dtype=dtype, seed=seed, lora=lora)
    return model, offload


def build_sharded_model(source: ModelSource, *, device: torch.device, dtype: torch.dtype,
                        lora: LoraConfig | Mapping[str, Any] | None = None, memory: MemoryConfig = MemoryConfig(),
                        fsdp_reshard_after_forward: bool, fsdp_cpu_offload: bool, placement: Placement | None = None):
    """The first half of :func:`setup_sharded_model`: the model on the meta device with its memory techniques
    (offloading between ``device`` and the host, or ``placement``), every block and the root sharded (FSDP2
    ``fully_shard``). Returns ``(model, activation_context)``."""
    model, offload = setup_model(source, device=device, dtype=dtype, lora=lora, memory=memory, materialize=False,
                                 placement=placement)
    shard_model(model, reshard_after_forward=fsdp_reshard_after_forward, cpu_offload=fsdp_cpu_offload)
    return model, offload


def materialize_sharded_model(model: TransformerDecoder, source: ModelSource, *, device: torch.device | str,
                              dtype: torch.dtype, seed: int, lora: LoraConfig | Mapping[str, Any] | None = None) -> None:
    """The second half of :func:`setup_sharded_model`: each rank's rows of the checkpoint (or of random weights,
    without ``source.checkpoint_dir``), then fresh adapters. ``mtune plan`` runs this under ``FakeTensorMode``."""
    # Every rank draws the same full tensors from the same RNG stream, then keeps its rows; the draws are those of
    # setup_model on one device (base weights, then adapters), so the values do not depend on the ranks.
    torch.manual_seed(seed)
    if source.checkpoint_dir is not None:
        load_hf_checkpoint_sharded(model, source.checkpoint_dir, dtype=dtype, device=device,
                                   not_in_checkpoint=is_adapter_param)
        log.info("model: loaded %s, sharded", source.checkpoint_dir)
    else:
        init_weights_sharded(model, device)
    if lora is not None:
        reset_adapters_sharded(model)


@torch.no_grad()
def init_weights_sharded(model: TransformerDecoder, device: torch.device | str) -> nn.Module:
    """Random weights for a sharded meta model, by the model's own :meth:`~TransformerDecoder.initializers`: each
    full tensor is filled on every rank from the same RNG state (call ``torch.manual_seed`` first) and each rank
    keeps its rows, so the values equal :meth:`~TransformerDecoder.init_weights` on one device whatever the number
    of ranks. NF4 weights are quantized whole before they are split. Adapters are drawn (as on one device) but left
    for :func:`reset_adapters_sharded`."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens: it is kept once
    tensors = {}
    for name, fill in model.initializers():
        param = model.get_parameter(name)
        full = torch.empty(param.shape, dtype=param.dtype, device=device)
        fill(full)  # every draw init_weights makes (adapters, a tied lm_head again): the RNG stream of one device
        if name not in params or is_adapter_param(name):
            continue
        module_name, _, leaf = name.rpartition(".")
        if leaf == "weight" and has_nf4_weight(model.get_submodule(module_name)):
            full = quantize_nf4(full).data
        tensors[name] = as_param_like(local_rows(full, param), param)
    assign_tensors(model, tensors)
    return model


@torch.no_grad()
def reset_adapters_sharded(model: nn.Module) -> None:
    """Initialise every LoRA / DoRA adapter of a sharded model as :meth:`LoRALinear.reset_adapter` does on one
    device (its :meth:`~LoRALinear.adapter_initializers` fill full tensors in module order, each rank keeps its
    rows; DoRA magnitudes are the row norms of the rank's own rows of the base weight), whatever the number of
    ranks. Call after the base weights are loaded, with the same RNG state on every rank; freezes the base."""
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        local_weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        for leaf, fill in module.adapter_initializers():
            param = module.get_parameter(leaf)
            full = torch.empty(param.shape, dtype=param.dtype, device=local_weight.device)
            fill(full)
            tensors[f"{name}.{leaf}"] = as_param_like(local_rows(full, param), param)
        if module.magnitude is not None:
            norms = module.row_norms(local_weight).to(module.magnitude.dtype)
            tensors[f"{name}.magnitude"] = as_param_like(norms, module.magnitude)
    assign_tensors(model, tensors)
    freeze_base(model)
