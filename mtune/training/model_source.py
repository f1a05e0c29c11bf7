"""The model a config names (``model``: a Hugging Face checkpoint directory, or a family and a named size with
random weights), read into a :class:`ModelSource` before anything is built: its family and arguments, with the
config's own model keys applied (``router_aux_loss_coef``). :mod:`mtune.training.model_setup` builds it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtune.config.errors import ConfigError
from mtune.errors import PathNotFoundError
from mtune.models import model_args
from mtune.modules.transformer import DecoderArgs
from mtune.training.checkpointing.adapter_check import refuse_adapter_dir
from mtune.training.checkpointing.hf import load_hf_config
from mtune.training.checkpointing.manifest import check_before_loading

__all__ = ["ModelSource", "resolve_model_source"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """Where a config's model comes from: a Hugging Face checkpoint directory, or a named size with random
    weights (then ``checkpoint_dir`` is None)."""

    family: str
    args: DecoderArgs
    checkpoint_dir: Path | None



def resolve_model_source(model_cfg: Mapping[str, Any], verify_checksums: bool = False,
                         adapter_key: str = "lora.adapter_dir") -> ModelSource:
    """Read ``model.checkpoint_dir`` (its ``config.json``) or ``model.family`` + ``model.size``. With
    ``verify_checksums``, a ``checkpoint_dir`` inside an mtune checkpoint (``final/model``) must match the checksums
    saved with it (see :func:`mtune.training.checkpointing.manifest.check_before_loading`). A ``checkpoint_dir``
    that is a PEFT adapter directory is refused with a hint to set ``adapter_key`` to it instead."""
    checkpoint_dir = model_cfg.get("checkpoint_dir")
    size = model_cfg.get("size")
    if checkpoint_dir and size:
        raise ConfigError("model: set either checkpoint_dir (load weights) or size (random weights), not both")
    if checkpoint_dir:
        path = Path(checkpoint_dir)
        if not (path / "config.json").is_file():
            refuse_adapter_dir(path, "model.checkpoint_dir", adapter_key)
            raise PathNotFoundError(
                f"model.checkpoint_dir={checkpoint_dir}: no config.json there; download the model first "
                f"(mtune download <repo> --output-dir {checkpoint_dir})"
            )
        family, args = load_hf_config(path)
        if verify_checksums:
            check_before_loading(path)
        return ModelSource(family, _router_aux_loss(args, model_cfg), path)
    if size:
        family = model_cfg.get("family")
        if not family:
            raise ConfigError("model.size needs model.family (e.g. model.family=llama3_2 model.size=1B)")
        return ModelSource(family, _router_aux_loss(model_args(family, size), model_cfg), None)
    raise ConfigError("model: set checkpoint_dir (a Hugging Face model directory) or family + size")



def _router_aux_loss(args: DecoderArgs, model_cfg: Mapping[str, Any]) -> DecoderArgs:
    """``args`` with ``model.router_aux_loss_coef`` applied (MoE families only), and a log line when the
    load-balancing loss is on."""
    coef = model_cfg.get("router_aux_loss_coef")
    if coef is not None:
        if not hasattr(args, "router_aux_loss_coef"):
            raise ConfigError(f"model.router_aux_loss_coef={coef}: {args.family} has no router; remove the key "
                              "(it applies to mixture-of-experts models)")
        args = dataclasses.replace(args, router_aux_loss_coef=float(coef), output_router_logits=coef > 0)
    if getattr(args, "output_router_logits", False):
        log.info("router load-balancing loss on: %g x its value added to the training loss",
                 args.router_aux_loss_coef)
    return args
