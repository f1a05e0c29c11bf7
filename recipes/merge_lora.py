"""Merge a saved PEFT adapter (LoRA / DoRA) into its base checkpoint and write a Hugging Face model directory.

    mtune run merge_lora --config tiny/merge_lora adapter_dir=out/final output_dir=out/merged

For runs saved with `save_adapter_weights_only: true` (other LoRA runs write the merged model themselves). The base
checkpoint is streamed one tensor at a time in the precision it is stored in (or `dtype`), each adapted weight gets
W + (alpha/r) B A (DoRA: rescaled to its learned row magnitudes), and the result is written to a temporary directory
beside `output_dir`, fsynced, then renamed into place (`atomic_directory`, the publish step of checkpoints), so
`output_dir` is either absent or complete.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from mtune.config import RecipeSchema
from mtune.config.errors import ConfigError
from mtune.config.keys import MERGE_KEYS
from mtune.config.rules import MERGE_RULES
from mtune.errors import OutputExistsError, PathNotFoundError
from mtune.training.checkpointing.adapter_check import check_adapter, refuse_adapter_dir
from mtune.training.checkpointing.atomic import atomic_directory
from mtune.training.checkpointing.merge import save_merged_model
from mtune.training.context import configure_logging
from mtune.training.precision import DTYPES

SCHEMA = RecipeSchema([MERGE_KEYS], rules=MERGE_RULES)

log = logging.getLogger("mtune")


def base_model_dir(cfg: DictConfig, adapter_config: dict) -> Path:
    """``base_model_dir``, else ``model.checkpoint_dir``, else the adapter's ``base_model_name_or_path`` when that
    is a local directory."""
    model = cfg.get("model") or {}
    for key, value in (("base_model_dir", cfg.get("base_model_dir")), ("model.checkpoint_dir", model.get("checkpoint_dir"))):
        if value:
            if not (Path(value) / "config.json").is_file():
                refuse_adapter_dir(value, key)
                raise PathNotFoundError(f"{key}={value}: no config.json there; it must be the adapter's base model "
                                        "(a Hugging Face model directory)")
            return Path(value)
    recorded = adapter_config.get("base_model_name_or_path")
    if recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    raise ConfigError(f"base_model_dir is not set and the adapter's base_model_name_or_path ({recorded!r}) is not a "
                     "local model directory: set base_model_dir=<the base model's Hugging Face directory>")


def main(cfg: DictConfig) -> Path:
    configure_logging()
    adapter_dir = Path(cfg.adapter_dir)
    base = base_model_dir(cfg, check_adapter(adapter_dir))  # an adapter whose files disagree: refused before writing
    out = Path(cfg.output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "is a file" if not out.is_dir() else "already exists and is not empty"
        raise OutputExistsError(f"output_dir={out} {what}: choose another output_dir or remove it")
    dtype = DTYPES[cfg.dtype] if cfg.dtype else None

    with atomic_directory(out) as tmp:
        save_merged_model(base, adapter_dir, tmp, dtype=dtype, max_shard_size=cfg.max_shard_size)
    log.info("merged %s into %s -> %s", adapter_dir, base, out)
    return out
